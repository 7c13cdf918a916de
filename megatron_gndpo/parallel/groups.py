"""Parallel layouts and their process groups, built once and passed down as values.

A :class:`ParallelLayout` is pure arithmetic (no process group): the sizes of the tensor (TP),
context (CP), data (DP) and pipeline (PP) dimensions and which ranks share each group, in
megatron-core's default rank order ``tp-cp-dp-pp`` (TP varies fastest, so a TP group sits on
neighbouring GPUs of one node). ``plan`` uses it for any world size without starting anything.

:class:`ParallelGroups` holds the torch process groups of one layout for this rank. The student
and the teacher each get one, on the same world, with their own TP/PP:

- :func:`build_student_groups` initialises megatron-core's global ``parallel_state`` (which its
  schedules, DDP, optimizer and RNG tracker read) and wraps those groups;
- :func:`build_groups` builds any further layout (the teacher's) with megatron-core's
  ``HyperCommGrid``, without touching global state; models receive it as a
  ``ProcessGroupCollection`` (``groups.pg_collection()``).

Every rank must build the same layouts in the same order (group creation is collective).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_gndpo.parallel.distributed import collective_timeout

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

# megatron-core's default order with the (unused, size 1) expert dimension left out.
ORDER: tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the parallel dimensions for one model over ``world_size`` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ValueError(
                f"tensor_parallel ({self.tp}) x pipeline_parallel ({self.pp}) x "
                f"context_parallel ({self.cp}) = {model_parallel} does not divide the world "
                f"size {self.world_size}; choose sizes whose product divides it (data-parallel "
                "size = world_size / product)"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp * pp * cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (tp varies fastest, pp slowest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out = {}
        for dim in ORDER:
            out[dim] = rank % self.sizes[dim]
            rank //= self.sizes[dim]
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for dim in ORDER:
            rank += coords[dim] * stride
            stride *= self.sizes[dim]
        return rank

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """All groups spanning ``dims`` (e.g. ``("dp", "cp")``): ranks that differ only there."""
        unknown = set(dims) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}; use {ORDER}")
        inner = [d for d in ORDER if d in dims]
        outer = [d for d in ORDER if d not in dims]
        result = []
        for fixed in itertools.product(*(range(self.sizes[d]) for d in reversed(outer))):
            base = dict(zip(reversed(outer), fixed, strict=True))
            members = []
            for varying in itertools.product(*(range(self.sizes[d]) for d in reversed(inner))):
                coords = base | dict(zip(reversed(inner), varying, strict=True))
                members.append(self.rank_of(coords))
            result.append(sorted(members))
        return sorted(result)

    def group_of(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        for members in self.groups(dims):
            if rank in members:
                return members
        raise AssertionError("unreachable: every rank is in exactly one group")

    def describe(self) -> str:
        return f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp} (world {self.world_size})"


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups for one layout.

    ``dp_cp`` is the group that owns distinct tokens: the GNDPO statistics and the global token
    count are all-reduced over it, never over ``tp`` (whose ranks hold identical tokens).
    ``embd`` joins the first and last pipeline stages (tied embeddings); ``pos_embd`` is the first
    stage alone.
    """

    name: str
    layout: ParallelLayout
    rank: int
    tp: Any
    pp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    mp: Any
    embd: Any
    pos_embd: Any
    tp_cp: Any

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    def pg_collection(self) -> ProcessGroupCollection:
        """The groups as megatron-core's ``ProcessGroupCollection`` (for models, DDP, schedules)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        for field in ("tp", "pp", "cp", "dp", "dp_cp", "mp", "embd", "pos_embd", "tp_cp"):
            setattr(pgs, field, getattr(self, field))
        # Dense models: expert groups collapse onto the dense ones.
        pgs.ep = _single_rank_group(self)
        pgs.expt_tp = self.tp
        pgs.tp_ep = self.tp
        pgs.tp_ep_pp = self.mp
        pgs.expt_dp = self.dp
        pgs.intra_dp_cp = self.dp_cp
        pgs.intra_expt_dp = self.dp
        return pgs


def _single_rank_group(groups: ParallelGroups) -> Any:
    # The expert-parallel group of a dense model is each rank alone; megatron-core's global
    # state holds one, and the collection needs a value there.
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_expert_model_parallel_group()
    return None


def _check_world(layout: ParallelLayout) -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "megatron_gndpo.parallel.distributed.init_distributed() first"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the layout {layout.describe()} is for {layout.world_size} ranks but "
            f"{dist.get_world_size()} were started; launch {layout.world_size} processes or "
            "change the parallel sizes"
        )
    return dist.get_rank()


def _new_groups(layout: ParallelLayout, rank: int, dims: tuple[str, ...]) -> Any:
    # Collective: every rank enumerates every group of these dims in the same order.
    mine, _ = dist.new_subgroups_by_enumeration(layout.groups(dims), timeout=collective_timeout())
    return mine


def _stage_groups(layout: ParallelLayout, rank: int) -> tuple[Any, Any]:
    """Embedding groups: first+last stage of each pipeline (tied weights), first stage alone."""
    embd_mine = pos_mine = None
    for pipeline in layout.groups(("pp",)):
        first, last = pipeline[0], pipeline[-1]
        embd_ranks = [first, last] if first != last else [first]
        embd = dist.new_group(embd_ranks, timeout=collective_timeout())
        pos = dist.new_group([first], timeout=collective_timeout())
        if rank in embd_ranks:
            embd_mine = embd
        if rank == first:
            pos_mine = pos
    return embd_mine, pos_mine


def build_groups(layout: ParallelLayout, *, name: str = "teacher") -> ParallelGroups:
    """Build a layout's groups on the current world without touching megatron's global state."""
    rank = _check_world(layout)
    made = {dims: _new_groups(layout, rank, dims) for dims in _GROUP_DIMS.values()}
    embd, pos_embd = _stage_groups(layout, rank)
    return ParallelGroups(
        name=name,
        layout=layout,
        rank=rank,
        embd=embd,
        pos_embd=pos_embd,
        **{field: made[dims] for field, dims in _GROUP_DIMS.items()},
    )


_GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
}


def build_student_groups(layout: ParallelLayout, *, seed: int | None = None) -> ParallelGroups:
    """Initialise megatron-core's global parallel state for the student and wrap its groups.

    megatron-core's schedules, DDP, optimizer and RNG tracker read the global state, so the model
    that trains owns it. With ``seed`` set, megatron's model-parallel RNG tracker is seeded too
    (every forward enters it, even with dropout 0).
    """
    from megatron.core import parallel_state, tensor_parallel

    rank = _check_world(layout)
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron-core's parallel state is already initialised; build the student's groups "
            "once per process and pass them down"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        order="tp-cp-ep-dp-pp",
        distributed_timeout_minutes=collective_timeout().total_seconds() / 60,
    )
    ps = parallel_state
    groups = ParallelGroups(
        name="student",
        layout=layout,
        rank=rank,
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp=ps.get_data_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        mp=ps.get_model_parallel_group(),
        embd=ps.get_embedding_group(check_initialized=False),
        pos_embd=ps.get_position_embedding_group(check_initialized=False),
        tp_cp=ps.get_tensor_and_context_parallel_group(),
    )
    _check_matches_megatron(groups)
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return groups


def _check_matches_megatron(groups: ParallelGroups) -> None:
    # Our rank arithmetic (used by plan and by build_groups) must agree with megatron-core's.
    for field, dims in _GROUP_DIMS.items():
        ours = groups.layout.group_of(groups.rank, dims)
        theirs = sorted(dist.get_process_group_ranks(getattr(groups, field)))
        if ours != theirs:
            raise RuntimeError(
                f"megatron-core placed rank {groups.rank} in {field} group {theirs}, the layout "
                f"arithmetic says {ours}: this megatron-core version changed its rank order"
            )
