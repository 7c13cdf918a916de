"""The top-k divergences (algorithms/divergences.py) against naive implementations on small
vocabularies, with gradients by torch.autograd; the update's term; the topk_kd method on CPU
tensors; and topk_kd in the trainer (every divergence trains at 1 rank; the same numbers at
2 ranks with the teacher on another layout)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.algorithms.divergences import (
    DIVERGENCES,
    Divergence,
    tail_mass,
    topk_divergence,
)
from megatron_gndpo.algorithms.guidance import forward_kl_to_targets
from megatron_gndpo.config.schema import AlgorithmConfig, DivergenceConfig

B, T, V = 2, 3, 7

# Each kind at a weight that mixes (for mixed, jsd, skew_*), and the endpoints.
CASES = [
    Divergence("forward", "bucket"),
    Divergence("reverse", "bucket"),
    Divergence("mixed", "bucket", mixed_weight=0.3),
    Divergence("jsd", "bucket", beta=0.3),
    Divergence("jsd", "bucket", beta=0.0),
    Divergence("jsd", "bucket", beta=1.0),
    Divergence("skew_forward", "bucket", skew=0.2),
    Divergence("skew_reverse", "bucket", skew=0.2),
]
RENORMALIZED = [Divergence(d.kind, "renormalize", d.mixed_weight, d.beta, d.skew) for d in CASES]


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher logits ``[B, T, V]``, float64, the teacher's peakier."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    teacher = 2.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    return student, teacher


def _naive_kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) from probabilities, over the last dimension."""
    return (a * (a / b).log()).sum(-1)


def _naive(t: torch.Tensor, s: torch.Tensor, d: Divergence) -> torch.Tensor:
    """``d`` between the probability vectors ``t`` (teacher) and ``s`` (student), written from
    the definitions (TRL, NeMo-RL, ROLL) in probability space."""
    w, beta, lam = d.mixed_weight, d.beta, d.skew
    if d.kind == "forward" or (d.kind == "jsd" and beta == 0):
        return _naive_kl(t, s)
    if d.kind == "reverse" or (d.kind == "jsd" and beta == 1):
        return _naive_kl(s, t)
    if d.kind == "mixed":
        return w * _naive_kl(t, s) + (1 - w) * _naive_kl(s, t)
    if d.kind == "jsd":
        m = beta * t + (1 - beta) * s
        return beta * _naive_kl(t, m) + (1 - beta) * _naive_kl(s, m)
    if d.kind == "skew_forward":
        return _naive_kl(t, lam * t + (1 - lam) * s)
    return _naive_kl(s, (1 - lam) * t + lam * s)


def _buckets(p: torch.Tensor, ids: torch.Tensor, tail: str) -> torch.Tensor:
    """The K ids' probabilities plus the rest summed id by id (not 1 − Σ), or renormalised."""
    top = p.gather(-1, ids)
    if tail == "renormalize":
        return top / top.sum(-1, keepdim=True)
    rest = torch.ones_like(p, dtype=torch.bool).scatter(-1, ids, False)
    return torch.cat([top, (p * rest).sum(-1, keepdim=True)], -1)


def _ours_and_naive(
    d: Divergence, k: int, seed: int, full: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ours, naive) values ``[B, T]`` and their gradients w.r.t. the student's logits. The
    naive side is the full-vocabulary divergence when ``full``, else the naive top-k one."""
    logits, teacher_logits = _logits(seed)
    lt_full = teacher_logits.log_softmax(-1)
    ids = lt_full.topk(k, -1).indices
    student = logits.clone().requires_grad_()
    ours = topk_divergence(student.log_softmax(-1).gather(-1, ids), lt_full.gather(-1, ids), d)
    (ours_grad,) = torch.autograd.grad(ours.sum(), student)
    student = logits.clone().requires_grad_()
    s_full, t_full = student.softmax(-1), lt_full.exp()
    if full:
        naive = _naive(t_full, s_full, d)
    else:
        naive = _naive(_buckets(t_full, ids, d.tail), _buckets(s_full, ids, d.tail), d)
    (naive_grad,) = torch.autograd.grad(naive.sum(), student)
    return ours.double(), naive.detach(), ours_grad, naive_grad


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # ours returns float32 (the update's dtype); the math inside is float64
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("d", CASES, ids=lambda d: f"{d.kind}-{d.beta}")
@pytest.mark.parametrize("k", [V - 1, V])
def test_top_k_with_the_tail_is_the_full_vocabulary_divergence(d: Divergence, k: int) -> None:
    """k = V − 1: the tail is the one id left; k = V: the tail is empty. Either way the value
    and the gradient are the full-vocabulary divergence's."""
    ours, full, ours_grad, full_grad = _ours_and_naive(d, k, seed=k, full=True)
    _close(ours, full)
    _close(ours_grad, full_grad)


