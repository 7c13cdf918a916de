"""Top-k KD: on-policy distillation by a divergence (forward, reverse, mixed, GKD's generalized
JSD, skew KL) between the teacher's and the student's next-token distributions on the teacher's
top-k ids plus a tail bucket, at every position of the student's own samples; optionally beside
GNDPO's or OPD's sampled-token policy gradient. docs/methods/divergences.md.

The teacher scores first, with its top-k. The divergence is the update's distillation term
(``Targets.aux_*``): the student's log-probs of the teacher's ids come from the update's own
head, with their gradient, in the same pass as the sampled tokens'.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatron_gndpo.algorithms.divergences import Divergence, tail_mass
from megatron_gndpo.config.schema import AlgorithmConfig, Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, required
from megatron_gndpo.methods.base import KD_FIRST, BaseMethod, StepBatch, Targets, global_mean
from megatron_gndpo.methods.distill import GNDPO, OPD, DistillMethod

# The sampled-token policy-gradient parts a divergence may sit beside (divergence.policy_gradient).
POLICY_GRADIENTS: dict[str, type[DistillMethod]] = {m.name: m for m in (GNDPO, OPD)}


def divergence_of(cfg: AlgorithmConfig) -> Divergence:
    """The divergence ``algorithm.divergence`` configures (ValueError on a value out of range)."""
    d = cfg.divergence
    return Divergence(
        kind=d.kind, tail=d.tail, mixed_weight=d.mixed_kl_weight, beta=d.beta, skew=d.skew_lambda
    )


class TopKKD(BaseMethod):
    """A divergence to the teacher's top-k (+ tail) on the student's own samples."""

    name: ClassVar[str] = "topk_kd"

    def __init__(self, cfg: AlgorithmConfig) -> None:
        super().__init__(cfg)
        part = POLICY_GRADIENTS.get(cfg.divergence.policy_gradient)  # None: no policy gradient
        self.policy_gradient = None if part is None else part(cfg)

    @property
    def uses_gndpo_switches(self) -> bool:
        return self.policy_gradient is not None and self.policy_gradient.uses_gndpo_switches

    @property
    def never_stops_advice(self) -> str:
        return (
            "The divergence has not taught this student to stop yet: the teacher's stop token "
            "pulls only where it is among the teacher's top-k, and with kind reverse or "
            "skew_reverse the pull is scaled by the student's own stop probability; use "
            f"algorithm.divergence.kind=forward (or mixed), raise algorithm.divergence.coef, or "
            f"{KD_FIRST}"
        )

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        return ScoreRequest(top_k=self.cfg.divergence.top_k)

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        d, mask = self.cfg.divergence, batch.response_mask
        ids = required(batch.teacher.topk_ids, "topk_kd: the teacher's top-k ids")
        logq = required(batch.teacher.topk_logprobs, "topk_kd: the teacher's top-k log-probs")
        metrics = {"divergence/teacher_tail": global_mean(tail_mass(logq), mask, batch.group)}
        if batch.tokens is not None:  # how much of what the student samples the top-k covers
            covered = (ids == batch.tokens.unsqueeze(-1)).any(-1).float()
            metrics["divergence/sampled_in_topk"] = global_mean(covered, mask, batch.group)
        if self.policy_gradient is None:  # the divergence alone: no token in the policy gradient
            advantages = torch.zeros_like(mask, dtype=torch.float32)
            pg_mask: torch.Tensor | None = torch.zeros_like(advantages)
        else:
            advantages, part_metrics = self.policy_gradient.distill(batch)
            pg_mask, metrics = None, metrics | part_metrics
        targets = Targets(
            advantages, pg_mask=pg_mask, aux_ids=ids, aux_logq=logq, aux_mask=mask.float(),
            aux_coef=d.coef, entropy_coef=self.entropy_coef, aux_divergence=divergence_of(self.cfg),
        )  # fmt: skip
        return targets, metrics

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        d, p = cfg.algorithm.divergence, list[str]()
        if not 1 <= d.top_k <= cfg.model.vocab_size:
            p.append(
                f"algorithm.divergence.top_k must be in [1, {cfg.model.vocab_size}] (the "
                f"vocabulary), got {d.top_k}"
            )
        if d.tail == "renormalize" and d.top_k == 1:
            p.append(
                "algorithm.divergence.tail=renormalize with top_k=1 compares two distributions "
                "on one id, always equal (the loss is 0): set tail=bucket or top_k > 1"
            )
        if d.coef <= 0:
            p.append(
                f"algorithm.divergence.coef must be > 0, got {d.coef} (for the sampled-token "
                "score alone use algorithm.estimator gndpo or opd)"
            )
        for key, value in (("mixed_kl_weight", d.mixed_kl_weight), ("beta", d.beta)):
            if not 0.0 <= value <= 1.0:
                p.append(f"algorithm.divergence.{key} must be in [0, 1], got {value}")
        if not 0.0 <= d.skew_lambda < 1.0:
            p.append(
                f"algorithm.divergence.skew_lambda must be in [0, 1) (1 makes the divergence 0), "
                f"got {d.skew_lambda}"
            )
        weighted = [t.name or str(i) for i, t in enumerate(cfg.teachers) if t.weight != 1.0]
        if weighted and self.policy_gradient is None:
            p.append(
                f"teachers {', '.join(weighted)}: a teacher's weight scales its rows' policy "
                "gradient, and algorithm.divergence.policy_gradient=none has none; set the "
                "weights to 1 or choose policy_gradient gndpo or opd"
            )
        if cfg.algorithm.offpolicy.correction != "none" and self.policy_gradient is None:
            p.append(
                "algorithm.offpolicy.correction weights the policy gradient, and "
                "algorithm.divergence.policy_gradient=none has none (the divergence is exact at "
                "each position and needs no weight); set correction=none or choose "
                "policy_gradient gndpo or opd"
            )
        if self.policy_gradient is not None:
            p += self.policy_gradient.problems(cfg, world_size)
        return p

    def top_ks(self) -> dict[str, int]:
        return {"divergence.top_k": self.cfg.divergence.top_k}
