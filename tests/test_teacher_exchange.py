"""Rows travel between the student's and the teacher's data-parallel layouts point to point:
the step's rows to the teacher's shares (``rows_from_students``) and the teacher's outputs back
(``rows_to_students``).

One 4-rank launch (gloo), no models: teacher replica ``d`` holds rows ``[d*share, (d+1)*share)``
of the step as ``[share, S, K]`` values that name their own row; every rank must get exactly the
rows its student data-parallel rank scores, for teacher/student layouts whose data-parallel sizes
are equal, larger and smaller, with tensor and pipeline parallelism on either side.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

N, S, K = 8, 3, 2  # rows of the step, width, values per position
# (student tp, pp) and (teacher tp, pp) on 4 ranks: student DP 4/2/1/2, teacher DP 2/4/2/1
PAIRS = {
    "student dp4 / teacher tp2": ((1, 1), (2, 1)),
    "student tp2 / teacher dp4": ((2, 1), (1, 1)),
    "student tp4 / teacher pp2": ((4, 1), (1, 2)),
    "student pp2 / teacher tp2 pp2": ((1, 2), (2, 2)),
}


def _exchange(rank: int, world: int) -> dict[str, object]:
    from megatron_gndpo.parallel.exchange import rows_from_students, rows_to_students
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups

    out: dict[str, object] = {}
    for name, ((stp, spp), (ttp, tpp)) in PAIRS.items():
        student = ParallelLayout(world, tp=stp, pp=spp)
        teacher = build_groups(ParallelLayout(world, tp=ttp, pp=tpp), name=name)
        share, d = N // teacher.layout.dp, teacher.coords["dp"]
        rows = torch.arange(d * share, (d + 1) * share)
        values = rows.view(-1, 1, 1).expand(share, S, K) * 100 + torch.arange(S * K).view(S, K)
        n = N // student.dp
        got = rows_to_students(values.float(), n, teacher, student)
        ids = rows_to_students(rows.view(-1, 1), n, teacher, student)  # int64, [share, 1]
        # and the other way: the student ranks' rows to the teacher's shares
        s = student.coords(rank)["dp"]
        held = torch.arange(s * n, (s + 1) * n)
        inbound = rows_from_students(held.view(-1, 1, 1).expand(n, 2, 3).float(), share,
                                     teacher, student)  # fmt: skip
        out[name] = (
            s,
            n,
            got,
            ids,
            d,
            share,
            inbound,
            _images_to_teacher(n, share, teacher, student),
        )
    return out


def _row_tiles(row: int) -> torch.Tensor | None:
    """Row ``row``'s image tiles: none for every third row, else 1-3 tiles that name the row."""
    count = row % 3
    return (
        torch.full((count, 3, 2, 2), float(row)) + torch.arange(count).view(-1, 1, 1, 1)
        if count
        else None
    )


def _images_to_teacher(n, share, teacher, student) -> bool:  # type: ignore[no-untyped-def]
    """The trainer's image path: tiles made dense, moved, and cut back per row."""
    from megatron_gndpo.parallel.exchange import rows_from_students
    from megatron_gndpo.teacher.local import _dense_images

    s, d = student.coords(torch.distributed.get_rank())["dp"], teacher.coords["dp"]
    dense = _dense_images([_row_tiles(r) for r in range(s * n, (s + 1) * n)], torch.device("cpu"))
    assert dense is not None
    tiles = rows_from_students(dense[0], share, teacher, student)
    counts = rows_from_students(dense[1].view(n, 1), share, teacher, student).view(share)
    for i, row in enumerate(range(d * share, (d + 1) * share)):
        want = _row_tiles(row)
        if (want is None) != (int(counts[i]) == 0):
            return False
        if want is not None and not torch.equal(tiles[i, : int(counts[i])], want):
            return False
    return True


@pytest.mark.distributed
def test_each_rank_receives_exactly_its_rows() -> None:
    for rank, result in enumerate(run_distributed(_exchange, 4, timeout_s=120)):
        for name, (s, n, got, ids, d, share, inbound, images) in result.items():  # type: ignore[misc]
            assert images, (rank, name, "image tiles to the teacher")
            want = torch.arange(s * n, (s + 1) * n)
            assert ids.view(-1).tolist() == want.tolist(), (rank, name)
            expected = want.view(-1, 1, 1) * 100 + torch.arange(S * K).view(S, K)
            assert got.shape == (n, S, K) and torch.equal(got, expected.float()), (rank, name)
            shared = torch.arange(d * share, (d + 1) * share).view(-1, 1, 1).expand(share, 2, 3)
            assert torch.equal(inbound, shared.float()), (rank, name, "to the teacher")
