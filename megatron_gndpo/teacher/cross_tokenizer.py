"""The teachers' own rows: a teacher with its own tokenizer or its own prompt scores the
student's responses.

Between the rollout and the teacher's pass, each response is put after the teacher's prompt (the
student's prompt, or its own: ``teacher.context``, ``teacher/context.py``) in the teacher's chat
template. A teacher of another tokenizer gets the response decoded, re-encoded in its tokenizer
and aligned with the student's tokens (``data/alignment.py``); after the student's pass, the
teacher's span log-probs become one effective teacher log-prob per student token
(``algorithms/cross_tokenizer.py``), which every method then reads as it reads a
same-tokenizer teacher's (docs/methods/cross_tokenizer.md):

    rows = cross.rows(rollout, prompts, routes)                      # this rank's rows
    own = teachers.score_batch(rows.tokens, rows.lengths, routes=routes)   # the teacher's layout
    ... the student's old log-probs ...
    teacher, scored, metrics = cross.on_student(own, rows, old_lp, rollout.response_mask)

A teacher whose tokenizer is the student's (the same vocabulary fingerprint) scores the
student's own response ids, each token its own span, after its prompt: with the student's
prompt that is the student's row itself, exactly the same-tokenizer score; with its own prompt
the same ids shifted by the prompts' difference. The student's stop token (a finished
response) is paired with the teacher's EOS as a span of its own; a response cut at the length
limit has none. Spans the teacher's text does not reproduce are dropped (no score for their
student tokens), and so are those beyond the teacher's ``max_position_embeddings`` (the row is
cut there).

Legend: n = rows of this rank, S = the student's padded row length, U = the teacher's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from megatron_gndpo.algorithms.cross_tokenizer import alignment_metrics, span_teacher_logprobs
from megatron_gndpo.config.schema import TeacherContextConfig
from megatron_gndpo.data.alignment import align, decoded_ends, encode_ends
from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.engine.scoring import Scores
from megatron_gndpo.rollout.base import Rollout
from megatron_gndpo.teacher.context import prompt_ids

# A student token no kept span holds (prompt, padding, dropped span)
NO_SPAN = -1


@dataclasses.dataclass(frozen=True)
class TeacherRows:
    """This rank's rows in the teachers' tokens, and the spans that tie them to the student's.

    ``student_span [n, S]`` and ``teacher_span [n, U]`` give each token its span's index within
    its row (:data:`NO_SPAN` outside kept spans); ``counts``: local sums for the metrics.
    """

    tokens: torch.Tensor  # [n, U] int64, right-padded with each row's teacher's pad id
    lengths: torch.Tensor  # [n] int64
    student_span: torch.Tensor  # [n, S] int64
    teacher_span: torch.Tensor  # [n, U] int64
    counts: dict[str, float]


@dataclasses.dataclass
class _Row:
    ids: list[int]
    student_pos: list[int] = dataclasses.field(default_factory=list)  # one per span token
    student_span: list[int] = dataclasses.field(default_factory=list)
    teacher_pos: list[int] = dataclasses.field(default_factory=list)
    teacher_span: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    teacher_tokens: int = 0
    truncated: bool = False

    def add(self, span: int, student: range, teacher: range) -> None:
        self.student_pos += student
        self.student_span += [span] * len(student)
        self.teacher_pos += teacher
        self.teacher_span += [span] * len(teacher)


@dataclasses.dataclass(frozen=True)
class TeacherTokenizer:
    """One teacher's tokenizer as the stage uses it: ``same`` when it is the student's (the
    response ids are then the student's own), the longest row its model takes, and its own
    prompt (``context``; None: the student's)."""

    tokenizer: Tokenizer
    same: bool
    max_length: int
    context: TeacherContextConfig | None = None

    def prompt(self, example: PromptExample) -> list[int]:
        """The teacher's prompt ids for ``example``, in its chat template."""
        return prompt_ids(self.tokenizer, self.context, example)


class CrossTokenizer:
    """Builds each teacher's rows of the step and maps its scores back (module docstring).

    ``teachers[j]``: teacher j's tokenizer, in the order of the run's teachers (the
    ``routes`` index).
    """

    def __init__(self, student: Tokenizer, teachers: Sequence[TeacherTokenizer]) -> None:
        self.student = student
        self.teachers = list(teachers)

    def rows(
        self, rollout: Rollout, prompts: Sequence[EncodedPrompt], routes: torch.Tensor
    ) -> TeacherRows:
        """The teachers' rows of ``rollout`` (row ``i``: prompt ``prompts[prompt_index[i]]``,
        scored by teacher ``routes[i]``); local work only, no collective."""
        templates: dict[tuple[int, int], list[int]] = {}  # (teacher, prompt): its prompt ids
        built: list[_Row] = []
        n, width = rollout.tokens.shape
        tokens = rollout.tokens.cpu()
        for i in range(n):
            j, p = int(routes[i]), int(rollout.prompt_index[i])
            start, end = int(rollout.prompt_lengths[i]), int(rollout.lengths[i])
            row = tokens[i, :end].tolist()
            teacher = self.teachers[j]
            if (j, p) not in templates:
                templates[j, p] = teacher.prompt(prompts[p].example)
            prompt = templates[j, p]
            if end == start:  # an empty response (a filtered row's stub): nothing to score
                built.append(_Row(row if teacher.same else [teacher.tokenizer.pad_id]))
            elif teacher.same:  # the student's response ids after the teacher's prompt
                built.append(_shifted_row(prompt, row, start))
            else:
                finished = bool(rollout.finished[i])
                built.append(self._row(teacher, prompt, row, start, finished))
            _truncate(built[-1], teacher.max_length)
        return self._tensors(built, n, width, rollout.tokens.device, routes)

    def _row(
        self, teacher: TeacherTokenizer, prompt: list[int], row: list[int], start: int,
        finished: bool,
    ) -> _Row:  # fmt: skip
        """The teacher's row of one response: its prompt, the response text re-encoded and,
        when the student stopped, the teacher's EOS; the spans between the two."""
        response = row[start : len(row) - 1] if finished else row[start:]
        text, student_ends = decoded_ends(self.student.decode, response)
        ids, teacher_text, teacher_ends = encode_ends(teacher.tokenizer, text)
        alignment = align(text, student_ends, teacher_text, teacher_ends)
        out = _Row([*prompt, *ids], dropped=alignment.dropped_spans)
        t0 = len(prompt)
        for k, ((a, b), (c, d)) in enumerate(alignment.spans):
            out.add(k, range(start + a, start + b), range(t0 + c, t0 + d))
        if finished:  # the stop token: the teacher's EOS at the same place
            out.ids.append(teacher.tokenizer.eos_id)
            out.add(len(alignment.spans), range(len(row) - 1, len(row)),
                    range(len(out.ids) - 1, len(out.ids)))  # fmt: skip
        out.teacher_tokens = len(out.ids) - t0
        return out

    def _tensors(
        self, rows: list[_Row], n: int, width: int, device: torch.device, routes: torch.Tensor
    ) -> TeacherRows:
        teacher_width = max(len(r.ids) for r in rows) if rows else 1
        pads = [self.teachers[int(j)].tokenizer.pad_id for j in routes.tolist()]
        tokens = torch.tensor(pads, dtype=torch.long)[:, None].repeat(1, teacher_width)
        student_span = torch.full((n, width), NO_SPAN, dtype=torch.long)
        teacher_span = torch.full((n, teacher_width), NO_SPAN, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
            student_span[i, r.student_pos] = torch.tensor(r.student_span, dtype=torch.long)
            teacher_span[i, r.teacher_pos] = torch.tensor(r.teacher_span, dtype=torch.long)
        counts = {
            "spans_dropped": float(sum(r.dropped for r in rows)),
            "teacher_tokens": float(sum(r.teacher_tokens for r in rows)),
            "truncated_rows": float(sum(r.truncated for r in rows)),
        }
        lengths = torch.tensor([len(r.ids) for r in rows], dtype=torch.long)
        return TeacherRows(
            tokens.to(device), lengths.to(device), student_span.to(device),
            teacher_span.to(device), counts,
        )  # fmt: skip

    def on_student(
        self,
        teacher: Scores,
        rows: TeacherRows,
        old_logprobs_nS: torch.Tensor,
        response_mask_nS: torch.Tensor,
        group: Any,
    ) -> tuple[Scores, torch.Tensor, dict[str, float]]:
        """The teacher's scores on the student's tokens (``lt'`` of
        ``algorithms/cross_tokenizer.py``), the ``[n, S]`` bool mask of tokens that have one,
        and the alignment's metrics (global over ``group``, the student's DP x CP group: every
        rank of it calls this)."""
        lt, scored = span_teacher_logprobs(
            teacher.logprobs, rows.teacher_span, old_logprobs_nS, rows.student_span
        )
        metrics = alignment_metrics(
            teacher.logprobs, rows.teacher_span, old_logprobs_nS, rows.student_span,
            response_mask_nS, rows.counts, group,
        )  # fmt: skip
        return Scores(lt), scored & response_mask_nS.bool(), metrics


def teacher_input(
    cross: CrossTokenizer | None,
    rollout: Rollout,
    prompts: Sequence[EncodedPrompt],
    routes: torch.Tensor,
) -> tuple[TeacherRows | None, torch.Tensor, torch.Tensor]:
    """What the teachers score, ``(rows, tokens, lengths)``: without a cross-tokenizer teacher
    the student's rows themselves (``rows`` None); with one, :meth:`CrossTokenizer.rows`."""
    if cross is None:
        return None, rollout.tokens, rollout.lengths
    rows = cross.rows(rollout, prompts, routes)
    return rows, rows.tokens, rows.lengths


def _shifted_row(prompt: list[int], row: list[int], start: int) -> _Row:
    """The student's response ids after the teacher's ``prompt``, each token a span of one
    (with the student's own prompt: the student's row itself)."""
    out = _Row([*prompt, *row[start:]], teacher_tokens=len(row) - start)
    shift = len(prompt) - start
    for k, t in enumerate(range(start, len(row))):
        out.add(k, range(t, t + 1), range(t + shift, t + shift + 1))
    return out


def _truncate(row: _Row, limit: int) -> None:
    """Cut a row longer than the teacher's model takes; its spans past the cut are dropped."""
    if len(row.ids) <= limit:
        return
    row.ids = row.ids[:limit]
    row.truncated = True
    cut = {s for p, s in zip(row.teacher_pos, row.teacher_span, strict=True) if p >= limit}
    row.dropped += len(cut)
    keep_s = [k for k, s in enumerate(row.student_span) if s not in cut]
    keep_t = [k for k, s in enumerate(row.teacher_span) if s not in cut]
    row.student_pos = [row.student_pos[k] for k in keep_s]
    row.student_span = [row.student_span[k] for k in keep_s]
    row.teacher_pos = [row.teacher_pos[k] for k in keep_t]
    row.teacher_span = [row.teacher_span[k] for k in keep_t]
