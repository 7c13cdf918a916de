"""A teacher on its own layout, in this job: it scores the student's rows with its own TP/PP.

The student's data-parallel ranks each hold their own rollout rows; the teacher's replicas
(a different TP/PP, hence a different data-parallel size) each score an equal share of the whole
step batch, moved point to point (``parallel/exchange.py``): teacher replica ``d`` scores rows
``[d·N/dp_t, (d+1)·N/dp_t)`` with its forward-only schedule, its last stage shares the result
with the other stages of its pipeline, and each student rank receives its own rows back.

When the teacher has the student's layout, replica ``d`` of the teacher is replica ``d`` of the
student on the same ranks, and each rank scores its own rows with no exchange at all (this is
also what lets a full-vocabulary KL between the two meet on the same vocabulary shards).

Legend: n = rows of this student rank, N = rows of the step, S = padded positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, broadcast_scores, score_batch
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.exchange import rows_from_students, rows_to_students
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import Generator, SamplingParams
from megatron_gndpo.seeding import replica_seed


def _dense_images(
    images: list[torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows' tiles as one ``[n, T, 3, H, W]`` tensor (T: the most tiles of any row of the
    step, zero-filled) and the tile counts ``[n]``; None when no row of the step has images."""
    shapes = torch.zeros(4, dtype=torch.long, device=device)  # T, C, H, W
    for tiles in images:
        if tiles is not None and tiles.shape[0]:
            shapes = torch.maximum(shapes, torch.tensor([tiles.shape[0], *tiles.shape[1:]],
                                                        device=device))  # fmt: skip
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
    if int(shapes[0]) == 0:
        return None
    t, c, h, w = (int(x) for x in shapes)
    dense = torch.zeros(len(images), t, c, h, w, device=device)
    counts = torch.zeros(len(images), dtype=torch.long, device=device)
    for i, tiles in enumerate(images):
        if tiles is not None and tiles.shape[0]:
            dense[i, : tiles.shape[0]] = tiles.to(device, torch.float32)
            counts[i] = tiles.shape[0]
    return dense, counts


