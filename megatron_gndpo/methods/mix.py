"""Combined distillation and RLVR: ``A = A_distill + w · A_outcome`` (ALGORITHMS.md §2).

The distillation part (``algorithm.distill_estimator``: gndpo, opd or vopd) decides what the
models score and in which order; the outcome part (``algorithm.outcome_estimator``: grpo or
reinforce_pp) needs a verifiable reward.
"""

from __future__ import annotations

from typing import ClassVar

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.config.schema import AlgorithmConfig, Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.methods.base import BaseMethod, StepBatch, Targets, needs_rewards
from megatron_gndpo.methods.distill import GNDPO, OPD, DistillMethod
from megatron_gndpo.methods.outcome import GRPO, OutcomeMethod, ReinforcePP
from megatron_gndpo.methods.vopd import VOPD

DISTILL_PARTS: dict[str, type[DistillMethod]] = {m.name: m for m in (GNDPO, OPD, VOPD)}
OUTCOME_PARTS: dict[str, type[OutcomeMethod]] = {m.name: m for m in (GRPO, ReinforcePP)}


class Mix(BaseMethod):
    """A distillation estimator plus a weighted outcome estimator."""

    name: ClassVar[str] = "mix"

    def __init__(self, cfg: AlgorithmConfig) -> None:
        super().__init__(cfg)
        # None for an unknown name: problems() reports it, nothing else runs
        distill = DISTILL_PARTS.get(cfg.distill_estimator)
        outcome = OUTCOME_PARTS.get(cfg.outcome_estimator)
        self.distill = None if distill is None else distill(cfg)
        self.outcome = None if outcome is None else outcome(cfg)

    def _parts(self) -> tuple[DistillMethod, OutcomeMethod]:
        if self.distill is None or self.outcome is None:
            raise ValueError(
                f"estimator mix: unknown distill_estimator {self.cfg.distill_estimator!r} or "
                f"outcome_estimator {self.cfg.outcome_estimator!r} (validate the config)"
            )
        return self.distill, self.outcome

    @property
    def student_first(self) -> bool:
        return self._parts()[0].student_first

    @property
    def uses_reward(self) -> bool:
        return True

    @property
    def scores_spans(self) -> bool:
        return self.distill is not None and self.distill.scores_spans

    @property
    def uses_gndpo_switches(self) -> bool:
        return self.distill is not None and self.distill.uses_gndpo_switches

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        return self._parts()[0].teacher_request(student, seed)

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        return self._parts()[0].student_request(teacher)

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        distill, outcome = self._parts()
        rewards = needs_rewards(self.name, batch.rewards)  # before any collective
        a_distill, metrics = distill.distill(batch)
        a_outcome = outcome.outcome(batch, rewards)
        advantages = adv.mix_advantages(
            a_distill, a_outcome, outcome_weight=self.cfg.outcome_weight
        )
        return Targets(advantages, entropy_coef=self.entropy_coef), metrics

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        a, p = cfg.algorithm, list[str]()
        for key, value, parts in (
            ("distill_estimator", a.distill_estimator, DISTILL_PARTS),
            ("outcome_estimator", a.outcome_estimator, OUTCOME_PARTS),
        ):
            if value not in parts:
                p.append(f"algorithm.{key}: unknown name {value!r}; use one of {', '.join(parts)}")
        if a.outcome_weight <= 0:
            p.append(
                "algorithm.estimator=mix needs algorithm.outcome_weight > 0 "
                "(with 0 use the distillation estimator alone)"
            )
        for part in (self.distill, self.outcome):
            if part is not None:
                p += part.problems(cfg, world_size)
        return p

    def top_ks(self) -> dict[str, int]:
        return {} if self.distill is None else self.distill.top_ks()
