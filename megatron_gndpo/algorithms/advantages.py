"""Advantage estimators: one float32 ``[B, T]`` advantage per response token, 0 at padding.

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded),
``V`` = vocabulary, ``K`` = the student's top-k set. ``*_BT`` tensors are per token, ``*_B`` per
sequence. ``lt`` = teacher log-prob of the sampled token, ``lo`` = student log-prob under the
rollout ("old") weights, ``m`` = response mask, ``c`` = clamped score (see ``scores.py``).

Estimators whose statistics span the batch (GNDPO, REINFORCE++) take ``group``: the
data-parallel × context-parallel group, whose ranks hold disjoint tokens of the step batch.
Never the tensor-parallel group (identical tokens on each TP rank) and never per micro-batch.
``group=None`` means the whole batch is local. Advantages never carry gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.scores import distillation_scores
from megatron_gndpo.algorithms.stats import (
    check_same_shape,
    global_sum,
    masked_values,
    masked_whiten,
)

# verl's GRPO default (``norm_adv_by_std_in_grpo``): keeps a zero-variance group finite.
_GRPO_STD_EPS = 1e-6


def opd_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float = 5.0,
) -> torch.Tensor:
    """OPD baseline: A = clamp(lt − lo, −C, C) · m, float32 ``[B, T]``.

    Inputs ``[B, T]``. Source: Thinking Machines "On-Policy Distillation" (2025);
    ALGORITHMS.md §2.
    """
    return distillation_scores(teacher_logprobs, old_logprobs, response_mask, kl_clip=kl_clip)


def gndpo_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float = 5.0,
    group: dist.ProcessGroup | None = None,
    subtract_mean: bool = True,
    divide_std: bool = True,
) -> torch.Tensor:
    """GNDPO: the clamped score whitened over every valid token of the whole step batch.

        c = clamp(lt − lo, −C, C) · m
        A = m · (c − mu) / sqrt(var + 1e-8)     mu, unbiased var over all valid tokens of group

    Inputs ``[B, T]``; output float32 ``[B, T]``. ``group`` is the DP × CP group (never the TP
    group, never per micro-batch); every rank calls this, even one with no tokens.
    ``subtract_mean=False`` gives ``m · c / sqrt(var + 1e-8)`` (the rescaling alone),
    ``divide_std=False`` gives ``m · (c − mu)`` (the batch baseline alone): ablations that
    separate GNDPO's two effects (docs/methods/gndpo.md); both false is OPD.
    Raises ValueError when the whole batch has fewer than two valid tokens.
    Source: GNDPO (arXiv 2606.09091), ALGORITHMS.md §2.
    """
    c_BT = distillation_scores(teacher_logprobs, old_logprobs, response_mask, kl_clip=kl_clip)
    return masked_whiten(
        c_BT, response_mask, group=group, subtract_mean=subtract_mean, divide_std=divide_std
    )


def gndpo_advantages_by_group(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    groups_B: torch.Tensor,
    num_groups: int,
    *,
    kl_clip: float = 5.0,
    group: dist.ProcessGroup | None = None,
    subtract_mean: bool = True,
    divide_std: bool = True,
) -> torch.Tensor:
    """:func:`gndpo_advantages` with the mean and std of each group of rows (``groups_B [B]``,
    in ``[0, num_groups)``) over that group's valid tokens of the whole step batch, instead of
    the batch's (several teachers, ``algorithm.teacher_stats: teacher``). A group with fewer
    than two valid tokens in the batch gets advantages 0 (no statistics to whiten by).
    One extra all-reduce (the groups' token counts), then one per group present.
    """
    rows = groups_B.to(response_mask.device)
    masks = [
        response_mask * (rows == j)[:, None].to(response_mask.dtype) for j in range(num_groups)
    ]
    counts = global_sum(torch.stack([m.double().sum() for m in masks]), group).tolist()
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    for mask_j, count in zip(masks, counts, strict=True):
        if count >= 2:  # the same on every rank: the counts are global
            out += gndpo_advantages(
                teacher_logprobs, old_logprobs, mask_j, kl_clip=kl_clip, group=group,
                subtract_mean=subtract_mean, divide_std=divide_std,
            )  # fmt: skip
    return out


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} over the valid tokens of each row, float64 ``[B, T]``.

    A masked position adds no reward, costs no discount step and resets nothing: it carries
    the return of the next valid token (so interior holes are skipped, and the right padding
    holds 0). Only valid positions are meaningful; callers mask the result.
    Source: REINFORCE++ (arXiv 2501.03262).
    """
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1] (got {gamma}); use 1.0 for no discount")
    mask_BT = response_mask.bool()
    r_BT = masked_values(token_rewards.detach().to(torch.float64), mask_BT)
    if gamma == 1.0:  # no discount: a reverse cumulative sum, without a loop over T
        return r_BT.flip(-1).cumsum(-1).flip(-1)
    returns_BT = torch.zeros_like(r_BT)
    running_B = r_BT.new_zeros(r_BT.shape[0])
    for t in reversed(range(r_BT.shape[-1])):
        running_B = torch.where(mask_BT[:, t], r_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B
    return returns_BT


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """REINFORCE++ with global whitening: A = whiten(G) over every valid token of the batch.

    G_t = r_t + γ·G_{t+1} along each row's valid tokens (see :func:`discounted_returns`);
    whitening as in GNDPO over ``group`` (the DP × CP group). token_rewards, response_mask:
    ``[B, T]``; output float32 ``[B, T]``, 0 at masked positions. GNDPO is this with
    ``token_rewards = c`` and ``gamma = 0``. Source: REINFORCE++ (arXiv 2501.03262).
    """
    returns_BT = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns_BT, response_mask, group=group)


