"""The per-token distillation score: how much more the teacher likes the sampled token.

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded).
``teacher_logprobs_BT`` = lt, log-prob of the sampled token under the teacher;
``old_logprobs_BT`` = lo, the same under the student weights that generated the rollout
(recomputed by the trainer); ``response_mask_BT`` = m, 1 on response tokens.

    d = lt − lo                    the single-sample reverse-KL estimate (−k1)
    c = clamp(d, −C, C) · m        C = ``kl_clip`` (5.0 in the GNDPO release)

Source: GNDPO (arXiv 2606.09091) and the Thinking Machines "On-Policy Distillation" note;
ALGORITHMS.md §1. Scores carry no gradient: they are rewards, not part of the policy graph.
"""

from __future__ import annotations

import math

import torch

from megatron_gndpo.algorithms.stats import check_same_shape, masked_values


def check_kl_clip(kl_clip: float) -> None:
    """Raise ValueError unless ``kl_clip`` is a finite number > 0."""
    if not (math.isfinite(kl_clip) and kl_clip > 0):
        raise ValueError(
            f"kl_clip must be a finite number > 0 (got {kl_clip}); the GNDPO release uses 5.0"
        )


def raw_scores(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """d = (lt − lo) · m before clamping, float32 ``[B, T]``, exactly 0 at masked positions.

    Used for metrics (how often the clamp is active). Detached.
    """
    check_same_shape(
        teacher_logprobs=teacher_logprobs, old_logprobs=old_logprobs, response_mask=response_mask
    )
    with torch.no_grad():
        # Subtract at float64 so float64 inputs are rounded once, at the end.
        d_BT = teacher_logprobs.detach().double() - old_logprobs.detach().double()
        return masked_values(d_BT, response_mask).float()


def distillation_scores(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float,
) -> torch.Tensor:
    """c = clamp(lt − lo, −C, C) · m, float32 ``[B, T]``, exactly 0 at masked positions.

    teacher_logprobs, old_logprobs, response_mask: ``[B, T]``; ``kl_clip`` = C > 0.
    Source: GNDPO (arXiv 2606.09091), ALGORITHMS.md §1. Detached.
    """
    check_kl_clip(kl_clip)
    d_BT = raw_scores(teacher_logprobs, old_logprobs, response_mask)
    return d_BT.clamp(min=-kl_clip, max=kl_clip)