class LocalTeacher:
    """Scores the student's rows with the frozen teacher on the teacher's own groups
    (a :class:`~megatron_gndpo.teacher.base.Teacher`)."""

    def __init__(
        self,
        model: Any,
        groups: ParallelGroups,
        student_groups: ParallelGroups,
        *,
        head: TokenLogProbs,
        token_budget: int,
        pack: bool,
        generator: Generator | None = None,
        name: str = "teacher",
    ) -> None:
        self.name = name
        self.model = model
        self.groups = groups
        self.student_groups = student_groups
        self.head = head
        self.token_budget = token_budget
        self.pack = pack
        # the same layout: the same ranks hold the same rows and vocabulary shards
        self.same_layout = groups.layout == student_groups.layout
        self.generator = generator  # a MegatronGenerator on the teacher (TrOPD's guidance)

    def rows_multiple(self) -> int:
        """``m · dp_student`` rows must be a multiple of the teacher's data-parallel size."""
        if self.same_layout:
            return 1
        dp_s, dp_t = self.student_groups.layout.dp, self.groups.layout.dp
        return dp_t // math.gcd(dp_s, dp_t)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        images: list[PromptImages | None] | None = None,
    ) -> list[list[int]]:
        """The teacher's response (token ids, stop token included) to each of this rank's
        prompts, one sample each; replica ``d`` of the teacher generates share ``d`` of the step.
        ``images``: the prompts' images (a vision-language teacher).

        Prompts are short lists of ids, so they travel as Python objects (two all-gathers); so
        do their image tiles.
        """
        if self.generator is None:
            raise RuntimeError("this teacher was built without a generator (see teacher/build.py)")
        student_dp, teacher_dp = self.student_groups.dp, self.groups.dp
        if self.same_layout:
            return self._responses(prompts, params, seeds, images)
        parts: list[Any] = [None] * dist.get_world_size(student_dp)
        dist.all_gather_object(parts, (prompts, seeds, images), group=student_dp)
        all_prompts = [p for part in parts for p in part[0]]
        all_seeds = [x for part in parts for x in part[1]]
        all_images = None if images is None else [x for part in parts for x in part[2]]
        share = len(all_prompts) // self.groups.layout.dp
        d = self.groups.coords["dp"]
        mine = slice(d * share, (d + 1) * share)
        responses = self._responses(
            all_prompts[mine], params, all_seeds[mine],
            None if all_images is None else all_images[mine],
        )  # fmt: skip
        gathered: list[Any] = [None] * dist.get_world_size(teacher_dp)
        dist.all_gather_object(gathered, responses, group=teacher_dp)
        everything = [r for part in gathered for r in part]
        n, s = len(prompts), self.student_groups.coords["dp"]
        return everything[s * n : (s + 1) * n]

    def _responses(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        images: list[PromptImages | None] | None,
    ) -> list[list[int]]:
        assert self.generator is not None
        rollout = self.generator.generate(prompts, params, seeds=seeds, images=images)
        return [
            rollout.tokens[i, int(rollout.prompt_lengths[i]) : int(n)].tolist()
            for i, n in enumerate(rollout.lengths)
        ]

    def score(self, tokens_nS: torch.Tensor, lengths_n: torch.Tensor) -> torch.Tensor:
        """Teacher log-probs ``[n, S]`` (scoring convention) of this rank's rows."""
        return self.score_batch(tokens_nS, lengths_n).logprobs

    def score_batch(
        self,
        tokens_nS: torch.Tensor,
        lengths_n: torch.Tensor,
        request: ScoreRequest | None = None,
        images: list[torch.Tensor | None] | None = None,
    ) -> Scores:
        """:func:`score_batch`'s :class:`Scores` of this rank's rows (``[n, S]`` /
        ``[n, S, K]``); ``images``: each row's image tiles, for a vision-language teacher."""
        # The exchange runs on the model's device: on GPUs the step batch travels over NCCL.
        device = next(self.model.parameters()).device
        if request is not None and request.sample_seed is not None:
            # one stream per teacher replica: the ranks of a replica draw alike, replicas differ
            seed = replica_seed(request.sample_seed, self.groups.coords["dp"])
            request = dataclasses.replace(request, sample_seed=seed)
        if self.same_layout:  # teacher replica d is student replica d: nothing to exchange
            mine = score_batch(
                self.model, self.groups, tokens_nS, lengths_n, head=self.head,
                token_budget=self.token_budget, pack=self.pack, request=request, images=images,
            )  # fmt: skip
            template = (request or ScoreRequest()).template(*tokens_nS.shape)
            return broadcast_scores(mine, template, self.groups, device).to(tokens_nS.device)
        if request is not None and request.full_kl:
            raise ValueError(
                "a full-vocabulary KL needs the teacher on the student's layout (the same "
                "tensor, pipeline and context parallel sizes); set teacher.parallel to match"
            )
        n, width_n = tokens_nS.shape
        width_t = torch.tensor([width_n], device=device)
        dist.all_reduce(width_t, op=dist.ReduceOp.MAX)  # one padded width for the whole world
        width = int(width_t)
        padded = torch.zeros(n, width, dtype=tokens_nS.dtype, device=device)
        padded[:, :width_n] = tokens_nS
        # Each teacher rank receives its share of the step's rows, point to point.
        share = n * self.student_groups.layout.dp // self.groups.layout.dp
        layout = self.student_groups.layout

        def to_teacher(x: torch.Tensor) -> torch.Tensor:
            return rows_from_students(x, share, self.groups, layout)

        mine_tokens = to_teacher(padded)
        mine_lengths = to_teacher(lengths_n.to(device).view(n, 1)).view(share)
        mine_request = None
        if request is not None:
            extra_rows = None
            if request.extra_ids is not None:
                extra = torch.zeros(
                    n, width, request.extra_ids.shape[-1], dtype=torch.long, device=device
                )
                extra[:, :width_n] = request.extra_ids
                extra_rows = to_teacher(extra)
            mine_request = dataclasses.replace(request, extra_ids=extra_rows)
        mine_images: list[torch.Tensor | None] | None = None
        dense = None if images is None else _dense_images(images, device)
        if images is not None:
            mine_images = [None] * share
        if dense is not None:  # image tiles as one zero-filled tensor, with the counts
            tiles, counts = to_teacher(dense[0]), to_teacher(dense[1].view(n, 1)).view(share)
            mine_images = [
                tiles[i, : int(c)] if int(c) else None for i, c in enumerate(counts.tolist())
            ]
        mine = score_batch(
            self.model, self.groups, mine_tokens, mine_lengths, head=self.head,
            token_budget=self.token_budget, pack=self.pack, request=mine_request,
            images=mine_images,
        )  # fmt: skip
        template = (mine_request or ScoreRequest()).template(share, width)
        shares = broadcast_scores(mine, template, self.groups, device)

        def to_students(share_rows: torch.Tensor) -> torch.Tensor:
            rows = rows_to_students(share_rows, n, self.groups, self.student_groups.layout)
            return rows[:, :width_n].to(tokens_nS.device)

        return shares.map(to_students)  # every rank moves the same fields, in field order
