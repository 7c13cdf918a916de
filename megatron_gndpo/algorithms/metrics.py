"""Global per-step statistics for logging: plain floats, the same on every rank of ``group``.

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded),
``response_mask_BT`` = m. ``group`` is the DP × CP group (disjoint tokens per rank; never the
TP group). Each family of statistics costs one float64 ``all_reduce(SUM)``, plus one
``all_reduce(MAX)`` where it reports extremes (min is reduced as the max of the negation).
Every rank of the group must call each function, even one whose shard has no token; with no
valid token in the whole batch every statistic is 0.0, never NaN.
Sources: ALGORITHMS.md §6; GNDPO (arXiv 2606.09091).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.scores import check_kl_clip, raw_scores
from megatron_gndpo.algorithms.stats import check_same_shape, global_sum, masked_values

# The keys every loss in ``losses.py`` puts in its info dict.
_POLICY_INFO_KEYS = ("ratio", "clipped", "dual_clipped")


def score_metrics(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Mean/std of the clamped score c (before whitening) and the clamp fraction.

    score/mean, score/std (unbiased, the whitening's σ): over valid tokens of c = clamp(d, ±C);
    score/clamp_frac: fraction of valid tokens with |d| > C, d = lt − lo. Inputs ``[B, T]``.
    """
    check_kl_clip(kl_clip)
    with torch.no_grad():
        d_BT = raw_scores(teacher_logprobs, old_logprobs, response_mask).double()
        c_BT = d_BT.clamp(-kl_clip, kl_clip)
        mask_BT = response_mask.bool()
        local = torch.stack(
            [
                mask_BT.double().sum(),
                c_BT.sum(),
                (c_BT * c_BT).sum(),
                (mask_BT & (d_BT.abs() > kl_clip)).double().sum(),
            ]
        )
        n, sum_c, sum_c2, n_clamped = global_sum(local, group).tolist()
    mean, std = _mean_std(n, sum_c, sum_c2)
    return {
        "score/mean": mean,
        "score/std": std,
        "score/clamp_frac": _ratio(n_clamped, n),
    }


def advantage_metrics(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """advantage/mean, /std (unbiased), /min, /max over valid tokens, and tokens/global.

    advantages, response_mask: ``[B, T]``.
    """
    check_same_shape(advantages=advantages, response_mask=response_mask)
    with torch.no_grad():
        a_BT = masked_values(advantages.detach().double(), response_mask)
        local = torch.stack([response_mask.double().sum(), a_BT.sum(), (a_BT * a_BT).sum()])
        n, sum_a, sum_a2 = global_sum(local, group).tolist()
        a_max, neg_a_min = _global_max(
            [masked_max(a_BT, response_mask), masked_max(-a_BT, response_mask)], group
        )
    mean, std = _mean_std(n, sum_a, sum_a2)
    has_tokens = n > 0
    return {
        "advantage/mean": mean,
        "advantage/std": std,
        "advantage/min": -neg_a_min if has_tokens else 0.0,
        "advantage/max": a_max if has_tokens else 0.0,
        "tokens/global": n,
    }


def policy_metrics(
    info: dict[str, torch.Tensor],
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """ratio/mean, ratio/max, clip/frac, clip/dual_frac over valid tokens.

    info: the dict a loss in ``losses.py`` returns (``ratio``, ``clipped``, ``dual_clipped``,
    each ``[B, T]``); response_mask: ``[B, T]``.
    """
    missing = [key for key in _POLICY_INFO_KEYS if key not in info]
    if missing:
        raise ValueError(
            f"policy info lacks {missing}; pass the info dict returned by a loss in losses.py"
        )
    check_same_shape(response_mask=response_mask, **{key: info[key] for key in _POLICY_INFO_KEYS})
    with torch.no_grad():
        ratio_BT = masked_values(info["ratio"].detach().double(), response_mask)
        clipped_BT = masked_values(info["clipped"].detach().double(), response_mask)
        dual_BT = masked_values(info["dual_clipped"].detach().double(), response_mask)
        local = torch.stack(
            [response_mask.double().sum(), ratio_BT.sum(), clipped_BT.sum(), dual_BT.sum()]
        )
        n, sum_ratio, n_clipped, n_dual = global_sum(local, group).tolist()
        (ratio_max,) = _global_max([masked_max(ratio_BT, response_mask)], group)
    return {
        "ratio/mean": _ratio(sum_ratio, n),
        "ratio/max": ratio_max if n > 0 else 0.0,
        "clip/frac": _ratio(n_clipped, n),
        "clip/dual_frac": _ratio(n_dual, n),
    }


def masked_max(values_BT: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` over valid positions as a float64 0-d tensor; −inf if there are none."""
    candidates = torch.where(response_mask.bool(), values_BT.double(), -torch.inf).flatten()
    floor = torch.full((1,), -torch.inf, dtype=torch.float64, device=candidates.device)
    return torch.cat([candidates, floor]).amax()


def _global_max(local: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[float]:
    # One MAX all-reduce for all extremes of a family (min is passed as max of the negation).
    stacked = torch.stack(local)
    if group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    return stacked.tolist()


def _mean_std(n: float, total: float, total_sq: float) -> tuple[float, float]:
    """Mean and unbiased std from float64 sums; 0.0 for what a count below 1 (or 2) can't give."""
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    if n < 2:
        return mean, 0.0
    var = max(total_sq - 2.0 * mean * total + mean * mean * n, 0.0) / (n - 1)
    return mean, var**0.5


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0
