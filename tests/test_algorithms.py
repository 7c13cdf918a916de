"""Single-process tests of megatron_gndpo.algorithms against plain float64 references.

References are written as loops over Python floats so they share no code with the vectorised
implementation. Shapes: [B, T] = [batch, response length].
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from megatron_gndpo import algorithms as alg

SEEDS = (0, 1, 2, 3)

# The ALGORITHMS.md §7 test vector.
VECTOR_SCORES = [[0.2, -1.5, -5.0, 0.0], [2.5, -0.1, 0.0, 0.0]]
VECTOR_MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]
VECTOR_ADVANTAGES = [[0.354854, -0.260709, -1.528043, 0.0], [1.187673, 0.246225, 0.0, 0.0]]


# ---------------------------------------------------------------- inputs and references


def random_batch(seed: int, rows: int = 7, length: int = 9) -> dict[str, torch.Tensor]:
    """Right-padded ragged batch with one all-masked row and one full row; float64 inputs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    lengths[0], lengths[-1] = 0, length
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -3.0 * torch.rand(rows, length, generator=gen, dtype=torch.float64)
    # Teacher log-probs spread enough that some |lt - lo| exceed the clip C = 5.
    teacher = old + 4.0 * torch.randn(rows, length, generator=gen, dtype=torch.float64)
    return {
        "teacher": teacher,
        "old": old,
        "mask": mask,
        "logprobs": old + 0.3 * torch.randn(rows, length, generator=gen, dtype=torch.float64),
        "rewards": torch.randn(rows, generator=gen, dtype=torch.float64),
        "token_rewards": torch.randn(rows, length, generator=gen, dtype=torch.float64),
    }


