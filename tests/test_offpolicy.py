"""The off-policy correction (algorithms/offpolicy.py) against float64 hand computations, and
its place in the update's per-token loss: the policy-gradient term only, the token count kept."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gndpo.algorithms import aggregate_loss
from megatron_gndpo.algorithms.offpolicy import importance_weights, offpolicy_metrics
from megatron_gndpo.config.schema import AlgorithmConfig

# Row 0: 4 sampled tokens; row 1: 2 sampled tokens after a teacher-written one; row 2: none.
TRAINER = [[-1.0, -0.5, -2.0, -0.1, 0.0], [-0.3, -0.2, -1.0, 0.0, 0.0], [0.0] * 5]
SAMPLER = [[-1.2, -0.5, -1.0, -0.1, 0.0], [-9.0, -0.9, -0.1, 0.0, 0.0], [0.0] * 5]
SAMPLED = [[1, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0] * 5]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(TRAINER), torch.tensor(SAMPLER), torch.tensor(SAMPLED, dtype=torch.bool)


def _reference(correction: str, level: str, cap: float, low: float, high: float) -> torch.Tensor:
    """Row by row in float64, as the docs' formulas read."""
    out = torch.ones(3, 5, dtype=torch.float64)
    for i, (lo, ls, s) in enumerate(zip(TRAINER, SAMPLER, SAMPLED, strict=True)):
        logs = [a - b for a, b, m in zip(lo, ls, s, strict=True) if m]
        for t in range(5):
            if not s[t]:
                continue
            if level == "token":
                r = math.exp(lo[t] - ls[t])
            elif level == "sequence":
                r = math.exp(sum(logs))
            else:
                r = math.exp(sum(logs) / len(logs))
            if correction == "tis":
                out[i, t] = min(r, cap)
            elif correction == "mask":
                out[i, t] = r if low <= r <= high else 0.0
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("correction", ["none", "tis", "mask"])
def test_weights_match_the_formulas(correction: str, level: str) -> None:
    lo, ls, sampled = _inputs()
    w, info = importance_weights(
        lo, ls, sampled, correction=correction, level=level, tis_cap=1.5, mask_low=0.6,
        mask_high=1.8,
    )  # fmt: skip
    want = _reference(correction, level, 1.5, 0.6, 1.8)
    assert w.dtype == torch.float32 and not w.requires_grad
    torch.testing.assert_close(w.double(), want, rtol=1e-6, atol=1e-7)
    # positions without a sampler log-prob (teacher-written, padding, an empty row): weight 1
    assert bool((w[~sampled] == 1.0).all())
    clipped = (info["ratio"] > 1.5) & sampled if correction == "tis" else torch.zeros_like(sampled)
    assert torch.equal(info["clipped"].bool(), clipped)
    masked = (want == 0) & sampled if correction == "mask" else torch.zeros_like(sampled)
    assert torch.equal(info["masked"].bool(), masked)


def test_token_level_example_values() -> None:
    lo, ls, sampled = _inputs()
    w, info = importance_weights(lo, ls, sampled, correction="tis", tis_cap=2.0)
    # row 0: ratios e^0.2, 1, e^-1, 1; row 1: e^0.7 = 2.01 -> capped at 2, e^-0.9
    torch.testing.assert_close(
        w[:2, :4],
        torch.tensor([[math.exp(0.2), 1.0, math.exp(-1.0), 1.0], [1.0, 2.0, math.exp(-0.9), 1.0]]),
    )
    assert info["clipped"].sum() == 1 and info["ratio"][1, 1] == pytest.approx(math.exp(0.7))
    w, info = importance_weights(lo, ls, sampled, correction="mask")  # [0.5, 2]
    assert w[0, 0] == pytest.approx(math.exp(0.2)) and w[0, 1] == 1.0
    assert w[0, 2] == 0.0 and w[1, 1] == 0.0 and w[1, 2] == 0.0
    assert info["masked"].sum() == 3  # e^-1 < 0.5, e^0.7 > 2, e^-0.9 < 0.5


