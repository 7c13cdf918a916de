"""Per-token policy losses, before aggregation (see ``aggregation.py``).

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded).
``logprobs_BT`` = lp, current student log-prob of the sampled token (the only input that carries
gradient); ``old_logprobs_BT`` = lo, the same under the rollout weights (ratios are always
against lo); ``advantages_BT`` = A; ``response_mask_BT`` = m.

Each loss returns ``(loss_BT, info)``: ``loss_BT`` float32 ``[B, T]`` (padding positions hold
finite junk; aggregation masks them) and ``info`` a dict of detached float32 ``[B, T]`` tensors
with the same keys for every loss, for metrics:

- ``ratio``: the importance ratio used (token ratio, or GSPO's sequence ratio per token);
- ``clipped``: 1.0 where the clipped branch of max(−A·ρ, −A·clip(ρ)) is the larger;
- ``dual_clipped``: 1.0 where the dual-clip bound −A·c_dual is active (A < 0 only).
"""

from __future__ import annotations

import math

import torch

from megatron_gndpo.algorithms.stats import check_same_shape, masked_values

# Names the config layer validates ``algorithm.policy_loss`` against.
POLICY_LOSSES = ("ppo_clip", "gspo", "is_pg")

# Token log-ratio clamp, as verl's compute_policy_loss: exp(20) ≈ 5e8 is far past any clip
# range, while an unclamped exp overflows float32 beyond 88 and turns the loss and gradients
# into inf/NaN (padding positions may hold arbitrary old log-probs).
_MAX_LOG_RATIO = 20.0

# Upper clamp of GSPO's log sequence ratio, as the GNDPO release does (core_algos.py).
_MAX_GSPO_LOG_RATIO = 10.0

LossInfo = dict[str, torch.Tensor]


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, LossInfo]:
    """PPO clipped surrogate per token, with optional dual clip.

        ρ = exp(clamp(lp − lo, −20, 20))
        L = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))
        L = min(L, −A·c_dual)  where A < 0                  (dual clip, if c_dual is given)

    Inputs ``[B, T]``; returns ``(L_BT, info)``. Gradient flows only through ``logprobs``.
    Source: PPO (arXiv 1707.06347); dual clip from arXiv 1912.09729; ALGORITHMS.md §3.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and not (math.isfinite(dual_clip) and dual_clip > 1.0):
        raise ValueError(
            f"dual_clip must be a finite number > 1 (got {dual_clip}); the usual value is 3.0, "
            "or None to disable the dual clip"
        )
    return _clipped_surrogate(
        _token_ratio(logprobs, old_logprobs), advantages,
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
    )  # fmt: skip


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, LossInfo]:
    """GSPO, token form (what the GNDPO release uses).

        δ_i   = sg[ Σ_t m·(lp − lo) / max(1, Σ_t m) ]        per sequence
        log s = min(10, lp − sg[lp] + δ_i)                   value δ_i, gradient of lp
        L     = max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high))

    Inputs ``[B, T]``; returns ``(L_BT, info)``. Each row must be whole on this rank (δ_i is a
    mean over the row). Gradient flows only through ``logprobs``.
    Source: GSPO (arXiv 2507.18071) and the GNDPO release; ALGORITHMS.md §3.
    """
    check_same_shape(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
    )
    _check_clip(clip_low, clip_high)
    lp_BT = logprobs.float()
    with torch.no_grad():
        log_ratio_BT = masked_values(lp_BT - old_logprobs.float(), response_mask)
        tokens_B = response_mask.float().sum(-1).clamp(min=1.0)
        delta_B1 = (log_ratio_BT.sum(-1) / tokens_B).unsqueeze(-1)
    log_s_BT = (lp_BT - lp_BT.detach() + delta_B1).clamp(max=_MAX_GSPO_LOG_RATIO)
    return _clipped_surrogate(
        log_s_BT.exp(), advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=None
    )


def _token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``ρ = exp(clamp(lp − lo, ±_MAX_LOG_RATIO))`` per token, float32, gradient through ``lp``."""
    log_ratio_BT = (logprobs.float() - old_logprobs.detach().float()).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    return log_ratio_BT.exp()


def importance_sampled_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
) -> tuple[torch.Tensor, LossInfo]:
    """Unclipped importance-sampled policy gradient: L = −A · exp(lp − lo).

    The log-ratio is clamped to ±20 like PPO's (only to keep exp finite). Inputs ``[B, T]``;
    returns ``(L_BT, info)`` with ``clipped``/``dual_clipped`` all 0. Gradient flows only
    through ``logprobs``. Source: ALGORITHMS.md §3 (the on-policy-distillation loss of the
    Thinking Machines note).
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    ratio_BT = _token_ratio(logprobs, old_logprobs)
    loss_BT = -advantages.detach().float() * ratio_BT
    never_BT = torch.zeros_like(ratio_BT)  # nothing is ever clipped
    info = {"ratio": ratio_BT.detach(), "clipped": never_BT, "dual_clipped": never_BT.clone()}
    return loss_BT, info


def _clipped_surrogate(
    ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, LossInfo]:
    """max(−A·ρ, −A·clip(ρ)), then the dual clip for A < 0; shared by PPO and GSPO."""
    adv_BT = advantages_BT.detach().float()
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    clip_active_BT = clipped_BT > unclipped_BT
    if dual_clip is None:
        dual_active_BT = torch.zeros_like(clip_active_BT)
    else:
        bound_BT = -adv_BT * dual_clip
        dual_active_BT = (adv_BT < 0) & (loss_BT > bound_BT)
        loss_BT = torch.where(dual_active_BT, bound_BT, loss_BT)
    info = {
        "ratio": ratio_BT.detach(),
        "clipped": clip_active_BT.float(),
        "dual_clipped": dual_active_BT.float(),
    }
    return loss_BT, info


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not (math.isfinite(clip_low) and 0.0 < clip_low <= 1.0):
        raise ValueError(
            f"clip_low must be in (0, 1] (got {clip_low}); the ratio is clipped below at "
            "1 - clip_low, e.g. 0.2 (GNDPO release) or 3e-4 (GSPO paper)"
        )
    if not (math.isfinite(clip_high) and clip_high > 0.0):
        raise ValueError(
            f"clip_high must be a finite number > 0 (got {clip_high}); the ratio is clipped "
            "above at 1 + clip_high, e.g. 0.2 (GNDPO release) or 4e-4 (GSPO paper)"
        )
