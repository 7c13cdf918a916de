"""Rows of a step batch moved between two data-parallel layouts, point to point.

A teacher with its own TP/PP has its own data-parallel size: the student rank with DP
coordinate ``s`` holds rows ``[s·n, (s+1)·n)`` of the step, teacher replica ``d`` scores rows
``[d·share, (d+1)·share)``. :func:`rows_from_students` brings each teacher rank its share,
:func:`rows_to_students` the results back; a rank receives only its rows, never the whole step
(an all-gather would move ``N x S x K`` values to every rank for top-k outputs). Every rank of
the job calls each of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_gndpo.parallel.groups import ParallelGroups, ParallelLayout

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