@pytest.mark.parametrize("d", CASES + RENORMALIZED, ids=lambda d: f"{d.kind}-{d.beta}-{d.tail}")
def test_top_k_divergences_and_gradients_match_a_naive_implementation(d: Divergence) -> None:
    for k in (1, 3):
        if d.tail == "renormalize" and k == 1:
            continue  # one id renormalised: both distributions are (1,), the loss is 0
        ours, naive, ours_grad, naive_grad = _ours_and_naive(d, k, seed=10 + k)
        _close(ours, naive)
        _close(ours_grad, naive_grad)
        assert bool((ours >= -1e-7).all()), "a divergence is never negative"


def test_limits_and_endpoints() -> None:
    logits, teacher = _logits(3)
    ids = teacher.topk(4, -1).indices
    ls = logits.log_softmax(-1).gather(-1, ids)
    lt = teacher.log_softmax(-1).gather(-1, ids)

    def div(kind: str, **kw: float) -> torch.Tensor:
        return topk_divergence(ls, lt, Divergence(kind, "bucket", **kw)).double()

    forward, reverse = div("forward"), div("reverse")
    assert bool((forward != reverse).any())
    # GKD's JSD: beta = 0 / 1 are the forward / reverse KLs (TRL's definition), and the JSD
    # tends to beta·KL(t ‖ s) as beta → 0 and to (1 − beta)·KL(s ‖ t) as beta → 1
    torch.testing.assert_close(div("jsd", beta=0.0), forward)
    torch.testing.assert_close(div("jsd", beta=1.0), reverse)
    eps = 1e-4
    torch.testing.assert_close(div("jsd", beta=eps) / eps, forward, rtol=2e-3, atol=0.0)
    torch.testing.assert_close(div("jsd", beta=1 - eps) / eps, reverse, rtol=2e-3, atol=0.0)
    # mixed: w = 1 / 0 are forward / reverse, and it is linear in w
    torch.testing.assert_close(div("mixed", mixed_weight=1.0), forward)
    torch.testing.assert_close(div("mixed", mixed_weight=0.0), reverse)
    torch.testing.assert_close(div("mixed", mixed_weight=0.25), 0.25 * forward + 0.75 * reverse)
    # skew: lambda = 0 is the plain KL; a skewed KL is below it (the mixture is closer)
    torch.testing.assert_close(div("skew_forward", skew=0.0), forward)
    torch.testing.assert_close(div("skew_reverse", skew=0.0), reverse)
    assert bool((div("skew_forward", skew=0.5) < forward).all())
    assert bool((div("skew_reverse", skew=0.5) < reverse).all())
    # every divergence is 0 when the student is the teacher
    for kind in DIVERGENCES:
        for tail in ("bucket", "renormalize"):
            same = topk_divergence(lt, lt, Divergence(kind, tail))
            torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-7, rtol=0.0)


