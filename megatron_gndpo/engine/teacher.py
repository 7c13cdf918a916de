"""Teacher scoring on the teacher's own layout, for the student's rows.

The student's data-parallel ranks each hold their own rollout rows; the teacher's replicas
(a different TP/PP, hence a different data-parallel size) each score an equal share of the whole
step batch. Token ids are small, so the exchange is two all-gathers of ids and one of
log-probs:

1. every rank gathers the step batch over the student's data-parallel group (in student-DP order);
2. teacher replica ``d`` scores rows ``[d·N/dp_t, (d+1)·N/dp_t)`` with its forward-only schedule;
   its last stage shares the result with the other stages of its pipeline;
3. the teacher's data-parallel group gathers the shares, and each rank keeps its student rows.

When the teacher has the student's layout, replica ``d`` of the teacher is replica ``d`` of the
student on the same ranks, and each rank scores its own rows with no exchange at all (this is
also what lets a full-vocabulary KL between the two meet on the same vocabulary shards).

Legend: n = rows of this student rank, N = rows of the step, S = padded positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.engine.scoring import ScoreRequest, Scores, broadcast_scores, score_batch
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups, ParallelLayout
from megatron_gndpo.rollout.base import Generator, SamplingParams
from megatron_gndpo.seeding import replica_seed

# A block of rows one rank receives: (sending rank, first global row, end global row).
_Block = tuple[int, int, int]


def _move_rows(
    rows: torch.Tensor,
    held: Callable[[int], tuple[int, int]],
    wanted: Callable[[int], tuple[int, int]],
    blocks: Callable[[int], list[_Block]],
) -> torch.Tensor:
    """Rows between two data-parallel layouts, point to point; every rank calls it.

    ``rows`` are the global rows ``held(me)``; the result the rows ``wanted(me)``, assembled from
    ``blocks(me)``. A rank sends every other rank the blocks that name it as the sender (a copy
    for its own), so each rank receives only its rows, never the whole step.
    """
    me, world = dist.get_rank(), dist.get_world_size()
    mine, want = held(me), wanted(me)
    out = torch.empty((want[1] - want[0], *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    ops = []
    for src, lo, hi in blocks(me):
        into = out[lo - want[0] : hi - want[0]]
        if src == me:
            into.copy_(rows[lo - mine[0] : hi - mine[0]])
        else:
            ops.append(dist.P2POp(dist.irecv, into, src))
    for peer in range(world):
        for src, lo, hi in blocks(peer) if peer != me else ():
            if src == me:
                part = rows[lo - mine[0] : hi - mine[0]].contiguous()
                ops.append(dist.P2POp(dist.isend, part, peer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return out


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def rows_from_students(
    rows: torch.Tensor, share: int, groups: ParallelGroups, student_layout: ParallelLayout
) -> torch.Tensor:
    """This teacher rank's ``share`` rows ``[share, ...]`` of the step, from the student ranks.

    The inverse of :func:`rows_to_students`: the student rank with data-parallel coordinate
    ``s`` holds rows ``[s * n, (s + 1) * n)`` in ``rows [n, ...]`` (every rank of a student
    replica holds the same rows); teacher replica ``d`` (``groups``) scores rows
    ``[d * share, (d + 1) * share)``. Teacher rank ``j`` of its replica takes each block from
    member ``j mod size`` of the student replica holding it, so the sends spread over the
    student replica's ranks and a rank receives only its rows (not the step's, as an all-gather
    would, images included). Every rank calls it.
    """
    n, teacher = rows.shape[0], groups.layout
    students, teachers = _replicas(student_layout), _replicas(teacher)

    def held(rank: int) -> tuple[int, int]:
        s = student_layout.coords(rank)["dp"]
        return s * n, (s + 1) * n

    def wanted(rank: int) -> tuple[int, int]:
        d = teacher.coords(rank)["dp"]
        return d * share, (d + 1) * share

    def blocks(rank: int) -> list[_Block]:
        j = teachers[teacher.coords(rank)["dp"]].index(rank)
        out = []
        for s, members in students.items():
            span = _overlap(wanted(rank), (s * n, (s + 1) * n))
            if span is not None:
                out.append((members[j % len(members)], *span))
        return out

    return _move_rows(rows, held, wanted, blocks)


def rows_to_students(
    share_rows: torch.Tensor, n: int, groups: ParallelGroups, student_layout: ParallelLayout
) -> torch.Tensor:
    """This rank's ``n`` student rows ``[n, ...]``, from the teacher replicas' shares.

    Teacher replica ``d`` (``groups``) holds rows ``[d * share, (d + 1) * share)`` of the step in
    ``share_rows``; the student rank with data-parallel coordinate ``s`` (``student_layout``)
    scores rows ``[s * n, (s + 1) * n)`` and takes them from the members of its own teacher DP
    group (one rank of every replica, so every share): a rank receives its ``n`` rows, not the
    step's (an all-gather would move ``N x S x K`` values to every rank for top-k outputs).
    Every rank calls it.
    """
    share, teacher = share_rows.shape[0], groups.layout
    dp_groups = {rank: members for members in teacher.groups(("dp",)) for rank in members}

    def held(rank: int) -> tuple[int, int]:
        d = teacher.coords(rank)["dp"]
        return d * share, (d + 1) * share

    def wanted(rank: int) -> tuple[int, int]:
        s = student_layout.coords(rank)["dp"]
        return s * n, (s + 1) * n

    def blocks(rank: int) -> list[_Block]:
        out = []
        for peer in dp_groups[rank]:
            span = _overlap(held(peer), wanted(rank))
            if span is not None:
                out.append((peer, *span))
        return out

    return _move_rows(share_rows, held, wanted, blocks)


def _replicas(layout: ParallelLayout) -> dict[int, list[int]]:
    """Global ranks of each data-parallel replica of ``layout``, by replica, in rank order."""
    out: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        out.setdefault(layout.coords(rank)["dp"], []).append(rank)
    return out


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


class TeacherScorer:
    """Scores the student's rows with the frozen teacher on the teacher's own groups."""

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
    ) -> None:
        self.model = model
        self.groups = groups
        self.student_groups = student_groups
        self.head = head
        self.token_budget = token_budget
        self.pack = pack
        # the same layout: the same ranks hold the same rows and vocabulary shards
        self.same_layout = groups.layout == student_groups.layout
        self.generator = generator  # a MegatronGenerator on the teacher (TrOPD's guidance)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        *,
        images: list[PromptImages | None] | None = None,
    ) -> list[list[int]]:
        """The teacher's response (token ids, stop token included) to each of this rank's
        prompts, one sample each; replica ``d`` of the teacher generates share ``d`` of the step.
        ``images``: the prompts' images (a vision-language teacher).

        Prompts are short lists of ids, so they travel as Python objects (two all-gathers); so
        do their image tiles.
        """
        if self.generator is None:
            raise RuntimeError("this teacher was built without a generator (see engine/setup.py)")
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
