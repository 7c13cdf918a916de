"""Both models' scores of a rollout: the stage between sampling and the advantages.

    rows    = the teachers' own rows of the rollout (teacher/cross_tokenizer.py; else its own)
    teacher = the teachers' pass over them, each row by its prompt's teacher (teacher/routed.py)
    student = the student's forward pass at the rollout weights ("old" log-probs)
    -> a teacher with its own tokenizer: its span scores put on the student's tokens

The method says which model goes first (vOPD: the student, whose top-k the teacher then
scores) and what each scores besides the sampled tokens (its :class:`ScoreRequest`\\ s). The
trainer scores every step this way; the held-out evaluation scores its samples the same way with
plain requests (:data:`PLAIN`), so it measures exactly what the run trains on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, broadcast_scores, score_batch
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.models.routing import RoutingPass
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import Rollout
from megatron_gndpo.teacher.cross_tokenizer import CrossTokenizer, teacher_input
from megatron_gndpo.teacher.routed import TeacherSet


class ScoringOrder(Protocol):
    """What the scoring asks of a method (``methods/base.py``'s hooks of the same names)."""

    @property
    def student_first(self) -> bool: ...

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None: ...

    def student_request(self, teacher: Scores | None) -> ScoreRequest: ...


class _Plain:
    """The sampled tokens' log-probs alone, the teacher first (the held-out evaluation)."""

    student_first = False

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        return None

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        return ScoreRequest()


PLAIN: ScoringOrder = _Plain()


@dataclasses.dataclass
class ScoredRollout:
    """A rollout's scores: the teacher's (on the student's tokens) and the student's at the
    rollout weights, ``[n, S]`` (and ``[n, S, K]`` where asked)."""

    teacher: Scores
    student: Scores
    scored: torch.Tensor  # [n, S] bool: the response tokens the teacher scored
    metrics: dict[str, float]  # a cross-tokenizer teacher's alignment (else empty)
    # an MoE student: its routers in the old-log-prob pass (compared with, or replaying, the
    # sampler's experts); None for a dense student or a rollout without recorded experts
    routing: RoutingPass | None = None


class RolloutScorer:
    """Scores this rank's rows of a rollout with the run's teachers and the student."""

    def __init__(
        self,
        student: Any,
        groups: ParallelGroups,
        *,
        head: TokenLogProbs,
        teachers: TeacherSet,
        cross: CrossTokenizer | None,
        token_budget: int,
        pack: bool,
    ) -> None:
        self.student_model, self.groups, self.head = student, groups, head
        self.teachers, self.cross = teachers, cross
        self.token_budget, self.pack = token_budget, pack

    def score(
        self,
        rollout: Rollout,
        prompts: Sequence[EncodedPrompt],
        routes: torch.Tensor,
        order: ScoringOrder = PLAIN,
        *,
        seed: int = 0,
        replay: bool = False,
        timer: Any = None,
    ) -> ScoredRollout:
        """Row ``i`` (prompt ``prompts[prompt_index[i]]``) scored by teacher ``routes[i]`` and
        by the student, in ``order``'s order with its requests; ``seed``: the step's (a teacher
        that samples draws from it); ``replay``: an MoE student replays the sampler's experts
        (``algorithm.routing_replay=rollout``). ``timer``: a stage timer, which gets
        ``cross_tokenizer``, ``teacher_logprobs`` and ``old_logprobs`` (None: untimed)."""
        time = timer.time if timer is not None else _untimed
        student, routing = None, None
        with time("cross_tokenizer"):  # the teachers' own rows (or the student's)
            rows, tokens, lengths = teacher_input(self.cross, rollout, prompts, routes)
        if order.student_first:
            with time("old_logprobs"):
                student, routing = self.student(rollout, order.student_request(None), replay)
        with time("teacher_logprobs"):
            request = order.teacher_request(student, seed)
            if request is not None and request.full_kl:  # the student's output shard meets it
                request = dataclasses.replace(request, kl_weight=self._output_weight())
            teacher = self.teachers.score_batch(
                tokens, lengths, request, images=rollout.images, routes=routes
            )
        if student is None:
            with time("old_logprobs"):
                student, routing = self.student(rollout, order.student_request(teacher), replay)
        student.hidden = None  # [n, S, H]: used by the teacher's pass only
        mask = rollout.response_mask
        if self.cross is None or rows is None:
            return ScoredRollout(teacher, student, mask, {}, routing)
        with time("cross_tokenizer"):
            teacher, scored, metrics = self.cross.on_student(
                teacher, rows, student.logprobs, mask, self.groups.dp_cp
            )
        return ScoredRollout(teacher, student, scored, metrics, routing)

    def student(
        self, rollout: Rollout, request: ScoreRequest, replay: bool = False
    ) -> tuple[Scores, RoutingPass | None]:
        """The student's scores of the rollout at its current weights, on every stage, and the
        pass's routing (an MoE student whose sampler recorded its experts: compared with them,
        or replaying them with ``replay``)."""
        routing = None
        if rollout.routing is not None:
            lengths = rollout.lengths.tolist()
            routing = RoutingPass(self.student_model, lengths, rollout.routing, replay=replay)
        scores = score_batch(
            self.student_model, self.groups, rollout.tokens, rollout.lengths, head=self.head,
            token_budget=self.token_budget, pack=self.pack, request=request,
            images=rollout.images, routing=routing,
        )  # fmt: skip
        device = next(self.student_model.parameters()).device  # on GPUs: NCCL
        template = request.template(*rollout.tokens.shape)
        scores = broadcast_scores(scores, template, self.groups, device)
        return scores.to(rollout.tokens.device), routing

    def _output_weight(self) -> torch.Tensor | None:
        """This rank's shard of the student's output layer (last stage), else None."""
        if not self.groups.is_last_stage:
            return None
        model = self.student_model
        model = getattr(model, "language_model", model)  # a VLM's output layer is its LM's
        if model.share_embeddings_and_output_weights:  # tied: the (last stage's) embedding
            return cast(torch.Tensor, model.shared_embedding_or_output_weight()).detach()
        return cast(torch.Tensor, model.output_layer.weight).detach()


@contextlib.contextmanager
def _untimed(name: str) -> Any:
    yield
