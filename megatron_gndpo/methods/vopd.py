"""vOPD: the per-token score plus the exact KL(student ‖ teacher) as a control variate,
``A = sg[lt − lo + KL]``; docs/methods/vopd.md.

The KL needs both distributions, so the student scores first: over its top-k ids
(``vopd_top_k > 0``; the teacher scores the same ids) or over the full vocabulary
(``vopd_top_k: 0``; the teacher meets the student's final hidden states and output shard on the
same ranks, so both models need one layout and one padded vocabulary).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.config.schema import Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, required
from megatron_gndpo.methods.base import StepBatch, global_mean
from megatron_gndpo.methods.distill import DistillMethod


class VOPD(DistillMethod):
    """The control-variate estimator, over the student's top-k or the full vocabulary."""

    name: ClassVar[str] = "vopd"

    @property
    def student_first(self) -> bool:  # the teacher scores the student's top-k (or hidden states)
        return True

    @property
    def full_vocabulary(self) -> bool:
        return self.cfg.vopd_top_k == 0

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        if student is None:
            raise ValueError("vopd scores the student first: its scores must come in")
        if self.full_vocabulary:  # the student's hidden states meet the teacher's output layer
            return ScoreRequest(full_kl=True, kl_hidden=student.hidden)
        return ScoreRequest(extra_ids=required(student.topk_ids, "vopd: the student's top-k ids"))

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        if self.full_vocabulary:
            return ScoreRequest(hidden=True, entropy=True)
        return ScoreRequest(top_k=self.cfg.vopd_top_k, entropy=True)

    def token_kl(self, batch: StepBatch) -> torch.Tensor:
        """KL(student ‖ teacher) ``[n, S]`` at the rollout weights."""
        if self.full_vocabulary:
            return required(batch.teacher.kl, "vopd: the teacher's full-vocabulary KL")
        return adv.token_kl_topk(
            required(batch.student.topk_logprobs, "vopd: the student's top-k log-probs"),
            required(batch.teacher.extra_logprobs, "vopd: the teacher's log-probs of them"),
        )

    def distill(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        token_kl = self.token_kl(batch)
        mask = batch.response_mask
        advantages = adv.vopd_advantages(
            batch.teacher.logprobs, batch.student.logprobs, mask.float(), token_kl
        )
        return advantages, {"vopd/kl_mean": global_mean(token_kl, mask, batch.group)}

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        return full_kl_problems(cfg) if self.full_vocabulary else []

    def top_ks(self) -> dict[str, int]:
        return {"vopd_top_k": self.cfg.vopd_top_k}


def full_kl_problems(cfg: Config) -> list[str]:
    """vOPD over the full vocabulary: both output layers split alike over the same ranks."""
    p, s, t = list[str](), cfg.parallel, cfg.teacher.parallel
    sizes = ("tensor_parallel", "pipeline_parallel", "context_parallel")
    if any(getattr(s, k) != getattr(t, k) for k in sizes):
        p.append(
            "algorithm.vopd_top_k=0 (KL over the full vocabulary) needs the teacher on the "
            "student's layout: set teacher.parallel.{tensor,pipeline,context}_parallel to "
            f"{s.tensor_parallel}/{s.pipeline_parallel}/{s.context_parallel}, or use top-k "
            "(e.g. algorithm.vopd_top_k=100)"
        )
    m, tm = cfg.model, cfg.teacher.model
    if (m.vocab_size, m.make_vocab_size_divisible_by) != (
        tm.vocab_size, tm.make_vocab_size_divisible_by
    ):  # fmt: skip
        p.append(
            "algorithm.vopd_top_k=0 needs the same padded vocabulary in both models: "
            "teacher.model.vocab_size and make_vocab_size_divisible_by must equal model.*"
        )
    return p
