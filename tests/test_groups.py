"""Parallel layouts and their process groups.

The pure :class:`ParallelLayout` arithmetic is checked against megatron-core's own
``RankGenerator`` (which ``initialize_model_parallel`` uses), for shapes up to 256 ranks. One
4-rank gloo launch then builds the student's groups (megatron's global state) and a teacher's
groups of another layout on the same world, and checks membership and collectives.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_gndpo.parallel.groups import ORDER, ParallelGroups, ParallelLayout
from tests.harness import run_distributed

# (world, tp, pp, cp)
SHAPES = [
    (1, 1, 1, 1),
    (2, 2, 1, 1),
    (4, 1, 2, 1),
    (8, 2, 2, 1),
    (8, 1, 1, 2),
    (16, 2, 2, 2),
    (24, 2, 3, 1),
    (32, 4, 2, 1),
    (48, 2, 2, 3),
    (64, 8, 2, 1),
    (256, 8, 4, 1),
    (256, 4, 4, 2),
    (256, 1, 8, 4),
]

# megatron's token -> our dims
TOKENS = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "cp": ("cp",),
    "dp-cp": ("cp", "dp"),
    "tp-pp": ("tp", "pp"),
    "tp-cp": ("tp", "cp"),
    "tp-dp-cp": ("tp", "cp", "dp"),
}


# --------------------------------------------------------------------------------------------
# Pure layout arithmetic


@pytest.mark.parametrize(("field", "value"), [("world_size", 0), ("tp", 0), ("pp", -1), ("cp", 0)])
def test_sizes_below_one_are_rejected(field: str, value: int) -> None:
    sizes = {"world_size": 4, "tp": 1, "pp": 1, "cp": 1} | {field: value}
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got {value}"):
        ParallelLayout(**sizes)


def test_product_not_dividing_the_world_names_the_fix() -> None:
    with pytest.raises(ValueError) as err:
        ParallelLayout(world_size=8, tp=3)
    msg = str(err.value)
    assert "tensor_parallel (3) x pipeline_parallel (1) x context_parallel (1) = 3" in msg
    assert "does not divide the world size 8" in msg
    assert "choose sizes whose product divides it" in msg
    with pytest.raises(ValueError, match="= 16 does not divide the world size 8"):
        ParallelLayout(world_size=8, tp=2, pp=2, cp=4)


def test_data_parallel_size_is_what_remains() -> None:
    layout = ParallelLayout(world_size=48, tp=2, pp=2, cp=3)
    assert layout.dp == 4
    assert layout.sizes == {"tp": 2, "cp": 3, "dp": 4, "pp": 2}
    assert layout.describe() == "TP=2 PP=2 CP=3 DP=4 (world 48)"


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), SHAPES)
def test_coords_and_rank_of_round_trip(world: int, tp: int, pp: int, cp: int) -> None:
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp)
    seen = set()
    for rank in range(world):
        coords = layout.coords(rank)
        assert all(0 <= coords[d] < layout.sizes[d] for d in ORDER)
        assert layout.rank_of(coords) == rank
        seen.add(tuple(coords[d] for d in ORDER))
    assert len(seen) == world  # a bijection


def test_tp_varies_fastest_and_pp_slowest() -> None:
    layout = ParallelLayout(16, tp=2, pp=2, cp=2)  # dp = 2
    assert layout.coords(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert layout.coords(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert layout.coords(4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert layout.coords(8) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1}


def test_rank_outside_the_world_and_unknown_dims_are_errors() -> None:
    layout = ParallelLayout(8, tp=2)
    for rank in (-1, 8):
        with pytest.raises(ValueError, match=f"rank {rank} is outside a world of 8"):
            layout.coords(rank)
    with pytest.raises(ValueError, match=r"unknown parallel dimension\(s\) \['xp'\]"):
        layout.groups(("tp", "xp"))
    with pytest.raises(ValueError, match="mix the dense grid"):
        layout.groups(("tp", "ep"))


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), SHAPES)
def test_groups_partition_the_world(world: int, tp: int, pp: int, cp: int) -> None:
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp)
    for n in range(1, len(ORDER) + 1):
        for dims in itertools.combinations(ORDER, n):
            groups = layout.groups(dims)
            size = 1
            for d in dims:
                size *= layout.sizes[d]
            assert all(len(g) == size for g in groups), dims
            assert sorted(r for g in groups for r in g) == list(range(world)), dims
            # Members of one group differ only along dims.
            for g in groups:
                fixed = [{d: layout.coords(r)[d] for d in ORDER if d not in dims} for r in g]
                assert all(f == fixed[0] for f in fixed), (dims, g)
            # group_of finds each rank's own group
            for g in groups[:3]:
                assert layout.group_of(g[-1], dims) == g


@pytest.mark.megatron
@pytest.mark.parametrize(("world", "tp", "pp", "cp"), SHAPES)
def test_groups_equal_megatron_rank_generator(world: int, tp: int, pp: int, cp: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp)
    generator = RankGenerator(
        tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp", rank_offset=0
    )
    for token, dims in TOKENS.items():
        theirs = sorted(sorted(g) for g in generator.get_ranks(token))
        assert layout.groups(dims) == theirs, token


# --------------------------------------------------------------------------------------------
# Process groups on 4 gloo ranks

# ParallelGroups field -> the dimensions its ranks differ along
FIELD_DIMS = {
    "tp": ("tp",),
    "pp": ("pp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),  # the group that owns distinct tokens (GNDPO statistics)
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp_cp": ("tp", "cp", "dp"),  # megatron's routers average their z-loss over it
}


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _membership(groups: ParallelGroups, rank: int) -> dict[str, list[int]]:
    """Each group's members, asserted equal to the layout arithmetic's on this rank."""
    out = {}
    for field, dims in FIELD_DIMS.items():
        out[field] = _ranks(getattr(groups, field))
        assert out[field] == groups.layout.group_of(rank, dims), (groups.name, field)
    return out


def _dp_cp_sum(group: dist.ProcessGroup, rank: int) -> int:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _groups_body(rank: int, world_size: int) -> dict[str, object]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_gndpo.parallel.groups import build_groups, build_student_groups

    student_layout = ParallelLayout(world_size, tp=2)  # dp = 2
    teacher_layout = ParallelLayout(world_size, tp=1, pp=2)  # dp = 2
    student = build_student_groups(student_layout)
    teacher = build_groups(teacher_layout, name="teacher")
    out: dict[str, object] = {
        "names": (student.name, teacher.name),
        "student": _membership(student, rank),
        "teacher": _membership(teacher, rank),
        # Stage groups: the teacher's first and last stages share the tied embedding.
        "teacher_embd": _ranks(teacher.embd),
        "teacher_pos_embd": None if teacher.pos_embd is None else _ranks(teacher.pos_embd),
        "teacher_stage": (teacher.is_first_stage, teacher.is_last_stage),
        "student_stage": (student.is_first_stage, student.is_last_stage),
        "student_sum": _dp_cp_sum(student.dp_cp, rank),
        "teacher_sum": _dp_cp_sum(teacher.dp_cp, rank),
    }
    for name, groups in (("student", student), ("teacher", teacher)):
        pgs = groups.pg_collection()
        assert isinstance(pgs, ProcessGroupCollection)
        fields = ("tp", "pp", "dp", "dp_cp", "tp_dp_cp")
        out[f"{name}_pgs"] = {f: _ranks(getattr(pgs, f)) for f in fields}

    try:
        build_groups(ParallelLayout(2 * world_size, tp=2), name="wrong")
    except ValueError as err:
        out["wrong_world"] = str(err)
    try:
        build_student_groups(student_layout)
    except RuntimeError as err:
        out["twice"] = str(err)
    dist.barrier()  # every rank took the same path: no collective is left half-called
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_student_and_teacher_groups_on_one_world() -> None:
    results = run_distributed(_groups_body, world_size=4, timeout_s=120)
    student_layout = ParallelLayout(4, tp=2)
    teacher_layout = ParallelLayout(4, tp=1, pp=2)
    for rank, r in enumerate(results):
        assert r["names"] == ("student", "teacher")
        # membership was compared with the layout inside each rank; spot-check the shapes
        assert r["student"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["teacher"]["pp"] == [rank % 2, rank % 2 + 2]
        # dp_cp all-reduce of the rank number: student dp_cp groups [0,2],[1,3];
        # teacher dp_cp groups [0,1],[2,3].
        assert r["student_sum"] == sum(student_layout.group_of(rank, ("cp", "dp")))
        assert r["student_sum"] == [2, 4, 2, 4][rank]
        assert r["teacher_sum"] == [1, 1, 5, 5][rank]
        assert r["teacher_embd"] == ([0, 2] if rank in (0, 2) else [1, 3])
        assert r["teacher_pos_embd"] == ([rank] if rank < 2 else None)
        assert r["teacher_stage"] == (rank < 2, rank >= 2)
        assert r["student_stage"] == (True, True)
        for name, layout in (("student", student_layout), ("teacher", teacher_layout)):
            pgs = r[f"{name}_pgs"]
            assert pgs["tp"] == layout.group_of(rank, ("tp",))
            assert pgs["pp"] == layout.group_of(rank, ("pp",))
            assert pgs["dp"] == layout.group_of(rank, ("dp",))
            assert pgs["tp_dp_cp"] == layout.group_of(rank, ("tp", "cp", "dp"))
            assert pgs["dp_cp"] == layout.group_of(rank, ("cp", "dp"))
        assert "is for 8 ranks but 4 were started" in r["wrong_world"]
        assert "launch 8 processes" in r["wrong_world"]
        assert "already initialised" in r["twice"]
        assert "build the student's groups once per process" in r["twice"]


def test_building_groups_without_torch_distributed_is_a_clear_error() -> None:
    from megatron_gndpo.parallel.groups import build_groups

    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(RuntimeError, match=r"call .*init_distributed"):
        build_groups(ParallelLayout(1))