def ref_whiten(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    valid = [
        x
        for row, mrow in zip(values, mask, strict=True)
        for x, m in zip(row, mrow, strict=True)
        if m
    ]
    n = len(valid)
    mu = sum(valid) / (n + 1e-8)
    var = sum((x - mu) ** 2 for x in valid) / (n + 1e-8) * n / (n - 1)
    return [
        [(x - mu) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(values, mask, strict=True)
    ]


def ref_scores(batch: dict[str, torch.Tensor], clip: float) -> list[list[float]]:
    out = []
    for lt_row, lo_row, m_row in zip(
        batch["teacher"].tolist(), batch["old"].tolist(), batch["mask"].tolist(), strict=True
    ):
        out.append(
            [
                min(max(lt - lo, -clip), clip) if m else 0.0
                for lt, lo, m in zip(lt_row, lo_row, m_row, strict=True)
            ]
        )
    return out


def ref_returns(rewards: list[list[float]], mask: list[list[float]], gamma: float):
    """Discounted returns over each row's valid tokens; masked positions carry the next return."""
    out = []
    for r_row, m_row in zip(rewards, mask, strict=True):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
            row[t] = running
        out.append(row)
    return out


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected_t, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- the test vector


def test_test_vector_from_algorithms_md():
    scores = torch.tensor(VECTOR_SCORES, dtype=torch.float64)
    mask = torch.tensor(VECTOR_MASK)
    old = torch.full_like(scores, -2.0)
    adv = alg.gndpo_advantages(old + scores, old, mask, kl_clip=5.0)
    print("GNDPO advantages:", [[round(x, 6) for x in row] for row in adv.tolist()])
    close(adv, VECTOR_ADVANTAGES, atol=1e-5)
    n, sum_c, sum_c2 = alg.masked_moments(scores, mask).tolist()
    mu = sum_c / (n + 1e-8)
    var = (sum_c2 - 2 * mu * sum_c + mu * mu * n) / (n + 1e-8) * n / (n - 1)
    assert n == 5 and mu == pytest.approx(-0.78) and var == pytest.approx(7.627, abs=1e-6)


# ---------------------------------------------------------------- estimators vs references


@pytest.mark.parametrize("seed", SEEDS)
def test_opd_and_gndpo_match_reference(seed):
    b = random_batch(seed)
    c = ref_scores(b, 5.0)
    close(alg.opd_advantages(b["teacher"], b["old"], b["mask"], kl_clip=5.0), c)
    close(alg.distillation_scores(b["teacher"], b["old"], b["mask"], kl_clip=5.0), c)
    gndpo = alg.gndpo_advantages(b["teacher"], b["old"], b["mask"], kl_clip=5.0)
    assert gndpo.dtype == torch.float32
    close(gndpo, ref_whiten(c, b["mask"].tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_gndpo_halves_baseline_only_and_scale_only(seed):
    """The ablations: baseline only m·(c − mu), scale only m·c/σ; both off is OPD."""
    b = random_batch(seed)
    c = ref_scores(b, 5.0)
    valid = [x for row, mrow in zip(c, b["mask"].tolist(), strict=True)
             for x, m in zip(row, mrow, strict=True) if m]  # fmt: skip
    n = len(valid)
    mu = sum(valid) / (n + 1e-8)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in valid) / (n + 1e-8) * n / (n - 1) + 1e-8)
    mask = b["mask"].tolist()

    def ref(f):
        return [[f(x) if m else 0.0 for x, m in zip(row, mrow, strict=True)]
                for row, mrow in zip(c, mask, strict=True)]  # fmt: skip

    args = (b["teacher"], b["old"], b["mask"])
    close(alg.gndpo_advantages(*args, divide_std=False), ref(lambda x: x - mu))
    close(alg.gndpo_advantages(*args, subtract_mean=False), ref(lambda x: x / sigma))
    close(alg.gndpo_advantages(*args, subtract_mean=False, divide_std=False), c)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [0.0, 0.9, 1.0])
def test_reinforce_pp_matches_reference(seed, gamma):
    b = random_batch(seed)
    mask = b["mask"].clone()
    mask[2, 0] = 0.0  # an interior hole at a row start: it adds nothing and resets nothing
    mask[-1, 3] = 0.0
    returns = ref_returns(b["token_rewards"].tolist(), mask.tolist(), gamma)
    valid_returns = alg.discounted_returns(b["token_rewards"], mask, gamma=gamma) * mask
    close(
        valid_returns,
        [
            [g * m for g, m in zip(gr, mr, strict=True)]
            for gr, mr in zip(returns, mask.tolist(), strict=True)
        ],
    )
    adv = alg.reinforce_pp_advantages(b["token_rewards"], mask, gamma=gamma)
    close(adv, ref_whiten(returns, mask.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_gndpo_is_reinforce_pp_with_score_rewards_and_no_discount(seed):
    b = random_batch(seed)
    c = alg.distillation_scores(b["teacher"], b["old"], b["mask"], kl_clip=5.0)
    torch.testing.assert_close(
        alg.gndpo_advantages(b["teacher"], b["old"], b["mask"], kl_clip=5.0),
        alg.reinforce_pp_advantages(c, b["mask"], gamma=0.0),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_outcome_token_rewards_on_last_valid_token(seed):
    b = random_batch(seed)
    mask = b["mask"].clone()
    mask[1, -1] = 1.0  # not right-padded: the last valid token is still the last position set
    out = alg.outcome_token_rewards(b["rewards"], mask)
    expected = torch.zeros_like(mask, dtype=torch.float64)
    for i, m_row in enumerate(mask.tolist()):
        valid = [t for t, m in enumerate(m_row) if m]
        if valid:
            expected[i, valid[-1]] = b["rewards"][i]
    close(out, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_grpo_matches_reference(seed, group_size):
    b = random_batch(seed, rows=8)
    rewards = b["rewards"].clone()
    if group_size > 1:
        rewards[:group_size] = 0.5  # a constant group: zero advantage, not NaN
    out = alg.grpo_advantages(rewards, b["mask"], group_size=group_size)
    expected = []
    for i, m_row in enumerate(b["mask"].tolist()):
        g0 = i - i % group_size
        group = rewards[g0 : g0 + group_size].tolist()
        if group_size == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / group_size
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        a = (rewards[i].item() - mean) / (std + 1e-6)
        expected.append([a if m else 0.0 for m in m_row])
    close(out, expected)
    assert torch.isfinite(out).all()


def _ref_kl(log_p: list[float], log_q: list[float]) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q, strict=True) if a > -math.inf)


@pytest.mark.parametrize("seed", SEEDS)
def test_vopd_and_token_kl_match_reference(seed):
    b = random_batch(seed, rows=3, length=4)
    gen = torch.Generator().manual_seed(100 + seed)
    student = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64).log_softmax(-1)
    teacher = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64).log_softmax(-1)
    kl = alg.token_kl_full(student, teacher)
    expected = [
        [_ref_kl(s, t) for s, t in zip(sr, tr, strict=True)]
        for sr, tr in zip(student.tolist(), teacher.tolist(), strict=True)
    ]
    close(kl, expected)
    # top-k: renormalise both over the student's top-3 set, then the KL
    top_s, ids = student.topk(3, dim=-1)
    top_t = teacher.gather(-1, ids)
    expected_topk = []
    for sr, tr in zip(top_s.tolist(), top_t.tolist(), strict=True):
        row = []
        for s, t in zip(sr, tr, strict=True):
            zs, zt = math.log(sum(map(math.exp, s))), math.log(sum(map(math.exp, t)))
            row.append(_ref_kl([x - zs for x in s], [x - zt for x in t]))
        expected_topk.append(row)
    close(alg.token_kl_topk(top_s, top_t), expected_topk)
    # with k = V the renormalisation changes nothing
    close(alg.token_kl_topk(student, teacher), kl)
    adv = alg.vopd_advantages(b["teacher"], b["old"], b["mask"], kl)
    expected_adv = [
        [(lt - lo + k) if m else 0.0 for lt, lo, k, m in zip(*rows, strict=True)]
        for rows in zip(
            b["teacher"].tolist(), b["old"].tolist(), kl.tolist(), b["mask"].tolist(), strict=True
        )
    ]
    close(adv, expected_adv)


def test_token_kl_handles_zero_probabilities():
    student = torch.tensor([[[0.0, -math.inf]]])  # p_S = [1, 0]
    teacher = torch.tensor([[[-0.5, -math.inf]]])
    student.requires_grad_(True)
    kl = alg.token_kl_full(student, teacher)
    kl.sum().backward()
    close(kl, [[0.5]])
    assert torch.isfinite(student.grad).all()


def test_mix_advantages():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    close(alg.mix_advantages(a, b, outcome_weight=0.3), a.double() + 0.3 * b.double())


# ---------------------------------------------------------------- losses vs references


def _ref_surrogate(ratio: float, a: float, low: float, high: float, dual: float | None):
    """(loss, d loss / d log ratio) of the clipped surrogate, for one token."""
    unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
    loss, grad = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * ratio)
    if dual is not None and a < 0 and loss > -a * dual:
        loss, grad = -a * dual, 0.0
    return loss, grad