def test_equal_logprobs_give_weight_one_and_huge_gaps_stay_finite() -> None:
    lo = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    sampled = torch.ones(4, 9, dtype=torch.bool)
    for level in ("token", "sequence", "geometric"):
        for correction in ("tis", "mask"):
            w, info = importance_weights(lo, lo, sampled, correction=correction, level=level)
            assert bool((w == 1.0).all()), (correction, level)
            assert info["clipped"].sum() == 0 and info["masked"].sum() == 0
    # a sequence-level sum past float32's exp range: clamped at exp(±20), never inf or NaN
    far = lo - 30.0
    w, info = importance_weights(lo, far, sampled, correction="tis", level="sequence")
    assert bool((w == 2.0).all()) and bool(torch.isfinite(info["ratio"]).all())
    w, _ = importance_weights(far, lo, sampled, correction="mask", level="sequence")
    assert bool((w == 0.0).all())
    empty = torch.zeros(0, 9)
    w, _ = importance_weights(empty, empty, empty.bool(), correction="mask", level="geometric")
    assert w.shape == (0, 9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"correction": "clip"}, "unknown off-policy correction 'clip'; use one of none, tis"),
        ({"correction": "tis", "level": "row"}, "unknown off-policy level 'row'"),
        ({"correction": "tis", "tis_cap": 0.5}, "tis_cap must be a finite number >= 1"),
        ({"correction": "tis", "tis_cap": math.inf}, "tis_cap must be a finite number >= 1"),
        ({"correction": "mask", "mask_low": 1.2}, r"must contain 1"),
        ({"correction": "mask", "mask_high": 0.9}, r"must contain 1"),
        ({"correction": "mask", "mask_low": -0.1}, r"0 <= mask_low < mask_high"),
        ({"correction": "mask", "mask_low": 1.0, "mask_high": 1.0}, r"must contain 1"),
    ],
)
def test_bad_settings_name_the_fix(kwargs: dict, match: str) -> None:
    lo, ls, sampled = _inputs()
    with pytest.raises(ValueError, match=match):
        importance_weights(lo, ls, sampled, **kwargs)
    with pytest.raises(ValueError, match="same"):
        importance_weights(lo, ls[:, :3], sampled, correction="tis")


def test_metrics_are_token_means_over_sampled_tokens() -> None:
    lo, ls, sampled = _inputs()
    w, info = importance_weights(lo, ls, sampled, correction="mask")
    m = offpolicy_metrics(w, info, sampled, correction="mask")
    kept = w[sampled].double()
    assert m["offpolicy/weight_mean"] == pytest.approx(float(kept.sum() / 6))
    assert m["offpolicy/mask_frac"] == pytest.approx(3 / 6)
    assert m["offpolicy/ratio_max"] == pytest.approx(math.exp(0.7))
    assert "offpolicy/clip_frac" not in m
    w, info = importance_weights(lo, ls, sampled, correction="tis")
    m = offpolicy_metrics(w, info, sampled, correction="tis")
    assert m["offpolicy/clip_frac"] == pytest.approx(1 / 6) and "offpolicy/mask_frac" not in m
    nothing = torch.zeros(2, 5, dtype=torch.bool)
    m = offpolicy_metrics(w[:2], {k: v[:2] for k, v in info.items()}, nothing, correction="tis")
    assert all(v == 0.0 for v in m.values())


def test_weights_scale_the_policy_gradient_only_and_rejected_tokens_keep_their_count() -> None:
    """A masked token (w = 0) gets no policy gradient but stays in the token-mean's count; the
    entropy term is not weighted."""
    from megatron_gndpo.engine.update import Targets, UpdateBatch, token_loss
    from megatron_gndpo.models.logprob_head import Scores

    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    old = -torch.rand(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    weights = torch.tensor([[1.0, 0.0, 1.5, 0.0, 1.0], [0.7, 1.0, 0.0, 1.0, 1.0]])
    cfg = AlgorithmConfig(policy_loss="ppo_clip")
    tokens = torch.zeros(2, 5, dtype=torch.long)

    def loss_and_grad(
        w: torch.Tensor | None, entropy_coef: float
    ) -> tuple[float, int, torch.Tensor]:
        lp = old + 0.05 * torch.randn(2, 5, generator=torch.Generator().manual_seed(4))
        lp.requires_grad_()  # the same current log-probs in every call
        batch = UpdateBatch(
            tokens, old, Targets(adv, entropy_coef=entropy_coef), mask, is_weights=w
        )
        mb = {"old": old, "adv": adv, "mask": mask} | ({} if w is None else {"is_weights": w})
        entropy = 2.0 * lp  # stands in for the head's entropy (any function of lp)
        output = Scores(lp, entropy=entropy) if entropy_coef else lp
        loss_bL, _ = token_loss(output, mb, batch, cfg)
        numerator, count = aggregate_loss(loss_bL, mask, "token-mean")
        (numerator / count).backward()
        assert lp.grad is not None
        return float(numerator.detach() / count), int(count), lp.grad

    _, plain_count, plain_grad = loss_and_grad(None, 0.0)
    weighted, count, grad = loss_and_grad(weights, 0.0)
    assert count == plain_count == 7  # the rejected tokens are still counted
    rejected = mask & (weights == 0)
    assert bool((grad[rejected] == 0).all()) and bool((plain_grad[rejected] != 0).all())
    torch.testing.assert_close(grad[mask], (weights * plain_grad)[mask])
    # the loss is Σ w·L over every response token, divided by all 7 of them
    lp = old + 0.05 * torch.randn(2, 5, generator=torch.Generator().manual_seed(4))
    from megatron_gndpo.engine.update import policy_loss

    pg, _ = policy_loss(lp, old, adv, mask, cfg)
    assert weighted == pytest.approx(float((weights * pg)[mask].sum() / 7), rel=1e-6)
    # with an entropy bonus, only the policy-gradient part is weighted: −β·H reaches every token
    _, _, grad_h = loss_and_grad(weights, 0.1)
    torch.testing.assert_close(grad_h[mask], (weights * plain_grad - 0.1 * 2.0 / 7)[mask])
