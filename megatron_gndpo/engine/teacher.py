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
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.engine.scoring import ScoreRequest, broadcast_scores, score_batch
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups, ParallelLayout
from megatron_gndpo.rollout.base import Generator, SamplingParams


def _members(layout: ParallelLayout, world: int) -> dict[int, list[int]]:
    """Global ranks of each data-parallel replica of ``layout``, by replica, in rank order."""
    out: dict[int, list[int]] = {}
    for rank in range(world):
        out.setdefault(layout.coords(rank)["dp"], []).append(rank)
    return out


def rows_from_students(
    rows: torch.Tensor, share: int, groups: ParallelGroups, student_layout: ParallelLayout
) -> torch.Tensor:
    """This teacher rank's ``share`` rows ``[share, ...]`` of the step, from the student ranks.

    The inverse of :func:`rows_to_students`: the student rank with data-parallel coordinate
    ``s`` holds rows ``[s * n, (s + 1) * n)`` in ``rows [n, ...]`` (every rank of a student
    replica holds the same rows); teacher replica ``d`` (``groups``) scores rows
    ``[d * share, (d + 1) * share)``. Point to point over the world: teacher rank ``j`` of its
    replica takes each block from member ``j mod size`` of the student replica holding it, so
    the sends spread over the student replica's ranks and a rank receives only its rows (not
    the step's, as an all-gather would, images included). Every rank calls it.
    """
    n, world, me = rows.shape[0], dist.get_world_size(), dist.get_rank()
    students, teachers = _members(student_layout, world), _members(groups.layout, world)

    def needed(rank: int) -> tuple[int, int]:  # the rows a teacher rank scores
        d = groups.layout.coords(rank)["dp"]
        return d * share, (d + 1) * share

    def source(rank: int, s: int) -> int:  # the student rank that sends block s to ``rank``
        replica = teachers[groups.layout.coords(rank)["dp"]]
        return students[s][replica.index(rank) % len(students[s])]

    out = torch.empty((share, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    want, mine = needed(me), student_layout.coords(me)["dp"]
    ops = []
    for s in students:  # receive
        lo, hi = max(want[0], s * n), min(want[1], (s + 1) * n)
        if lo >= hi:
            continue
        into = out[lo - want[0] : hi - want[0]]
        if source(me, s) == me:
            into.copy_(rows[lo - s * n : hi - s * n])
        else:
            ops.append(dist.P2POp(dist.irecv, into, source(me, s)))
    for peer in range(world):  # send my block to the teacher ranks that take it from me
        lo, hi = max(needed(peer)[0], mine * n), min(needed(peer)[1], (mine + 1) * n)
        if peer != me and lo < hi and source(peer, mine) == me:
            part = rows[lo - mine * n : hi - mine * n].contiguous()
            ops.append(dist.P2POp(dist.isend, part, peer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
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


def rows_to_students(
    share_rows: torch.Tensor, n: int, groups: ParallelGroups, student_layout: ParallelLayout
) -> torch.Tensor:
    """This rank's ``n`` student rows ``[n, ...]``, from the teacher replicas' shares.

    Teacher replica ``d`` (``groups``) holds rows ``[d * share, (d + 1) * share)`` of the step in
    ``share_rows``; the student rank with data-parallel coordinate ``s`` (``student_layout``)
    scores rows ``[s * n, (s + 1) * n)``. Over the teacher's DP group (one rank of every replica,
    so every share) each member sends each other member only the rows of its share that member
    needs, point to point: a rank receives its ``n`` rows, not the step's (an all-gather would
    move ``N x S x K`` values to every rank for top-k outputs). Every rank calls it.
    """
    share = share_rows.shape[0]
    me = dist.get_rank()

    def held(rank: int) -> tuple[int, int]:  # the rows of the share a teacher rank holds
        d = groups.layout.coords(rank)["dp"]
        return d * share, (d + 1) * share

    def needed(rank: int) -> tuple[int, int]:  # the rows a student rank scores
        s = student_layout.coords(rank)["dp"]
        return s * n, (s + 1) * n

    out = torch.empty((n, *share_rows.shape[1:]), dtype=share_rows.dtype, device=share_rows.device)
    mine, want = held(me), needed(me)
    ops = []
    for peer in dist.get_process_group_ranks(groups.dp):
        theirs, their_want = held(peer), needed(peer)
        lo, hi = max(theirs[0], want[0]), min(theirs[1], want[1])  # peer -> me
        if peer == me:
            if lo < hi:
                out[lo - want[0] : hi - want[0]] = share_rows[lo - mine[0] : hi - mine[0]]
            continue
        if lo < hi:
            ops.append(dist.P2POp(dist.irecv, out[lo - want[0] : hi - want[0]], peer))
        lo, hi = max(mine[0], their_want[0]), min(mine[1], their_want[1])  # me -> peer
        if lo < hi:
            part = share_rows[lo - mine[0] : hi - mine[0]].contiguous()
            ops.append(dist.P2POp(dist.isend, part, peer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return out


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
        return self.score_batch(tokens_nS, lengths_n)["logprobs"]

    def score_batch(
        self,
        tokens_nS: torch.Tensor,
        lengths_n: torch.Tensor,
        request: ScoreRequest | None = None,
        images: list[torch.Tensor | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """:func:`score_batch` outputs of this rank's rows (``[n, S]`` / ``[n, S, K]``);
        ``images``: each row's image tiles, for a vision-language teacher."""
        # The exchange runs on the model's device: on GPUs the step batch travels over NCCL.
        device = next(self.model.parameters()).device
        if request is not None and request.sample_seed is not None:
            # one stream per teacher replica: the ranks of a replica draw alike, replicas differ
            seed = request.sample_seed * 10_007 + self.groups.coords["dp"]
            request = dataclasses.replace(request, sample_seed=seed)
        if self.same_layout:  # teacher replica d is student replica d: nothing to exchange
            mine = score_batch(
                self.model, self.groups, tokens_nS, lengths_n, head=self.head,
                token_budget=self.token_budget, pack=self.pack, request=request, images=images,
            )  # fmt: skip
            specs = (request or ScoreRequest()).specs(*tokens_nS.shape)
            scores = broadcast_scores(mine, specs, self.groups, device)
            return {key: value.to(tokens_nS.device) for key, value in scores.items()}
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
        specs = (mine_request or ScoreRequest()).specs(share, width)
        mine = broadcast_scores(mine, specs, self.groups, device)

        return {
            key: rows_to_students(value, n, self.groups, self.student_groups.layout)[
                :, :width_n
            ].to(tokens_nS.device)
            for key, value in mine.items()
        }
