"""GNDPO and OPD: the per-token score ``c = clamp(lt - lo, -C, C)`` as the advantage, whitened
over the whole step batch (GNDPO) or as it is (OPD). docs/methods/gndpo.md, docs/methods/opd.md.

:class:`DistillMethod` is also the distillation part of ``mix`` (see mix.py): a subclass
implements :meth:`DistillMethod.distill`, the advantages from the two models' scores.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.config.schema import Config
from megatron_gndpo.methods.base import BaseMethod, StepBatch, Targets


class DistillMethod(BaseMethod):
    """A method whose advantage comes from the teacher's and the student's scores alone."""

    def distill(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Float32 ``[n, S]`` advantages, 0 off the response, and this part's metrics."""
        raise NotImplementedError

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        advantages, metrics = self.distill(batch)
        return Targets(advantages, entropy_coef=self.entropy_coef), metrics


class SampledTokenDistill(DistillMethod):
    """A distillation method that reads the teacher's log-probs of the sampled tokens only, on
    the tokens the teacher scored (so a teacher with its own tokenizer may score spans)."""

    @property
    def scores_spans(self) -> bool:
        return True


class GNDPO(SampledTokenDistill):
    """The clamped score whitened by the global batch mean and std (ALGORITHMS.md §2)."""

    name: ClassVar[str] = "gndpo"

    @property
    def uses_gndpo_switches(self) -> bool:
        return True

    def distill(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg
        lt, lo, mask = batch.teacher.logprobs, batch.student.logprobs, batch.distill_mask.float()
        halves = {"subtract_mean": a.gndpo_subtract_mean, "divide_std": a.gndpo_divide_std}
        if batch.stat_groups is not None:  # several teachers, each with its own statistics
            advantages = adv.gndpo_advantages_by_group(
                lt, lo, mask, batch.stat_groups, batch.num_stat_groups, kl_clip=a.kl_clip,
                group=batch.group, **halves,
            )  # fmt: skip
            return advantages, {}
        advantages = adv.gndpo_advantages(
            lt, lo, mask, kl_clip=a.kl_clip, group=batch.group, **halves
        )
        return advantages, {}

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        a = cfg.algorithm
        if not (a.gndpo_subtract_mean or a.gndpo_divide_std):
            return [
                "algorithm.gndpo_subtract_mean=false with gndpo_divide_std=false is OPD: use "
                "algorithm.estimator=opd"
            ]
        return []


class OPD(SampledTokenDistill):
    """The clamped score itself, masked (the baseline)."""

    name: ClassVar[str] = "opd"

    def distill(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        advantages = adv.opd_advantages(
            batch.teacher.logprobs, batch.student.logprobs, batch.distill_mask.float(),
            kl_clip=self.cfg.kl_clip,
        )  # fmt: skip
        return advantages, {}
