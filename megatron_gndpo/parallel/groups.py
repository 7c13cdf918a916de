"""Parallel layouts and their process groups, built once and passed down as values.

A :class:`ParallelLayout` is pure arithmetic (no process group): the sizes of the tensor (TP),
context (CP), data (DP) and pipeline (PP) dimensions and which ranks share each group, in
megatron-core's default rank order ``tp-cp-ep-dp-pp`` (TP varies fastest, so a TP group sits on
neighbouring GPUs of one node). ``plan`` uses it for any world size without starting anything.

A mixture-of-experts model adds expert parallelism (EP). As in megatron-core, its MoE layers see
the same ranks as a second grid, the *expert grid* ``etp-ep-edp-pp``: expert tensor-parallel
(ETP, equal to TP here), EP, expert data-parallel (EDP = world / (TP·EP·PP)) and the same
pipeline stages; EP ranks are taken out of the dense grid's CP x DP ranks. Dense parameters
are reduced over DP x CP, expert parameters over EDP.

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

import torch
import torch.distributed as dist

from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.parallel.distributed import collective_timeout

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

# megatron-core's default order ``tp-cp-ep-dp-pp``: the dense grid (its ep is 1) ...
ORDER: tuple[str, ...] = ("tp", "cp", "dp", "pp")
# ... and the expert grid of MoE layers (megatron-core builds it with cp=1 and the same order).
EXPERT_ORDER: tuple[str, ...] = ("etp", "ep", "edp", "pp")


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the parallel dimensions for one model over ``world_size`` ranks."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
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
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"expert_parallel ({self.ep}) must divide data_parallel x context_parallel "
                f"({self.dp} x {self.cp}): expert-parallel ranks are taken out of those; choose "
                "an expert_parallel that divides it, or more ranks"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp * pp * cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world_size / (tp * ep * pp) (expert TP = TP)."""
        return self.world_size // (self.tp * self.ep * self.pp)

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        """The expert grid's sizes (see the module docstring)."""
        return {"etp": self.tp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (tp varies fastest, pp slowest)."""
        return self._coords(rank, ORDER, self.sizes)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension of the expert grid (``etp``, ``ep``, ...)."""
        return self._coords(rank, EXPERT_ORDER, self.expert_sizes)

    def _coords(self, rank: int, order: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out = {}
        for dim in order:
            out[dim] = rank % sizes[dim]
            rank //= sizes[dim]
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at these coordinates of the dense grid (or of the expert grid when they
        name its dimensions)."""
        order, sizes = self._grid(tuple(coords))
        rank, stride = 0, 1
        for dim in order:
            rank += coords[dim] * stride
            stride *= sizes[dim]
        return rank

    def _grid(self, dims: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, int]]:
        """The grid whose dimensions ``dims`` are: dense (tp, cp, dp, pp) or expert (etp, ep,
        edp, pp); pp belongs to both and is the same there."""
        if set(dims) <= set(ORDER):
            return ORDER, self.sizes
        if set(dims) <= set(EXPERT_ORDER):
            return EXPERT_ORDER, self.expert_sizes
        unknown = set(dims) - set(ORDER) - set(EXPERT_ORDER)
        if unknown:
            raise ValueError(
                f"unknown parallel dimension(s) {sorted(unknown)}; use {ORDER} or, for the "
                f"expert grid, {EXPERT_ORDER}"
            )
        raise ValueError(
            f"parallel dimensions {sorted(dims)} mix the dense grid {ORDER} and the expert grid "
            f"{EXPERT_ORDER}; use dimensions of one grid"
        )

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """All groups spanning ``dims`` (e.g. ``("dp", "cp")``, or ``("edp",)`` of the expert
        grid): ranks that differ only there."""
        order, sizes = self._grid(dims)
        inner = [d for d in order if d in dims]
        outer = [d for d in order if d not in dims]
        result = []
        for fixed in itertools.product(*(range(sizes[d]) for d in reversed(outer))):
            base = dict(zip(reversed(outer), fixed, strict=True))
            members = []
            for varying in itertools.product(*(range(sizes[d]) for d in reversed(inner))):
                coords = base | dict(zip(reversed(inner), varying, strict=True))
                members.append(self.rank_of(coords))
            result.append(sorted(members))
        return sorted(result)

    def group_range(self, rank: int, dims: tuple[str, ...]) -> range:
        """The group of ``rank`` spanning ``dims`` as a range, in time independent of the world
        size (``plan`` at any scale); ``dims`` must be adjacent in their grid's order (tp, cp,
        dp, pp: e.g. ``("cp", "dp")``), whose groups are arithmetic progressions."""
        order, sizes = self._grid(dims)
        positions = sorted(order.index(d) for d in dims)
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(f"{dims} are not adjacent in {order}: use group_of")
        stride = 1
        for d in order[: positions[0]]:
            stride *= sizes[d]
        span = 1
        for d in dims:
            span *= sizes[d]
        coords = self._coords(rank, order, sizes)
        first = rank - sum(coords[d] * self._stride(order, sizes, d) for d in dims)
        return range(first, first + span * stride, stride)

    @staticmethod
    def _stride(order: tuple[str, ...], sizes: dict[str, int], dim: str) -> int:
        stride = 1
        for d in order[: order.index(dim)]:
            stride *= sizes[d]
        return stride

    def group_of(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        for members in self.groups(dims):
            if rank in members:
                return members
        raise AssertionError("unreachable: every rank is in exactly one group")

    def describe(self) -> str:
        experts = f" EP={self.ep} EDP={self.edp}" if self.ep > 1 else ""
        return (
            f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}{experts} "
            f"(world {self.world_size})"
        )


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups for one layout.

    ``dp_cp`` is the group that owns distinct tokens: the GNDPO statistics and the global token
    count are all-reduced over it, never over ``tp`` (whose ranks hold identical tokens).
    ``embd`` joins the first and last pipeline stages (tied embeddings); ``pos_embd`` is the first
    stage alone. The expert groups (``ep``, ``expt_tp``, ``tp_ep``, ``tp_ep_pp``, ``expt_dp``)
    are the expert grid's; None where they are the dense ones (EP = 1 outside megatron's global
    state), and :meth:`pg_collection` fills them in.
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
    tp_dp_cp: Any  # TP x DP x CP: megatron's routers average their z-loss metric over it
    ep: Any = None
    expt_tp: Any = None
    tp_ep: Any = None
    tp_ep_pp: Any = None
    expt_dp: Any = None

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    def expert_max(self, value: int, device: Any = "cpu") -> int:
        """The largest ``value`` over this rank's expert-parallel group (``value`` itself at
        EP = 1). MoE layers exchange tokens between the EP ranks in every forward (megatron's
        all-to-all dispatcher), so these ranks must run equally many forwards, each its own
        rows: generation steps and micro-batch counts are agreed through this."""
        if self.layout.ep == 1 or self.ep is None:
            return value
        out = torch.tensor([value], device=device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.ep)
        return int(out.item())

    def pg_collection(self) -> ProcessGroupCollection:
        """The groups as megatron-core's ``ProcessGroupCollection`` (for models, DDP, schedules)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection()
        for field in ("tp", "pp", "cp", "dp", "dp_cp", "mp", "embd", "pos_embd", "tp_cp",
                      "tp_dp_cp"):  # fmt: skip
            setattr(pgs, field, getattr(self, field))
        # At EP = 1 the expert grid is the dense one (expert TP = TP, EDP = DP x CP), so where
        # no expert groups were built the dense groups stand in for them.
        pgs.ep = self.ep if self.ep is not None else _single_rank_group()
        pgs.expt_tp = self.expt_tp if self.expt_tp is not None else self.tp
        pgs.tp_ep = self.tp_ep if self.tp_ep is not None else self.tp
        pgs.tp_ep_pp = self.tp_ep_pp if self.tp_ep_pp is not None else self.mp
        pgs.expt_dp = self.expt_dp if self.expt_dp is not None else self.dp_cp
        pgs.intra_dp_cp = self.dp_cp
        pgs.intra_expt_dp = pgs.expt_dp  # no partial (hierarchical) data parallelism
        return pgs


