"""Several frozen teachers, each scoring only the rows routed to it (docs/TEACHERS.md).

A prompt names its teacher in the field ``data.teacher_key`` (``data_source``-style, one of a
teacher's name or ``sources``); a prompt without it goes to ``data.default_teacher``. Each row
of a step is scored by its prompt's teacher alone: every rank runs the teachers one after
another, each on its own layout (:class:`~megatron_gndpo.teacher.base.Teacher`), so at
most one teacher's activations exist at a time. A teacher receives this rank's rows routed to
it, padded with one-token rows to the most any rank has (a teacher replica scores an equal share
of the step); the pad rows are dropped again and every row keeps its own teacher's scores.

With one teacher, :meth:`TeacherSet.score_batch` is that teacher's, unchanged.

Legend: n = rows of this student rank, S = padded positions, m = rows a teacher scores per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.errors import DataError
from megatron_gndpo.teacher.base import Teacher
from megatron_gndpo.teacher.ema import EMAWeights


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which teacher scores a prompt: teacher index by routing value, and the default's."""

    names: tuple[str, ...]
    by_value: dict[str, int]
    default: int
    key: str  # data.teacher_key, for messages

    def of(self, source: str | None, where: str) -> int:
        """The teacher index of a prompt whose routing value is ``source`` (None: absent)."""
        if source is None:
            return self.default
        if source not in self.by_value:
            raise DataError(
                f"{where}: {self.key}={source!r} names no teacher; the teachers take "
                f"{sorted(self.by_value)} (their names and sources). Add it to a teacher's "
                "sources, or fix the record"
            )
        return self.by_value[source]


