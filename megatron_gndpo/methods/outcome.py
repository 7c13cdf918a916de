"""GRPO and REINFORCE++: advantages from a verifiable reward per response (RLVR baselines).
docs/methods/rlvr.md.

:class:`OutcomeMethod` is also the outcome part of ``mix`` (see mix.py): a subclass implements
:meth:`OutcomeMethod.outcome`, the advantages from the rewards.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.config.schema import Config
from megatron_gndpo.methods.base import (
    KD_FIRST,
    BaseMethod,
    StepBatch,
    Targets,
    needs_rewards,
)


class OutcomeMethod(BaseMethod):
    """A method whose advantage comes from a scalar reward per response."""

    @property
    def uses_reward(self) -> bool:
        return True

    @property
    def scores_spans(self) -> bool:
        return True  # the teacher only feeds the score/* metrics

    @property
    def never_stops_advice(self) -> str:
        return (
            f"With {self.name} the reward cannot tell answers apart when none of them ends: "
            f"raise rollout.max_response_length, {KD_FIRST}"
        )

    def outcome(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        """Float32 ``[n, S]`` advantages of ``rewards [n]``, 0 off the response."""
        raise NotImplementedError

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        advantages = self.outcome(batch, needs_rewards(self.name, batch.rewards))
        return Targets(advantages, entropy_coef=self.entropy_coef), {}


class GRPO(OutcomeMethod):
    """Group-relative: each reward against its prompt group's mean and std."""

    name: ClassVar[str] = "grpo"

    def outcome(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        mask = batch.response_mask.float()
        return adv.grpo_advantages(rewards, mask, group_size=batch.group_size)

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        return group_problems(cfg)


class ReinforcePP(OutcomeMethod):
    """REINFORCE++ (global): discounted returns whitened over the whole step batch."""

    name: ClassVar[str] = "reinforce_pp"

    def outcome(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        mask = batch.response_mask.float()
        token_rewards = adv.outcome_token_rewards(rewards, mask)
        return adv.reinforce_pp_advantages(
            token_rewards, mask, gamma=self.cfg.gamma, group=batch.group
        )


def group_problems(cfg: Config) -> list[str]:
    """A group-relative baseline needs two or more samples of each prompt."""
    if cfg.rollout.samples_per_prompt < 2:
        return ["grpo compares samples of the same prompt: rollout.samples_per_prompt must be >= 2"]
    return []
