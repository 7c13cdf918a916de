"""The advantages stage of a step: the method's targets from both models' scores, with the
step's score and advantage metrics, each teacher's share of the policy gradient, and the
off-policy correction's importance weights (``algorithm.offpolicy``).

Every statistic is global over ``group``, the student's data-parallel x context-parallel group:
every rank of it calls these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from megatron_gndpo.algorithms.metrics import advantage_metrics, score_metrics, teacher_metrics
from megatron_gndpo.algorithms.offpolicy import importance_weights, offpolicy_metrics
from megatron_gndpo.config.schema import AlgorithmConfig, OffPolicyConfig
from megatron_gndpo.methods.base import Method, StepBatch, Targets


def step_targets(
    method: Method,
    cfg: AlgorithmConfig,
    batch: StepBatch,
    routes: torch.Tensor,
    teacher_names: Sequence[str],
    teacher_weights: Sequence[float],
) -> tuple[Targets, dict[str, float]]:
    """``method``'s targets of ``batch`` and the step's metrics. With several teachers
    (``teacher_names``; ``routes [n]``: each row's), their scores apart and each row's advantages
    scaled by its teacher's weight; ``cfg.teacher_stats=teacher`` normalises each teacher's rows
    on their own (``batch.stat_groups`` is set here from ``routes``)."""
    scored = batch.distill_mask
    teacher, student = batch.teacher.logprobs, batch.student.logprobs
    metrics = score_metrics(
        teacher, student, scored.float(), kl_clip=cfg.kl_clip, group=batch.group
    )
    several = len(teacher_names) > 1
    if several and cfg.teacher_stats == "teacher":
        batch = _per_teacher(batch, routes, len(teacher_names))
    targets, extra = method.targets(batch)
    if several:
        metrics |= teacher_metrics(
            teacher, student, scored, routes, tuple(teacher_names), kl_clip=cfg.kl_clip,
            group=batch.group,
        )  # fmt: skip
        weights = torch.tensor(list(teacher_weights), dtype=targets.advantages.dtype)
        if bool((weights != 1.0).any()):  # each teacher's share of the policy gradient
            row_weight = weights[routes].to(targets.advantages.device)
            targets.advantages = targets.advantages * row_weight[:, None]
    mask = batch.response_mask.float()
    return targets, metrics | extra | advantage_metrics(targets.advantages, mask, group=batch.group)


def _per_teacher(batch: StepBatch, routes: torch.Tensor, teachers: int) -> StepBatch:
    return dataclasses.replace(batch, stat_groups=routes, num_stat_groups=teachers)


def offpolicy_correction(
    cfg: OffPolicyConfig,
    old_lp: torch.Tensor,
    sampler_lp: torch.Tensor,
    sampled: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights ``[n, S]`` of the policy-gradient term for the gap between the
    sampler's log-probs ``sampler_lp`` and the trainer's ``old_lp`` on the ``sampled`` tokens
    (docs/methods/offpolicy.md), with their metrics; None and no metrics without a correction."""
    if cfg.correction == "none":
        return None, {}
    weights, info = importance_weights(
        old_lp, sampler_lp, sampled, correction=cfg.correction, level=cfg.level,
        tis_cap=cfg.tis_cap, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
    )  # fmt: skip
    return weights, offpolicy_metrics(
        weights, info, sampled, correction=cfg.correction, group=group
    )
