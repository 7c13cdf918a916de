"""TGPO: GRPO's outcome advantage plus teacher guidance at every response position, as a
decaying loss term towards the teacher's token(s) or as an advantage bonus; docs/methods/tgpo.md.

The teacher scores first: its greedy token (top-1), a token sampled from it, or its top-k. With
``guidance: advantage`` the student's pass also scores the teacher's token.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.algorithms import guidance
from megatron_gndpo.config.schema import Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, required
from megatron_gndpo.methods.base import BaseMethod, StepBatch, Targets, global_mean, needs_rewards
from megatron_gndpo.methods.outcome import group_problems


def guidance_ids(teacher: Scores) -> torch.Tensor:
    """The teacher token(s) per position, ``[n, S, K]``: sampled, greedy (K = 1) or top-k."""
    if teacher.sampled_ids is not None:
        return teacher.sampled_ids.unsqueeze(-1)
    return required(teacher.topk_ids, "tgpo: the teacher's top-k ids")


class TGPO(BaseMethod):
    """Teacher-guided policy optimisation on a verifiable reward."""

    name: ClassVar[str] = "tgpo"
    default_entropy_coef: ClassVar[float] = 0.001  # the release's

    @property
    def uses_reward(self) -> bool:
        return True

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        t = self.cfg.tgpo
        if t.teacher_token == "sampled":
            return ScoreRequest(sample_seed=seed)
        return ScoreRequest(top_k=1 if t.teacher_token == "greedy" else t.top_k)

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        if self.cfg.tgpo.guidance == "advantage":
            if teacher is None:
                raise ValueError("tgpo scores the teacher first: its scores must come in")
            return ScoreRequest(extra_ids=guidance_ids(teacher), entropy=True)
        return ScoreRequest(entropy=True)

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        t, beta, mask = self.cfg.tgpo, self.entropy_coef, batch.response_mask
        rewards = needs_rewards(self.name, batch.rewards)
        outcome = adv.grpo_advantages(rewards, mask.float(), group_size=batch.group_size)
        coef = guidance.linear_decay(batch.step, t.coef_start, t.coef_decay)
        ids = guidance_ids(batch.teacher)
        metrics = {"guidance/coef": coef}
        if batch.tokens is not None:  # how often the student sampled the teacher's first choice
            agree = (ids[..., 0] == batch.tokens).float()
            metrics["guidance/agree_frac"] = global_mean(agree, mask, batch.group)
        if t.guidance == "advantage":
            student_lp = required(
                batch.student.extra_logprobs, "tgpo: the teacher token's log-prob"
            )
            advantages = guidance.guidance_advantages(outcome, student_lp[..., 0], mask, coef)
            return Targets(advantages, entropy_coef=beta), metrics
        # greedy or sampled: one token with q = 1 (log q = 0): the term is the cross-entropy −ls(ŷ)
        logq = (
            required(batch.teacher.topk_logprobs, "tgpo: the teacher's top-k log-probs")
            if t.teacher_token == "topk"
            else torch.zeros_like(ids, dtype=torch.float32)
        )
        targets = Targets(
            outcome, aux_ids=ids, aux_logq=logq, aux_mask=mask.float(), aux_coef=coef,
            entropy_coef=beta,
        )  # fmt: skip
        return targets, metrics

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        p = group_problems(cfg)
        g = cfg.algorithm.tgpo
        if g.guidance == "advantage" and g.teacher_token == "topk":
            p.append(
                "algorithm.tgpo.teacher_token=topk needs algorithm.tgpo.guidance=loss (the "
                "advantage bonus is defined for one teacher token)"
            )
        return p

    def top_ks(self) -> dict[str, int]:
        return {"tgpo.top_k": self.cfg.tgpo.top_k}
