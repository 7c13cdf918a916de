"""What every teacher is to the trainer: a frozen scorer of the student's rows.

A teacher kind is a class with this shape (:class:`Teacher`); the kinds live beside it:

- ``local.py``: :class:`~megatron_gndpo.teacher.local.LocalTeacher`, a megatron-core model in
  this job on its own TP/PP (the usual teacher; it can also generate, for TrOPD's prefixes);
- ``served.py``: :class:`~megatron_gndpo.teacher.served.ServedTeacher`, a vLLM server queried
  for the student's token ids;
- ``routed.py``: :class:`~megatron_gndpo.teacher.routed.TeacherSet`, several teachers, each row
  scored by its prompt's (one teacher is a set of one);
- ``cross_tokenizer.py``: the stage that lets a teacher with its own tokenizer or its own
  prompt (``context.py``: privileged context) score the student's text (its rows before the
  pass, its scores on the student's tokens after).
- the student's own model as its teacher (``teacher.weights``: its initial weights, the live
  student, or an EMA of it, ``ema.py``),
  with its own prompt: on-policy context distillation.

``build.py`` makes the run's teachers from the config. A new kind of teacher (a teacher cache,
a teacher behind another API) is a new module here implementing :class:`Teacher` and a branch of
``build.py``; nothing above this package changes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_gndpo.engine.scoring import ScoreRequest, Scores


class Teacher(Protocol):
    """One teacher: scores every rank's rows of a step, each rank calling it alike."""

    name: str

    def score_batch(
        self,
        tokens_nS: torch.Tensor,
        lengths_n: torch.Tensor,
        request: ScoreRequest | None = None,
        images: list[torch.Tensor | None] | None = None,
    ) -> Scores:
        """:class:`Scores` ``[n, S]`` of this rank's rows (scoring convention: ``x[:, t]``
        belongs to token ``t``, 0 at ``t = 0`` and at padding), with what ``request`` asks for.
        ``images``: each row's image tiles (a vision-language teacher). Collective over every
        rank of the job."""
        ...

    def rows_multiple(self) -> int:
        """What the rows each student rank hands it must be a multiple of, so that its
        replicas split the step evenly (1 when it scores each rank's rows where they are)."""
        ...