def outcome_token_rewards(rewards_B: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last valid token; float32 ``[B, T]``.

    rewards_B: ``[B]``; response_mask: ``[B, T]``. A row with no valid token gets no reward.
    """
    _check_rewards(rewards_B, response_mask)
    mask_BT = response_mask.bool()
    positions_BT = torch.arange(mask_BT.shape[-1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT, positions_BT, -1).amax(-1, keepdim=True).clamp(min=0)
    has_token_B1 = mask_BT.any(-1, keepdim=True)
    rewards_B1 = rewards_B.detach().float().unsqueeze(-1) * has_token_B1
    out_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    return out_BT.scatter(-1, last_B, rewards_B1)


def grpo_advantages(
    rewards_B: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    eps: float = _GRPO_STD_EPS,
) -> torch.Tensor:
    """GRPO group-relative advantage, broadcast over each sequence's valid tokens.

        A_i = (r_i − mean_g r) / (std_g r + eps)     std unbiased (torch.std, as verl)

    rewards_B: ``[B]``, rows are consecutive groups of ``group_size`` samples of one prompt, so a
    group never straddles ranks and no collective is needed. For ``group_size == 1`` mean = 0
    and std = 1 (verl's convention), i.e. A = r / (1 + eps). Output float32 ``[B, T]``.
    Source: DeepSeekMath GRPO as implemented in verl ``compute_grpo_outcome_advantage``.
    """
    _check_rewards(rewards_B, response_mask)
    batch = rewards_B.shape[0]
    if group_size < 1 or batch % group_size != 0:
        raise ValueError(
            f"GRPO needs whole groups: batch of {batch} rows is not a multiple of "
            f"group_size={group_size}; set group_size to the samples per prompt and keep each "
            "prompt's samples together on one rank"
        )
    r_GS = rewards_B.detach().to(torch.float64).reshape(-1, group_size)  # [B/g, g]
    if group_size == 1:
        mean_G1, std_G1 = torch.zeros_like(r_GS), torch.ones_like(r_GS)
    else:
        mean_G1, std_G1 = r_GS.mean(-1, keepdim=True), r_GS.std(-1, keepdim=True)
    adv_B1 = ((r_GS - mean_G1) / (std_G1 + eps)).reshape(-1, 1)
    return masked_values(adv_B1.expand(response_mask.shape), response_mask).to(torch.float32)


def vopd_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    token_kl: torch.Tensor,
) -> torch.Tensor:
    """vOPD control variate: A = sg[lt − lo + KL(p_S ‖ p_T)_t] · m, float32 ``[B, T]``.

    token_kl: ``[B, T]`` from :func:`token_kl_full` or :func:`token_kl_topk` at the rollout
    weights. E_{y~p_S}[lt − lo] = −KL, so adding the KL leaves a zero-mean score. No clamp.
    Source: vOPD ("KL for a KL", 2026), ALGORITHMS.md §2.
    """
    check_same_shape(
        teacher_logprobs=teacher_logprobs,
        old_logprobs=old_logprobs,
        response_mask=response_mask,
        token_kl=token_kl,
    )
    with torch.no_grad():
        a_BT = teacher_logprobs.float() - old_logprobs.float() + token_kl.float()
        return masked_values(a_BT, response_mask)


def token_kl_full(
    student_logprobs_BTV: torch.Tensor, teacher_logprobs_BTV: torch.Tensor
) -> torch.Tensor:
    """KL(p_S ‖ p_T) per position over the full vocabulary, float32 ``[B, T]``.

        KL_t = Σ_v p_S(v) · (log p_S(v) − log p_T(v))

    Inputs ``[B, T, V]`` normalised log-probs, local (not vocab-parallel). Terms with
    p_S(v) = 0 contribute 0. Differentiable; :func:`vopd_advantages` detaches it.
    Source: vOPD ("KL for a KL", 2026).
    """
    check_same_shape(student=student_logprobs_BTV, teacher=teacher_logprobs_BTV)
    log_ps_BTV = student_logprobs_BTV.float()
    p_s_BTV = log_ps_BTV.exp()
    # where() before the product: 0 · (−inf) would be NaN in the value and in the gradient.
    log_diff_BTV = torch.where(p_s_BTV > 0, log_ps_BTV - teacher_logprobs_BTV.float(), 0.0)
    return (p_s_BTV * log_diff_BTV).sum(-1)


def token_kl_topk(
    student_topk_logprobs_BTK: torch.Tensor,
    teacher_logprobs_at_student_topk_BTK: torch.Tensor,
) -> torch.Tensor:
    """KL(p_S ‖ p_T) per position over the student's top-k set, renormalised; float32 ``[B, T]``.

        log q_S = ls − logsumexp_K(ls);  log q_T = lt − logsumexp_K(lt)
        KL_t = Σ_k q_S(k) · (log q_S(k) − log q_T(k))

    Inputs ``[B, T, K]``: the student's top-k log-probs and the teacher's log-probs of the same
    token ids (k = 100 in vOPD). Differentiable. Source: vOPD ("KL for a KL", 2026).
    """
    student = student_topk_logprobs_BTK.float()
    teacher = teacher_logprobs_at_student_topk_BTK.float()
    check_same_shape(student=student, teacher=teacher)
    log_qs_BTK = student - student.logsumexp(-1, keepdim=True)
    log_qt_BTK = teacher - teacher.logsumexp(-1, keepdim=True)
    return token_kl_full(log_qs_BTK, log_qt_BTK)


def mix_advantages(
    distill_advantages: torch.Tensor,
    outcome_advantages: torch.Tensor,
    *,
    outcome_weight: float,
) -> torch.Tensor:
    """Combined OPD + RLVR: A = A_distill + w · A_outcome, float32 ``[B, T]``.

    Both inputs ``[B, T]`` and already 0 at masked positions. ALGORITHMS.md §2.
    """
    check_same_shape(distill=distill_advantages, outcome=outcome_advantages)
    if not math.isfinite(outcome_weight):
        raise ValueError(f"outcome_weight must be a finite number (got {outcome_weight})")
    with torch.no_grad():
        return distill_advantages.float() + outcome_weight * outcome_advantages.float()


def _check_rewards(rewards_B: torch.Tensor, response_mask: torch.Tensor) -> None:
    if rewards_B.dim() != 1 or response_mask.dim() != 2:
        raise ValueError(
            f"expected rewards [B] and response_mask [B, T], got {tuple(rewards_B.shape)} and "
            f"{tuple(response_mask.shape)}; pass one scalar reward per sequence"
        )
    if rewards_B.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"rewards has {rewards_B.shape[0]} rows but response_mask has "
            f"{response_mask.shape[0]}; pass one reward per sequence of the batch"
        )