def _single_rank_group() -> Any:
    # The expert-parallel group at EP = 1 is each rank alone; megatron-core's global state holds
    # one when the student's EP is 1 too (the same on every rank, so build_groups may branch on
    # it); else None, and build_groups builds one.
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_expert_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return group
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
    wanted = dict(_GROUP_DIMS)
    if layout.ep > 1:  # at EP = 1 the dense groups stand in (ParallelGroups.pg_collection)
        wanted |= _EXPERT_GROUP_DIMS
    elif _single_rank_group() is None:  # an MoE layer at EP = 1 needs each rank alone
        wanted["ep"] = _EXPERT_GROUP_DIMS["ep"]
    made = {dims: _new_groups(layout, rank, dims) for dims in wanted.values()}
    embd, pos_embd = _stage_groups(layout, rank)
    return ParallelGroups(
        name=name,
        layout=layout,
        rank=rank,
        embd=embd,
        pos_embd=pos_embd,
        **{field: made[dims] for field, dims in wanted.items()},
    )


_GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "dp_cp": ("cp", "dp"),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}

# The expert grid's groups (megatron-core's parallel_state names them in its comments).
_EXPERT_GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("etp",),
    "tp_ep": ("etp", "ep"),
    "tp_ep_pp": ("etp", "ep", "pp"),
    "expt_dp": ("edp",),
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
        expert_model_parallel_size=layout.ep,
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
        tp_dp_cp=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        ep=ps.get_expert_model_parallel_group(),
        expt_tp=ps.get_expert_tensor_parallel_group(),
        tp_ep=ps.get_expert_tensor_and_model_parallel_group(),
        tp_ep_pp=ps.get_expert_tensor_model_pipeline_parallel_group(),
        expt_dp=ps.get_expert_data_parallel_group(),
    )
    _check_matches_megatron(groups)
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return groups