class TeacherSet:
    """The run's teachers; :meth:`score_batch` scores each row with its prompt's teacher
    (``routing``: which that is; None with one teacher)."""

    def __init__(
        self,
        teachers: Sequence[Teacher],
        *,
        weights: Sequence[float] | None = None,
        pad_ids: Sequence[int] | None = None,
        routing: Routing | None = None,
        emas: Sequence[EMAWeights] = (),
    ) -> None:
        if not teachers:
            raise ValueError("a TeacherSet needs at least one teacher")
        self.scorers = list(teachers)
        self.names = tuple(t.name for t in teachers)
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(teachers)
        # each teacher's padding id (its own tokenizer's with teacher.cross_tokenizer)
        self.pad_ids = tuple(pad_ids) if pad_ids is not None else (0,) * len(teachers)
        self.routing = routing
        self.emas = list(emas)  # the teachers that follow the student (teacher.weights=ema)

    def __len__(self) -> int:
        return len(self.scorers)

    @property
    def only(self) -> Any:
        """The one teacher (what needs a single teacher: TrOPD's teacher-written prefixes)."""
        if len(self.scorers) != 1:
            raise ValueError(f"this run has {len(self.scorers)} teachers, not one")
        return self.scorers[0]

    @property
    def model(self) -> Any:
        return self.only.model

    def after_update(self) -> None:
        """The teachers that follow the student (EMA) take an optimizer step's weights in."""
        for ema in self.emas:
            ema.update()

    def save_state(self, directory: Path) -> None:
        """Write the teachers that change during training (EMA) into a step directory (every
        rank, its own shards)."""
        for j, ema in enumerate(self.emas):
            ema.save(directory, j)

    def load_state(self, directory: Path) -> bool:
        """Read them back from a resumed step directory; False when one had nothing saved."""
        return all([ema.load(directory, j) for j, ema in enumerate(self.emas)])

    def routes(self, prompts: Sequence[EncodedPrompt], prompt_index: torch.Tensor) -> torch.Tensor:
        """Teacher index ``[n]`` of each rollout row (row ``i``: ``prompts[prompt_index[i]]``)."""
        if self.routing is None:
            return torch.zeros(prompt_index.shape, dtype=torch.long)
        of = [self.routing.of(p.example.source, p.example.where) for p in prompts]
        return torch.tensor([of[int(i)] for i in prompt_index], dtype=torch.long)

    def nonfinite(
        self, logprobs_nS: torch.Tensor, mask_nS: torch.Tensor, routes_n: torch.Tensor
    ) -> list[str]:
        """The teachers whose log-probs are NaN or infinite on a response token of any rank
        (one all-reduce over the world; every rank gets the same names)."""
        bad_n = (~torch.isfinite(logprobs_nS.cpu()) & mask_nS.cpu()).any(dim=1)
        flags = torch.zeros(len(self.names))
        flags[routes_n.cpu()[bad_n].unique()] = 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [name for name, flag in zip(self.names, flags.tolist(), strict=True) if flag]

    def score_batch(
        self,
        tokens_nS: torch.Tensor,
        lengths_n: torch.Tensor,
        request: ScoreRequest | None = None,
        images: list[torch.Tensor | None] | None = None,
        routes: torch.Tensor | None = None,
    ) -> Scores:
        """:class:`Scores` ``[n, S]`` of this rank's rows, row ``i`` by teacher ``routes[i]``
        (``routes [n]`` int64; not read with one teacher). Every rank calls it."""
        if len(self.scorers) == 1:
            return self.scorers[0].score_batch(tokens_nS, lengths_n, request, images)
        if routes is None or routes.shape != lengths_n.shape:
            raise ValueError(f"{len(self.scorers)} teachers need routes [n], got {routes}")
        n = tokens_nS.shape[0]
        counts = torch.bincount(routes.cpu(), minlength=len(self.scorers)).double()
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the teachers span every rank
        out: Scores | None = None
        for j, scorer in enumerate(self.scorers):
            rows = torch.nonzero(routes.cpu() == j).flatten()
            m = _rows_per_rank(int(counts[j]), scorer)
            if m == 0:  # no rank has a row for this teacher this step
                continue
            sub_tokens, sub_lengths = self._padded(tokens_nS, lengths_n, rows, m, j)
            sub_request = None if request is None else _rows_of_request(request, rows, m)
            sub_images = None
            if images is not None:
                sub_images = [images[int(i)] for i in rows] + [None] * (m - len(rows))
            scores = scorer.score_batch(sub_tokens, sub_lengths, sub_request, sub_images)
            if out is None:  # every teacher returns the same fields for the same request
                out = scores.map(lambda t: t.new_zeros((n, *t.shape[1:])))
            for name, value in scores.items():
                getattr(out, name)[rows.to(value.device)] = value[: len(rows)]
        assert out is not None, "a step batch with no rows"
        return out

    def _padded(
        self, tokens_nS: torch.Tensor, lengths_n: torch.Tensor, rows: torch.Tensor, m: int, j: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of the batch, then one-token pad rows (teacher ``j``'s padding) up to ``m``."""
        width = tokens_nS.shape[1]
        tokens = tokens_nS.new_full((m, width), self.pad_ids[j])
        lengths = lengths_n.new_ones(m)
        tokens[: len(rows)] = tokens_nS[rows.to(tokens_nS.device)]
        lengths[: len(rows)] = lengths_n[rows.to(lengths_n.device)]
        return tokens, lengths


def _rows_per_rank(most: int, teacher: Teacher) -> int:
    """``most`` rounded up so that the teacher's replicas split the step's rows evenly."""
    step = teacher.rows_multiple()
    return -(-most // step) * step


def _rows_of_request(request: ScoreRequest, rows: torch.Tensor, m: int) -> ScoreRequest:
    """``request`` for ``rows`` of the batch padded to ``m``: its per-row tensors sliced."""

    def take(value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        part = value.new_zeros((m, *value.shape[1:]))
        part[: len(rows)] = value[rows.to(value.device)]
        return part

    return dataclasses.replace(
        request, extra_ids=take(request.extra_ids), kl_hidden=take(request.kl_hidden)
    )
