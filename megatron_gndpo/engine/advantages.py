"""The configured advantage estimator, dispatched to the pure functions in ``algorithms``.

Tensors are ``[n, S]`` in the scoring convention (``x[:, t]`` belongs to token ``t``) with the
response mask; ``group`` is the student's data-parallel x context-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.config.schema import AlgorithmConfig


def _distill(
    name: str, cfg: AlgorithmConfig, teacher: torch.Tensor, old: torch.Tensor,
    mask: torch.Tensor, group: Any, token_kl: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    if name == "gndpo":
        return adv.gndpo_advantages(
            teacher, old, mask, kl_clip=cfg.kl_clip, group=group,
            subtract_mean=cfg.gndpo_subtract_mean, divide_std=cfg.gndpo_divide_std,
        )  # fmt: skip
    if name == "opd":
        return adv.opd_advantages(teacher, old, mask, kl_clip=cfg.kl_clip)
    if name == "vopd":
        if token_kl is None:
            raise ValueError(
                "the vopd estimator needs token_kl, the per-token KL(student || teacher) at the "
                "rollout weights (engine/methods.py computes it from the scoring passes)"
            )
        return adv.vopd_advantages(teacher, old, mask, token_kl)
    raise ValueError(f"unknown distillation estimator {name!r}")


def _outcome(
    name: str, cfg: AlgorithmConfig, rewards: torch.Tensor, mask: torch.Tensor,
    group_size: int, group: Any,
) -> torch.Tensor:  # fmt: skip
    if name == "grpo":
        return adv.grpo_advantages(rewards, mask, group_size=group_size)
    if name == "reinforce_pp":
        token_rewards = adv.outcome_token_rewards(rewards, mask)
        return adv.reinforce_pp_advantages(token_rewards, mask, gamma=cfg.gamma, group=group)
    raise ValueError(f"unknown outcome estimator {name!r}")


def compute_advantages(
    cfg: AlgorithmConfig,
    *,
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor | None,
    group_size: int,
    group: Any,
    token_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 ``[n, S]`` advantages of ``cfg.estimator``, 0 off the response.

    ``token_kl [n, S]``: KL(student || teacher) per position, for vopd (alone or in mix).
    """
    mask = response_mask.float()
    if cfg.estimator in ("gndpo", "opd", "vopd"):
        return _distill(cfg.estimator, cfg, teacher_logprobs, old_logprobs, mask, group, token_kl)
    if rewards is None:
        raise ValueError(
            f"estimator {cfg.estimator} needs a verifiable reward: the prompts have no answers "
            "(data.answer_key)"
        )
    if cfg.estimator in ("grpo", "reinforce_pp"):
        return _outcome(cfg.estimator, cfg, rewards, mask, group_size, group)
    if cfg.estimator == "mix":
        distill = _distill(
            cfg.distill_estimator, cfg, teacher_logprobs, old_logprobs, mask, group, token_kl
        )
        outcome = _outcome(cfg.outcome_estimator, cfg, rewards, mask, group_size, group)
        return adv.mix_advantages(distill, outcome, outcome_weight=cfg.outcome_weight)
    raise ValueError(f"unknown estimator {cfg.estimator!r}")
