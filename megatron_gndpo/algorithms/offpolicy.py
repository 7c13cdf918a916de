"""Importance weights for the gap between the sampler's log-probs and the trainer's.

The rollout engine samples from its own numbers (vLLM's kernels, bf16, another batch layout), so
the tokens come from a sampler distribution μ that is close to, but not exactly, the student's
π_old as the trainer computes it. The policy-gradient term can be reweighted by
``π_old / μ``, truncated (TIS) or with out-of-range tokens rejected (ICE-POP / masked IS), as
verl's rollout correction, NeMo-RL's ``use_importance_sampling_correction`` and slime's MIS do
(docs/methods/offpolicy.md has the formulas and the references).

Shape legend: ``B`` = sequences on this rank, ``T`` = positions (right-padded).
``trainer_logprobs_BT`` = lo, the student's log-prob of the sampled token at the rollout weights
as the trainer recomputes it; ``sampler_logprobs_BT`` = ls, the engine's log-prob of the same
token; ``sampled_mask_BT`` = s, 1 on the response tokens the sampler drew (those with an ``ls``).

    log r_t = lo_t − ls_t                                 per token
    token:      w_t = f(exp(log r_t))
    sequence:   w_t = f(exp(Σ_u s_u·log r_u))             one weight per row (the product)
    geometric:  w_t = f(exp(Σ_u s_u·log r_u / Σ_u s_u))   one weight per row (geometric mean)
    tis:  f(r) = min(r, cap)
    mask: f(r) = r if low ≤ r ≤ high else 0

Tokens without a sampler log-prob (s = 0: prompt, padding, teacher-written prefix tokens) get
weight 1. Weights are constants (no gradient). A row is whole on one rank (the trainer's rollout
rows are), so the row sums need no collective; the metrics take the DP × CP ``group``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.stats import check_same_shape, global_sum, masked_values

# Names the config layer validates ``algorithm.offpolicy`` against.
CORRECTIONS = ("none", "tis", "mask")
LEVELS = ("token", "sequence", "geometric")

# Clamp of the log weight before exp, as slime's MIS (SAFETY_BOUND) and verl's rollout
# correction: a sequence-level sum over thousands of tokens can pass float32's exp limit (88),
# and exp(20) ≈ 5e8 is far beyond any cap or mask bound, so the clamp changes no decision.
_MAX_LOG_WEIGHT = 20.0

WeightInfo = dict[str, torch.Tensor]


def importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    sampled_mask: torch.Tensor,
    *,
    correction: str,
    level: str = "token",
    tis_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> tuple[torch.Tensor, WeightInfo]:
    """Per-token weights ``w_BT`` (float32, detached) of the policy-gradient term, and info.

        log r = lo − ls;  r at ``level`` (token, sequence product, geometric mean), then
        tis:  w = min(r, tis_cap)          mask: w = r·1[mask_low ≤ r ≤ mask_high]
        none: w = 1

    Inputs ``[B, T]``; ``sampled_mask`` marks the tokens that have a sampler log-prob, and
    every other position gets weight 1. ``info`` holds float32 ``[B, T]`` tensors for metrics:
    ``ratio`` (r at the level, before truncation or masking), ``clipped`` (1 where TIS cut r to
    the cap) and ``masked`` (1 where the mask rejected the token). Sources: truncated IS (Yao et
    al., "Your efficient RL framework secretly brings you off-policy RL training", 2025); masked
    IS / ICE-POP (Liu, Li et al., "When speed kills stability", 2025); slime's MIS; NeMo-RL's
    ``tis`` / ``icepop``.
    """
    check_same_shape(
        trainer_logprobs=trainer_logprobs,
        sampler_logprobs=sampler_logprobs,
        sampled_mask=sampled_mask,
    )
    check_correction(correction, level, tis_cap=tis_cap, mask_low=mask_low, mask_high=mask_high)
    with torch.no_grad():
        sampled_BT = sampled_mask.bool()
        log_ratio_BT = masked_values(
            trainer_logprobs.double() - sampler_logprobs.double(), sampled_BT
        )
        if level == "sequence":
            log_ratio_BT = log_ratio_BT.sum(-1, keepdim=True).expand_as(log_ratio_BT)
        elif level == "geometric":
            tokens_B1 = sampled_BT.sum(-1, keepdim=True).clamp(min=1)
            log_ratio_BT = (log_ratio_BT.sum(-1, keepdim=True) / tokens_B1).expand_as(log_ratio_BT)
        ratio_BT = log_ratio_BT.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT).exp()
        never_BT = torch.zeros_like(sampled_BT)
        clipped_BT = sampled_BT & (ratio_BT > tis_cap) if correction == "tis" else never_BT
        masked_BT = (
            sampled_BT & ((ratio_BT < mask_low) | (ratio_BT > mask_high))
            if correction == "mask"
            else never_BT
        )
        if correction == "none":
            weight_BT = torch.ones_like(ratio_BT)
        elif correction == "tis":
            weight_BT = ratio_BT.clamp(max=tis_cap)
        else:
            weight_BT = torch.where(masked_BT, 0.0, ratio_BT)
        weight_BT = torch.where(sampled_BT, weight_BT, 1.0)
    info = {
        "ratio": torch.where(sampled_BT, ratio_BT, 1.0).float(),
        "clipped": clipped_BT.float(),
        "masked": masked_BT.float(),
    }
    return weight_BT.float(), info


def check_correction(
    correction: str, level: str, *, tis_cap: float, mask_low: float, mask_high: float
) -> None:
    """Raise ValueError naming the fix for an unknown correction or level, or bad bounds."""
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {correction!r}; use one of {', '.join(CORRECTIONS)}"
        )
    if level not in LEVELS:
        raise ValueError(f"unknown off-policy level {level!r}; use one of {', '.join(LEVELS)}")
    problem = bounds_problem(tis_cap=tis_cap, mask_low=mask_low, mask_high=mask_high)
    if problem:
        raise ValueError(problem)


def bounds_problem(*, tis_cap: float, mask_low: float, mask_high: float) -> str:
    """What is wrong with the cap or the mask interval ("" when nothing): both must keep an
    on-policy token (ratio 1) whole, so the cap is at least 1 and the interval contains 1."""
    if not (math.isfinite(tis_cap) and tis_cap >= 1.0):
        return (
            f"tis_cap must be a finite number >= 1 (got {tis_cap}): the weight is min(ratio, "
            "cap), and a cap below 1 would shrink even on-policy tokens; 2.0 is the usual value"
        )
    if not (math.isfinite(mask_low) and math.isfinite(mask_high)):
        return f"mask_low and mask_high must be finite (got {mask_low}, {mask_high})"
    if not (0.0 <= mask_low <= 1.0 <= mask_high and mask_low < mask_high):
        return (
            f"the mask interval [mask_low, mask_high] = [{mask_low}, {mask_high}] must contain 1 "
            "(an on-policy token is never rejected) with 0 <= mask_low < mask_high; e.g. 0.5 "
            "and 2.0 (NeMo-RL's ICE-POP recipes use 0.5 and 5.0)"
        )
    return ""


def offpolicy_metrics(
    weights_BT: torch.Tensor,
    info: WeightInfo,
    sampled_mask: torch.Tensor,
    *,
    correction: str,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Token means over the sampled tokens of the whole step (one float64 all-reduce SUM and
    one MAX over ``group``): offpolicy/weight_mean (w), offpolicy/ratio_mean and /ratio_max (r
    before truncation or masking), and offpolicy/clip_frac (tis) or offpolicy/mask_frac
    (mask). With no sampled token every value is 0.0."""
    check_same_shape(weights=weights_BT, sampled_mask=sampled_mask, **info)
    with torch.no_grad():
        sampled_BT = sampled_mask.bool()
        ratio_BT = masked_values(info["ratio"].double(), sampled_BT)
        local = torch.stack(
            [
                sampled_BT.double().sum(),
                masked_values(weights_BT.double(), sampled_BT).sum(),
                ratio_BT.sum(),
                masked_values(info["clipped"].double(), sampled_BT).sum(),
                masked_values(info["masked"].double(), sampled_BT).sum(),
            ]
        )
        n, weight_sum, ratio_sum, clipped, masked = global_sum(local, group).tolist()
        ratio_max = ratio_BT.amax() if ratio_BT.numel() else torch.zeros((), dtype=torch.float64)
        if group is not None:
            dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX, group=group)
    out = {
        "offpolicy/weight_mean": weight_sum / n if n else 0.0,
        "offpolicy/ratio_mean": ratio_sum / n if n else 0.0,
        "offpolicy/ratio_max": float(ratio_max) if n else 0.0,
    }
    if correction == "tis":
        out["offpolicy/clip_frac"] = clipped / n if n else 0.0
    elif correction == "mask":
        out["offpolicy/mask_frac"] = masked / n if n else 0.0
    return out
