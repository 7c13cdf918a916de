"""TrOPD: the policy gradient on tokens where the teacher is trusted, imitation of the teacher's
top-k elsewhere, and optionally off-policy guidance from teacher-written prefixes;
docs/methods/tropd.md.

The teacher scores first, with its top-k when the outlier rule is ``topk_kl`` or prefixes are on.
With prefixes, each prompt's rollout continues the first ``prefix_share`` of the teacher's own
answer, and the teacher-written tokens get the distillation term instead of the policy gradient.
"""

from __future__ import annotations

from typing import ClassVar

from megatron_gndpo.algorithms import guidance
from megatron_gndpo.config.schema import Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.methods.base import KD_FIRST, BaseMethod, StepBatch, Targets, global_mean
from megatron_gndpo.parallel.groups import ParallelLayout


class TrOPD(BaseMethod):
    """Trust-region on-policy distillation."""

    name: ClassVar[str] = "tropd"

    @property
    def teacher_samples(self) -> bool:
        return self.cfg.tropd.prefix_share_start > 0

    @property
    def never_stops_advice(self) -> str:
        return (
            "TrOPD has not taught this student to stop yet: let the teacher write part of each "
            f"answer (algorithm.tropd.prefix_share_start > 0), {KD_FIRST}"
        )

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        t = self.cfg.tropd
        if t.outlier == "topk_kl" or t.prefix_share_start > 0:
            return ScoreRequest(top_k=t.top_k)
        return None

    def prefix_share(self, step: int) -> float:
        t = self.cfg.tropd
        if t.prefix_share_start <= 0:
            return 0.0
        return guidance.linear_schedule(
            step, t.prefix_share_start, t.prefix_share_end, t.prefix_decay_steps
        )

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        t, mask, written = self.cfg.tropd, batch.response_mask, batch.teacher_written
        teacher, student = batch.teacher, batch.student
        on_policy = mask.float()
        if written is not None:
            on_policy = on_policy * (1.0 - written.float())
        advantages, pg_mask, kl_mask = guidance.tropd_routing(
            teacher.logprobs, student.logprobs, on_policy, kl_clip=self.cfg.kl_clip,
            threshold=t.trust_threshold, outlier=t.outlier, outlier_clip=t.outlier_clip,
        )  # fmt: skip
        if written is not None:
            kl_mask = kl_mask + written.float() * mask.float()
        trusted = guidance.trusted_tokens(teacher.logprobs, student.logprobs, t.trust_threshold)
        metrics = {"tropd/trusted_frac": global_mean(trusted.float(), on_policy, batch.group)}
        beta = self.entropy_coef
        if teacher.topk_ids is None:  # outlier rule mask or clip, no prefix: no KL term
            return Targets(advantages, pg_mask=pg_mask, entropy_coef=beta), metrics
        targets = Targets(
            advantages, pg_mask=pg_mask, aux_ids=teacher.topk_ids,
            aux_logq=teacher.topk_logprobs, aux_mask=kl_mask, aux_coef=t.kl_coef,
            entropy_coef=beta,
        )  # fmt: skip
        return targets, metrics

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        r, t = cfg.rollout, cfg.algorithm.tropd
        if world_size is None or t.prefix_share_start <= 0:
            return []
        p = cfg.teacher.parallel
        try:
            teacher_dp = ParallelLayout(
                world_size=world_size, tp=p.tensor_parallel, pp=p.pipeline_parallel,
                cp=p.context_parallel,
            ).dp  # fmt: skip
        except ValueError:
            return []  # reported with the layout problems
        if r.prompts_per_step % teacher_dp:
            return [
                f"TrOPD's teacher-written prefixes: rollout.prompts_per_step "
                f"({r.prompts_per_step}) is not divisible by the teacher's data-parallel size "
                f"{teacher_dp} (each teacher replica answers an equal share of the prompts); "
                "make it a multiple"
            ]
        return []

    def top_ks(self) -> dict[str, int]:
        return {"tropd.top_k": self.cfg.tropd.top_k}

    def rollout_metrics(self, step: int, teacher_written_frac: float) -> dict[str, float]:
        return {
            "tropd/prefix_share": self.prefix_share(step),
            "tropd/teacher_written_frac": teacher_written_frac,
        }