def _check_matches_megatron(groups: ParallelGroups) -> None:
    # Our rank arithmetic (used by plan and by build_groups) must agree with megatron-core's.
    for field, dims in (_GROUP_DIMS | _EXPERT_GROUP_DIMS).items():
        ours = groups.layout.group_of(groups.rank, dims)
        theirs = sorted(dist.get_process_group_ranks(getattr(groups, field)))
        if ours != theirs:
            raise RuntimeError(
                f"megatron-core placed rank {groups.rank} in {field} group {theirs}, the layout "
                f"arithmetic says {ours}: this megatron-core version changed its rank order"
            )


def schedule_groups(groups: ParallelGroups, model_config: Any) -> dict[str, Any]:
    """The process-group arguments of megatron's schedules for a model on ``groups``.

    The model's own pipeline group, not megatron's global one: the teacher has its own layout.
    Build it once per model and reuse it (it creates a P2P communicator).
    """
    kwargs: dict[str, Any] = {"pg_collection": groups.pg_collection()}
    if groups.layout.pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        kwargs["p2p_communicator"] = P2PCommunicator(groups.pp, model_config)
    return kwargs


def layout_of(parallel: ParallelConfig, world_size: int) -> ParallelLayout:
    """The :class:`ParallelLayout` of a config section (``parallel``, ``teacher.parallel``...)
    on ``world_size`` ranks, with the config's key names in the error."""
    try:
        return ParallelLayout(
            world_size=world_size,
            tp=parallel.tensor_parallel,
            pp=parallel.pipeline_parallel,
            cp=parallel.context_parallel,
            ep=parallel.expert_parallel,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