def test_the_default_is_the_unnormalised_forward_kl_bit_for_bit() -> None:
    """TGPO's and TrOPD's term: Divergence() is forward_kl_to_targets exactly."""
    logits, teacher = _logits(4)
    ids = teacher.topk(3, -1).indices
    ls = logits.float().log_softmax(-1).gather(-1, ids).requires_grad_()
    lt = teacher.float().log_softmax(-1).gather(-1, ids)
    got = topk_divergence(ls, lt, Divergence())
    (got_grad,) = torch.autograd.grad(got.sum(), ls)
    want = forward_kl_to_targets(ls, lt)
    (want_grad,) = torch.autograd.grad(want.sum(), ls)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_float32_inputs_the_tail_floor_and_bad_arguments() -> None:
    logits, teacher = _logits(5)
    ids = teacher.topk(V, -1).indices  # every id: the tail is empty, 1 − Σ is rounding noise
    student = logits.float().requires_grad_()
    lt = teacher.float().log_softmax(-1).gather(-1, ids)
    for d in CASES:
        value = topk_divergence(student.log_softmax(-1).gather(-1, ids), lt, d)
        (grad,) = torch.autograd.grad(value.sum(), student)
        assert bool(value.isfinite().all() and grad.isfinite().all()), d
        want = _naive(lt.double().exp(), logits.softmax(-1).gather(-1, ids), d)
        torch.testing.assert_close(value.double(), want, rtol=1e-4, atol=1e-5)
    # a teacher id of mass 0 (log-prob −inf) adds nothing to a KL from the teacher or to a
    # mixture; a KL from the student to the teacher alone is then +inf, as it is exactly
    lt3 = teacher.log_softmax(-1).topk(3, -1).values
    lt3[..., -1] = -math.inf
    ls3 = logits.log_softmax(-1).gather(-1, teacher.topk(3, -1).indices)
    for d in CASES:
        infinite = d.kind in ("reverse", "mixed") or (d.kind == "jsd" and d.beta == 1.0)
        value = topk_divergence(ls3, lt3, d)
        assert bool((value == math.inf).all() if infinite else value.isfinite().all()), d
    torch.testing.assert_close(tail_mass(lt3).double(), 1 - lt3.exp().sum(-1), rtol=1e-6, atol=0.0)
    with pytest.raises(ValueError, match="unknown divergence"):
        Divergence("hellinger", "bucket")
    with pytest.raises(ValueError, match="needs a distribution on the K ids"):
        Divergence("reverse")
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        Divergence("jsd", "bucket", beta=1.5)
    with pytest.raises(ValueError, match=r"skew must be in \[0, 1\)"):
        Divergence("skew_forward", "bucket", skew=1.0)
    with pytest.raises(ValueError, match="same"):
        topk_divergence(ls3, lt3[..., :2], CASES[0])


def test_token_loss_takes_the_targets_divergence() -> None:
    from megatron_gndpo.engine.update import Targets, UpdateBatch, policy_loss, token_loss
    from megatron_gndpo.models.logprob_head import Scores

    logits, teacher = _logits(6)
    g = torch.Generator().manual_seed(6)
    ids = teacher.topk(3, -1).indices
    extra = logits.float().log_softmax(-1).gather(-1, ids)
    logq = teacher.float().log_softmax(-1).gather(-1, ids)
    lp = extra[..., 0]
    mask = torch.rand(B, T, generator=g) > 0.2
    aux_mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mb = {"old": lp + 0.1, "adv": torch.randn(B, T, generator=g), "mask": mask,
          "aux_ids": ids, "aux_logq": logq, "aux_mask": aux_mask}  # fmt: skip
    cfg = AlgorithmConfig(policy_loss="ppo_clip")
    d = Divergence("jsd", "bucket", beta=0.3)
    targets = Targets(mb["adv"], aux_coef=0.7, aux_divergence=d)
    batch = UpdateBatch(torch.zeros(B, T, dtype=torch.long), mb["old"], targets, mask)
    loss, info = token_loss(Scores(lp, extra_logprobs=extra), mb, batch, cfg)
    pg, _ = policy_loss(lp, mb["old"], mb["adv"], mask, cfg)
    term = topk_divergence(extra, logq, d)
    torch.testing.assert_close(loss, pg + 0.7 * aux_mask * term)
    torch.testing.assert_close(info["aux"], term)


# ---------------------------------------------------------------- the method, on CPU tensors
def _step_batch(**fields: Any) -> Any:
    from megatron_gndpo.engine.scoring import Scores
    from megatron_gndpo.methods import StepBatch

    g = torch.Generator().manual_seed(0)
    n, width, k = 4, 6, 3
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (start, end) in enumerate([(2, 6), (2, 5), (3, 6), (1, 4)]):
        mask[i, start:end] = True
    teacher_full = torch.randn(n, width, 10, generator=g).log_softmax(-1)
    top = teacher_full.topk(k, -1)
    teacher = Scores(
        -torch.rand(n, width, generator=g) * 3, topk_ids=top.indices, topk_logprobs=top.values
    )
    student = Scores(-torch.rand(n, width, generator=g) * 3, entropy=torch.rand(n, width))
    base = dict(
        teacher=teacher, student=student, response_mask=mask, rewards=None, group_size=2,
        group=None, step=1, tokens=torch.randint(0, 10, (n, width), generator=g),
    )  # fmt: skip
    return StepBatch(**(base | fields))