def _loss_inputs(seed: int):
    b = random_batch(seed)
    adv = torch.randn(
        b["mask"].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    # ratios spread from ~0.1 to ~10 so every branch (clip, dual clip) is exercised
    lp = (b["old"] + torch.linspace(-2.3, 2.3, adv.numel()).reshape(adv.shape)).requires_grad_(True)
    old = b["old"].clone().requires_grad_(True)
    adv.requires_grad_(True)
    return b, lp, old, adv


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high", "dual"), [(0.2, 0.2, None), (0.1, 0.28, 3.0)])
def test_ppo_clip_matches_reference(seed, low, high, dual):
    _, lp, old, adv = _loss_inputs(seed)
    loss, info = alg.ppo_clip_loss(lp, old, adv, clip_low=low, clip_high=high, dual_clip=dual)
    loss.sum().backward()
    exp_loss, exp_grad = [], []
    for lp_v, lo_v, a in zip(
        lp.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(), strict=True
    ):
        value, grad = _ref_surrogate(math.exp(lp_v - lo_v), a, low, high, dual)
        exp_loss.append(value)
        exp_grad.append(grad)
    close(loss.flatten(), exp_loss)
    close(lp.grad.flatten(), exp_grad)
    close(info["ratio"], (lp - old).exp().detach())
    assert old.grad is None and adv.grad is None
    if dual is not None:
        assert info["dual_clipped"].sum() > 0  # the inputs exercise the dual clip


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_reference(seed):
    b, lp, old, adv = _loss_inputs(seed)
    loss, info = alg.gspo_token_loss(lp, old, adv, b["mask"], clip_low=0.2, clip_high=0.2)
    (loss * b["mask"]).sum().backward()
    for i, m_row in enumerate(b["mask"].tolist()):
        diffs = [p - o for p, o, m in zip(lp[i].tolist(), old[i].tolist(), m_row, strict=True) if m]
        log_s = min(10.0, sum(diffs) / max(1, len(diffs)))
        for t, m in enumerate(m_row):
            value, grad = _ref_surrogate(math.exp(log_s), adv[i, t].item(), 0.2, 0.2, None)
            assert loss[i, t].item() == pytest.approx(value, rel=1e-5, abs=1e-6)
            assert info["ratio"][i, t].item() == pytest.approx(math.exp(log_s), rel=1e-5)
            assert lp.grad[i, t].item() == pytest.approx(grad * m, rel=1e-5, abs=1e-6)
    assert old.grad is None and adv.grad is None


def test_gspo_log_ratio_is_capped():
    lp = torch.zeros(1, 3, requires_grad=True)
    old = torch.full((1, 3), -50.0)
    loss, info = alg.gspo_token_loss(
        lp, old, -torch.ones(1, 3), torch.ones(1, 3), clip_low=0.2, clip_high=0.2
    )
    close(info["ratio"], torch.full((1, 3), math.exp(10.0)), atol=1e-1)
    assert torch.isfinite(loss).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_is_pg_matches_reference(seed):
    _, lp, old, adv = _loss_inputs(seed)
    loss, info = alg.importance_sampled_pg_loss(lp, old, adv)
    loss.sum().backward()
    ratio = (lp - old).exp().detach()
    close(loss, -adv.detach() * ratio)
    close(lp.grad, -adv.detach() * ratio)
    assert info["clipped"].sum() == 0 and info["dual_clipped"].sum() == 0
    assert old.grad is None and adv.grad is None
    assert set(alg.POLICY_LOSSES) == {"ppo_clip", "gspo", "is_pg"}


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", alg.AGGREGATIONS)
def test_aggregation_matches_reference_and_is_split_invariant(seed, mode):
    b = random_batch(seed)
    loss = torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(seed))
    loss = loss.masked_fill(b["mask"] == 0, math.nan)  # padding junk must not leak
    rows = [
        [x for x, m in zip(lr, mr, strict=True) if m]
        for lr, mr in zip(loss.tolist(), b["mask"].tolist(), strict=True)
    ]
    if mode == "token-mean":
        expected = sum(map(sum, rows)) / sum(map(len, rows))
    else:
        means = [sum(r) / len(r) for r in rows if r]
        expected = sum(means) / len(means)
    num, count = alg.aggregate_loss(loss, b["mask"], mode)
    assert count.dtype == torch.int32 and count.dim() == 0
    assert (num / count).item() == pytest.approx(expected, rel=1e-5)
    parts = [
        alg.aggregate_loss(loss[i : i + 2], b["mask"][i : i + 2], mode) for i in range(0, 7, 2)
    ]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert total.item() == pytest.approx(expected, rel=1e-5)
    assert alg.global_count(count).item() == count.item()


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("seed", SEEDS)
def test_metrics_match_reference(seed):
    b = random_batch(seed)
    valid = [
        (lt - lo, m)
        for lt, lo, m in zip(
            b["teacher"].flatten().tolist(),
            b["old"].flatten().tolist(),
            b["mask"].flatten().tolist(),
            strict=True,
        )
        if m
    ]
    cs = [min(max(d, -5.0), 5.0) for d, _ in valid]
    n = len(cs)
    mean = sum(cs) / n
    std = math.sqrt(sum((c - mean) ** 2 for c in cs) / (n - 1))
    got = alg.score_metrics(b["teacher"], b["old"], b["mask"], kl_clip=5.0)
    assert got["score/mean"] == pytest.approx(mean, rel=1e-5)
    assert got["score/std"] == pytest.approx(std, rel=1e-5)
    assert got["score/rms"] == pytest.approx(math.sqrt(sum(c * c for c in cs) / n), rel=1e-6)
    assert got["score/clamp_frac"] == pytest.approx(sum(abs(d) > 5 for d, _ in valid) / n)
    assert 0 < got["score/clamp_frac"] < 1

    adv = alg.gndpo_advantages(b["teacher"], b["old"], b["mask"], kl_clip=5.0)
    a_valid = adv[b["mask"].bool()].double()
    got = alg.advantage_metrics(adv, b["mask"])
    assert got["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert got["advantage/std"] == pytest.approx(1.0, rel=1e-5)
    assert got["advantage/min"] == pytest.approx(a_valid.min().item())
    assert got["advantage/max"] == pytest.approx(a_valid.max().item())
    assert got["tokens/global"] == n

    _, info = alg.ppo_clip_loss(b["logprobs"], b["old"], adv, dual_clip=2.0)
    got = alg.policy_metrics(info, b["mask"])
    m = b["mask"].bool()
    assert got["ratio/mean"] == pytest.approx(info["ratio"][m].double().mean().item(), rel=1e-6)
    assert got["ratio/max"] == pytest.approx(info["ratio"][m].max().item(), rel=1e-6)
    assert got["clip/frac"] == pytest.approx(info["clipped"][m].double().mean().item())
    assert got["clip/dual_frac"] == pytest.approx(info["dual_clipped"][m].double().mean().item())


def test_metrics_with_no_tokens_are_zero():
    empty = torch.zeros(2, 3)
    for got in (
        alg.score_metrics(empty, empty, empty, kl_clip=5.0),
        alg.advantage_metrics(empty, empty),
        alg.policy_metrics({"ratio": empty, "clipped": empty, "dual_clipped": empty}, empty),
        alg.advantage_metrics(torch.zeros(0, 3), torch.zeros(0, 3)),
    ):
        assert all(v == 0.0 for v in got.values()), got


# ---------------------------------------------------------------- stability diagnostics


def _norm_series() -> list[float]:
    """60 steps of pre-clip norms with a known number of spikes (3x the trailing median).

    Normal steps 1.0-1.4; every 10th step 6.0 (a spike: its trailing median is ~1.2); step 15
    2.9 (below 3x); a 9.0 at step 3 (too early: fewer than 5 previous steps); a zero-gradient
    step and a skipped (NaN) step, neither part of any median.
    """
    norms = [1.0 + 0.1 * ((7 * i) % 5) for i in range(60)]
    for i in range(9, 60, 10):
        norms[i] = 6.0
    norms[2], norms[14], norms[22], norms[33] = 9.0, 2.9, 0.0, math.nan
    return norms


def test_spike_count_and_trailing_median_of_a_constructed_series():
    norms = _norm_series()
    medians = alg.trailing_medians(norms)
    assert medians[:5] == [None] * 5  # fewer than 5 previous steps
    assert medians[5] == pytest.approx(statistics.median(norms[:5]))
    # the median of the 20 usable norms before step 40 (index 39): 38 steps minus the 0 and NaN
    usable = [x for x in norms[:39] if math.isfinite(x) and x > 0][-20:]
    assert medians[39] == pytest.approx(statistics.median(usable))
    flags = alg.spike_flags(norms)
    assert [i for i, f in enumerate(flags) if f] == [9, 19, 29, 39, 49, 59]
    assert sum(alg.spike_flags(norms, factor=2.0)) == 7  # 2.9 is above 2x


def test_log_log_slope_of_known_laws():
    rms = [0.5 * 1.1**i for i in range(30)]
    proportional = alg.log_log_slope(rms, [2.0 * r for r in rms])  # OPD-like: norm ∝ RMS
    assert proportional["slope"] == pytest.approx(1.0) and proportional["slope_se"] < 1e-6
    assert proportional["n"] == 30
    flat = alg.log_log_slope(rms, [3.0] * 30)  # GNDPO-like: norm independent of RMS
    assert flat["slope"] == pytest.approx(0.0, abs=1e-9)
    half = alg.log_log_slope(rms, [3.0 * r**0.5 for r in rms])
    assert half["slope"] == pytest.approx(0.5)
    noisy = alg.log_log_slope(rms, [r * (1.3 if i % 2 else 0.7) for i, r in enumerate(rms)])
    assert 0.8 < noisy["slope"] < 1.2 and noisy["slope_se"] > 0.01
    # unusable pairs are left out; no spread in the RMS leaves the slope undetermined
    assert alg.log_log_slope([1.0, 0.0, 2.0, 4.0], [1.0, 5.0, math.nan, 4.0])["n"] == 2
    assert math.isnan(alg.log_log_slope([2.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0])["slope"])
    with pytest.raises(ValueError, match="one scale per norm"):
        alg.log_log_slope([1.0], [1.0, 2.0])


def test_stability_monitor_streams_the_series_and_resumes_exactly():
    norms = _norm_series()
    rms = [0.5 + 0.01 * i + (1.0 if i % 10 == 9 else 0.0) for i in range(60)]
    monitor = alg.StabilityMonitor(clip=2.0)
    full = [monitor.observe(n, r) for n, r in zip(norms, rms, strict=True)]
    flags = alg.spike_flags(norms)
    assert [s["grad_norm/spike"] for s in full] == [float(f) for f in flags]
    assert full[-1]["grad_norm/spikes"] == 6.0
    clipped = [alg.clip_active(n, 2.0) for n in norms]
    assert [s["grad_norm/clip_active"] for s in full] == [float(c) for c in clipped]
    assert full[-1]["grad_norm/clip_active_frac"] == pytest.approx(sum(clipped) / 59)  # no NaN
    assert "grad_norm/trailing_median" not in full[4]
    assert full[39]["grad_norm/trailing_median"] == alg.trailing_medians(norms)[39]
    fit = alg.log_log_slope(rms, norms)
    assert full[-1]["grad_norm/score_rms_slope"] == pytest.approx(fit["slope"])
    assert full[-1]["grad_norm/score_rms_slope_se"] == pytest.approx(fit["slope_se"])

    first = alg.StabilityMonitor(clip=2.0)
    for n, r in zip(norms[:25], rms[:25], strict=True):
        first.observe(n, r)
    resumed = alg.StabilityMonitor(clip=2.0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # via the checkpoint
    rest = [resumed.observe(n, r) for n, r in zip(norms[25:], rms[25:], strict=True)]
    assert rest == full[25:]


def test_clip_active():
    assert [alg.clip_active(x, 1.0) for x in (0.5, 1.0, 1.5, math.nan, math.inf)] == [
        False, False, True, False, False,
    ]  # fmt: skip


# ---------------------------------------------------------------- edge cases and errors


def test_constant_scores_whiten_to_zero_without_nan():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    for value in (0.0, 3.0, 7.5):  # 7.5 is clamped to 5 everywhere: constant too
        old = torch.full((2, 4), -1.0)
        adv = alg.gndpo_advantages(old + value, old, mask, kl_clip=5.0)
        assert torch.isfinite(adv).all()
        assert adv.abs().max() < 1e-3
    returns = alg.reinforce_pp_advantages(torch.full((2, 4), 2.0), mask, gamma=0.0)
    assert torch.isfinite(returns).all() and returns.abs().max() < 1e-3


@pytest.mark.parametrize("valid", [0, 1])
def test_whitening_needs_two_tokens(valid):
    mask = torch.zeros(2, 4)
    mask[1, 0] = float(valid)
    scores = torch.randn(2, 4)
    with pytest.raises(ValueError, match=rf"at least two valid response tokens.*\(got {valid}\)"):
        alg.gndpo_advantages(scores, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="increase the rollout batch size"):
        alg.reinforce_pp_advantages(scores, mask)
    mask[0, :2] = 1.0
    assert torch.isfinite(alg.masked_whiten(scores, mask)).all()


def test_masked_positions_are_exactly_zero_even_with_junk_in_padding():
    b = random_batch(5)
    junk = b["mask"] == 0
    teacher = b["teacher"].masked_fill(junk, math.nan)
    old = b["old"].masked_fill(junk, -math.inf)
    rewards = b["token_rewards"].masked_fill(junk, math.inf)
    kl = torch.rand(b["mask"].shape).masked_fill(junk, math.nan)
    outputs = [
        alg.opd_advantages(teacher, old, b["mask"]),
        alg.gndpo_advantages(teacher, old, b["mask"]),
        alg.reinforce_pp_advantages(rewards, b["mask"], gamma=0.9),
        alg.reinforce_pp_advantages(rewards, b["mask"], gamma=1.0),
        alg.grpo_advantages(b["rewards"][:6], b["mask"][:6], group_size=3),
        alg.outcome_token_rewards(b["rewards"], b["mask"]),
        alg.vopd_advantages(teacher, old, b["mask"], kl),
    ]
    for out in outputs:
        pad = junk[: out.shape[0]]
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert (out[pad] == 0).all()


def test_gradients_only_through_current_logprobs():
    b = random_batch(1)
    lp = b["logprobs"].clone().requires_grad_(True)
    old, teacher = b["old"].clone().requires_grad_(True), b["teacher"].clone().requires_grad_(True)
    adv = alg.gndpo_advantages(teacher, old, b["mask"])
    assert not adv.requires_grad
    for loss, _ in (
        alg.ppo_clip_loss(lp, old, adv, dual_clip=3.0),
        alg.gspo_token_loss(lp, old, adv, b["mask"]),
        alg.importance_sampled_pg_loss(lp, old, adv),
    ):
        num, _ = alg.aggregate_loss(loss, b["mask"], "token-mean")
        num.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert old.grad is None and teacher.grad is None
    assert (lp.grad[b["mask"] == 0] == 0).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, m: alg.distillation_scores(x, x, m, kl_clip=0.0), "kl_clip must be"),
        (lambda x, m: alg.gndpo_advantages(x, x, m, kl_clip=-1.0), "kl_clip must be"),
        (lambda x, m: alg.ppo_clip_loss(x, x, x, clip_low=0.0), "clip_low must be"),
        (lambda x, m: alg.ppo_clip_loss(x, x, x, clip_low=1.5), "clip_low must be"),
        (lambda x, m: alg.ppo_clip_loss(x, x, x, clip_high=-0.1), "clip_high must be"),
        (lambda x, m: alg.ppo_clip_loss(x, x, x, dual_clip=1.0), "dual_clip must be"),
        (lambda x, m: alg.gspo_token_loss(x, x, x, m, clip_high=0.0), "clip_high must be"),
        (lambda x, m: alg.grpo_advantages(x[:, 0], m, group_size=3), "not a multiple"),
        (lambda x, m: alg.grpo_advantages(x[:, 0], m, group_size=0), "group_size=0"),
        (lambda x, m: alg.grpo_advantages(x, m, group_size=2), "one scalar reward"),
        (lambda x, m: alg.aggregate_loss(x, m, "sum"), "token-mean, seq-mean-token-mean"),
        (lambda x, m: alg.reinforce_pp_advantages(x, m, gamma=1.5), "gamma must be"),
        (lambda x, m: alg.opd_advantages(x, x[:, :2], m), "same .B, T. shape"),
        (lambda x, m: alg.mix_advantages(x, x, outcome_weight=math.nan), "outcome_weight"),
        (lambda x, m: alg.policy_metrics({"ratio": x}, m), "lacks"),
    ],
)
def test_invalid_arguments_raise_value_error(call, message):
    x, m = torch.randn(4, 5), torch.ones(4, 5)
    with pytest.raises(ValueError, match=message):
        call(x, m)


def test_sampled_eval_metrics_average_the_tokens_and_the_samples() -> None:
    from megatron_gndpo.algorithms.metrics import sampled_eval_metrics

    student = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, 7.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = sampled_eval_metrics(teacher, student, mask, torch.tensor([1.0, 0.0]))
    # (0.5 - 1.0 - 0.25) / 3 masked tokens; the padding's values never count
    assert got == {"eval/reverse_kl": pytest.approx(-0.25), "eval/sampled_accuracy": 0.5}
    assert set(sampled_eval_metrics(teacher, student, mask, None)) == {"eval/reverse_kl"}