def _method(**divergence: Any) -> Any:
    from megatron_gndpo.methods import build_method

    cfg = AlgorithmConfig(estimator="topk_kd", divergence=DivergenceConfig(**divergence))
    return build_method(cfg)


def test_topk_kd_requests_and_targets() -> None:
    from megatron_gndpo.algorithms import advantages as adv
    from megatron_gndpo.engine.scoring import ScoreRequest

    alone = _method(kind="mixed", mixed_kl_weight=0.25, top_k=3, coef=0.5)
    assert not alone.student_first and not alone.scores_spans and not alone.uses_gndpo_switches
    assert alone.teacher_request(None, 7) == ScoreRequest(top_k=3)
    assert alone.student_request(None) == ScoreRequest(entropy=True)
    assert alone.top_ks() == {"divergence.top_k": 3}
    batch = _step_batch()
    targets, metrics = alone.targets(batch)
    mask = batch.response_mask
    assert not targets.advantages.any() and targets.pg_mask is not None
    assert not targets.pg_mask.any()  # the divergence alone: no policy gradient
    assert targets.aux_ids is batch.teacher.topk_ids and targets.aux_logq is not None
    assert torch.equal(targets.aux_logq, batch.teacher.topk_logprobs)
    assert targets.aux_mask is not None and torch.equal(targets.aux_mask, mask.float())
    assert targets.aux_coef == 0.5
    assert targets.aux_divergence == Divergence("mixed", "bucket", mixed_weight=0.25)
    want_tail = tail_mass(batch.teacher.topk_logprobs)[mask].mean()
    assert metrics["divergence/teacher_tail"] == pytest.approx(float(want_tail))
    covered = (batch.teacher.topk_ids == batch.tokens.unsqueeze(-1)).any(-1)
    want_covered = float(covered[mask].float().mean())
    assert metrics["divergence/sampled_in_topk"] == pytest.approx(want_covered)
    # beside GNDPO's policy gradient: GNDPO's whitened score as the advantage, every token in it
    gndpo = _method(policy_gradient="gndpo", kind="jsd", beta=0.9)
    assert gndpo.uses_gndpo_switches and not _method(policy_gradient="opd").uses_gndpo_switches
    targets, _ = gndpo.targets(batch)
    lt, lo, m = batch.teacher.logprobs, batch.student.logprobs, mask.float()
    assert torch.equal(targets.advantages, adv.gndpo_advantages(lt, lo, m, kl_clip=5.0))
    assert targets.pg_mask is None and targets.aux_divergence.kind == "jsd"
    targets, _ = _method(policy_gradient="opd").targets(batch)
    assert torch.equal(targets.advantages, adv.opd_advantages(lt, lo, m, kl_clip=5.0))
    assert "divergence.kind=forward" in alone.never_stops_advice


def test_topk_kd_config_problems_name_the_fix() -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import load_config
    from megatron_gndpo.config.loader import ConfigError

    def problems(*overrides: str) -> str:
        cfg = load_config(None, ["algorithm.estimator=topk_kd", *overrides])
        with pytest.raises(ConfigError) as err:
            validate(cfg, 1)
        return str(err.value)

    validate(load_config(None, ["algorithm.estimator=topk_kd"]), 1)
    text = problems(
        "algorithm.divergence.beta=1.5", "algorithm.divergence.mixed_kl_weight=-0.1",
        "algorithm.divergence.skew_lambda=1", "algorithm.divergence.coef=0",
    )  # fmt: skip
    for needle in ("divergence.beta must be in [0, 1]", "mixed_kl_weight must be in [0, 1]",
                   "skew_lambda must be in [0, 1)", "coef must be > 0"):  # fmt: skip
        assert needle in text
    assert "set tail=bucket or top_k > 1" in problems(
        "algorithm.divergence.tail=renormalize", "algorithm.divergence.top_k=1"
    )
    assert "top_k must be in [1, 128]" in problems("algorithm.divergence.top_k=500")
    assert "gndpo_subtract_mean=false" in problems(
        "algorithm.gndpo_subtract_mean=false", "algorithm.gndpo_divide_std=false",
        "algorithm.divergence.policy_gradient=opd",
    )  # fmt: skip
    assert "estimator=topk_kd" in problems("teacher.cross_tokenizer=true")
    assert "set correction=none" in problems("algorithm.offpolicy.correction=tis")
    with pytest.raises(ConfigError, match="expected one of 'forward', 'reverse'"):
        load_config(None, ["algorithm.divergence.kind=hellinger"])


# ---------------------------------------------------------------- in the trainer (gloo, CPU)
KD = ["algorithm.estimator=topk_kd", "algorithm.divergence.top_k=8"]
ONE_RANK = {
    "forward": [*KD],
    "reverse": [*KD, "algorithm.divergence.kind=reverse"],
    "mixed": [*KD, "algorithm.divergence.kind=mixed"],
    "jsd": [*KD, "algorithm.divergence.kind=jsd", "algorithm.divergence.beta=0.9"],
    "skew_forward": [*KD, "algorithm.divergence.kind=skew_forward"],
    "skew_reverse": [*KD, "algorithm.divergence.kind=skew_reverse"],
    "renormalize": [*KD, "algorithm.divergence.tail=renormalize"],
    # beside GNDPO's whitened policy gradient (the student at micro-batch 4: see TWO_RANKS)
    "mixed+gndpo": [
        *KD, "algorithm.divergence.kind=mixed", "algorithm.divergence.policy_gradient=gndpo",
        "algorithm.divergence.coef=0.5", "trainer.micro_batch_size=4",
    ],
}  # fmt: skip
# The student at TP=2, the teacher at PP=2 (another layout), from the 1-rank run's weights.
TWO_RANKS = ["parallel.tensor_parallel=2", "teacher.parallel.pipeline_parallel=2"]
COMPARED = ("loss", "grad_norm", "guidance/kl_mean", "advantage/mean", "divergence/teacher_tail")


def _runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Two steps of each run: the metrics, the student weights that did not move, and whether
    the teacher's did. The first run at 1 rank saves the initial weights of both models."""
    from tests.trainers import two_steps

    return two_steps(world, root, runs, saved=root)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Every divergence, 2 steps each, in one 1-rank launch."""
    from tests.harness import run_distributed

    root = tmp_path_factory.mktemp("topk_kd")
    return root, run_distributed(_runs, 1, args=(str(root), ONE_RANK), timeout_s=300)[0]


@pytest.mark.distributed
@pytest.mark.megatron
@pytest.mark.parametrize("name", list(ONE_RANK))
def test_each_divergence_trains(one_rank: tuple[Path, dict[str, Any]], name: str) -> None:
    result = one_rank[1][name]
    assert result["unchanged"] == [], f"{name}: not updated: {result['unchanged']}"
    assert result["teacher_moved"] == []
    for m in result["steps"]:
        assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert math.isfinite(m["loss"]) and m["guidance/kl_mean"] > 0
        assert 0 < m["divergence/teacher_tail"] < 1 and 0 <= m["divergence/sampled_in_topk"] <= 1
        if "gndpo" not in name:  # the divergence alone is the whole loss
            assert m["loss"] == pytest.approx(m["guidance/kl_mean"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.megatron
def test_two_ranks_with_the_teacher_on_another_layout_match_one(
    one_rank: tuple[Path, dict[str, Any]],
) -> None:
    from tests.harness import run_distributed

    root, reference = one_rank
    init = [f"checkpoint.init={root / 'init'}", f"teacher.load={root / 'teacher'}"]
    runs = {"mixed+gndpo": [*ONE_RANK["mixed+gndpo"], *TWO_RANKS, *init]}
    two = run_distributed(_runs, 2, args=(str(root / "w2"), runs), timeout_s=300)[0]
    result = two["mixed+gndpo"]
    assert result["unchanged"] == [] and result["teacher_moved"] == []
    for step, (ref, got) in enumerate(
        zip(reference["mixed+gndpo"]["steps"], result["steps"], strict=True)
    ):
        assert got["tokens/step"] == ref["tokens/step"], step
        for key in COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (step, key)
