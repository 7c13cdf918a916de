"""Rollout ranks apart from the trainer: two torch worlds in one job, and the bridge between them.

With ``rollout.disaggregate.ranks = R`` the job's ``W`` ranks split in two *roles*: the first
``T = W - R`` ranks train (the student, its optimizer, the teachers), the last ``R`` ranks only
generate. Each role is a torch world of its own (:func:`init_roles`): ``torch.distributed``'s
default group on a trainer rank spans the ``T`` trainers, on a rollout rank the ``R`` rollout
ranks, and megatron-core's parallel state is built on each world as if it were the whole job.
Nothing of the trainer changes (its checkpoints, its teachers, its whole-world reductions see
``T`` ranks), and the rollout ranks keep a layout of their own (``tensor_parallel``).

The two worlds meet only through the :class:`Bridge`, two process groups built directly on the
job's rendezvous store (as vLLM's and NeMo-RL's weight-update groups are, outside the default
world):

- ``control``: all ``W`` ranks, numbered by global rank: the requests, the rollouts and the
  commands, as pickled objects over point-to-point sends (:meth:`Bridge.send`,
  :meth:`Bridge.recv`);
- ``weights``: the trainer's rank 0 and the ``R`` rollout ranks: the student's weights after
  each update, one broadcast per bucket.

Both are gloo groups over CPU tensors (on GPUs the weights are staged in host memory first; an
NCCL weight group is not built yet).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
from typing import Any

import torch
import torch.distributed as dist

# Sends whose receiver has not taken them yet are kept (with their buffers) until then.
_PRUNE_EVERY = 16


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which global ranks train and which generate, and the rollout replicas' ranks; pure
    arithmetic. The bridge is started knowing the split alone (``rollout_tp`` 1)."""

    world_size: int
    rollout_ranks: int
    rollout_tp: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.rollout_ranks < self.world_size:
            raise ValueError(
                f"rollout.disaggregate.ranks ({self.rollout_ranks}) must be between 1 and the "
                f"world size less one ({self.world_size - 1}): the trainer needs a rank too"
            )
        if self.rollout_ranks % self.rollout_tp:
            raise ValueError(
                f"rollout.disaggregate.tensor_parallel ({self.rollout_tp}) must divide "
                f"rollout.disaggregate.ranks ({self.rollout_ranks})"
            )

    @property
    def trainer_ranks(self) -> int:
        """T: the ranks [0, T) that train."""
        return self.world_size - self.rollout_ranks

    @property
    def rollout_replicas(self) -> int:
        """Copies of the student on the rollout ranks (each ``rollout_tp`` ranks)."""
        return self.rollout_ranks // self.rollout_tp

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.trainer_ranks

    def role_rank(self, rank: int) -> int:
        """The rank inside its role's world."""
        return rank - self.trainer_ranks if self.is_rollout(rank) else rank

    def replica_ranks(self, replica: int) -> list[int]:
        """The global ranks of one rollout replica (its TP group; the first is its leader)."""
        first = self.trainer_ranks + replica * self.rollout_tp
        return list(range(first, first + self.rollout_tp))

    def serving(self, trainer_dp: int) -> int:
        """The rollout replica that samples for the trainer's data-parallel replica."""
        return trainer_dp % self.rollout_replicas


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


class Bridge:
    """The trainer's and the rollout ranks' process groups (see the module docstring)."""

    def __init__(
        self, store: Any, placement: Placement, rank: int, timeout: datetime.timedelta
    ) -> None:
        self.placement = placement
        self.rank = rank
        # Every rank constructs the groups it belongs to; members meet through the store.
        self.control: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("bridge/control", store), rank, placement.world_size, timeout
        )
        self.weight_members = [0, *range(placement.trainer_ranks, placement.world_size)]
        self.weights: Any = None
        if rank in self.weight_members:
            self.weights = dist.ProcessGroupGloo(
                dist.PrefixStore("bridge/weights", store),
                self.weight_members.index(rank),
                len(self.weight_members),
                timeout,
            )
        self._pending: list[tuple[Any, tuple[torch.Tensor, ...]]] = []

    # -- objects, point to point ---------------------------------------------------------------
    def send(self, obj: Any, dst: int) -> None:
        """Send a picklable ``obj`` to global rank ``dst`` without waiting for it to be taken."""
        data = _to_bytes(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        works = [self.control.send([size], dst, 0), self.control.send([data], dst, 1)]
        self._pending.extend((w, (size, data)) for w in works)
        if len(self._pending) >= _PRUNE_EVERY:
            self._pending = [(w, keep) for w, keep in self._pending if not w.is_completed()]

    def recv(self, src: int) -> Any:
        """The next object global rank ``src`` sent to this rank (blocks until it arrives)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.control.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.recv([data], src, 1).wait()
        return _from_bytes(data)

    # -- weights, trainer rank 0 -> every rollout rank -----------------------------------------
    def broadcast(self, flat: torch.Tensor) -> Any:
        """Broadcast one bucket from the trainer's rank 0 to the rollout ranks; returns the work
        (the trainer does not wait for it: ``flat`` must stay alive until it completes)."""
        assert self.weights is not None, "only the trainer's rank 0 and rollout ranks broadcast"
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = self.weights.broadcast([flat], options)
        if self.rank == 0:
            self._pending.append((work, (flat,)))
        return work

    def flush(self) -> None:
        """Wait until every send of this rank has been taken."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


_BRIDGE: Bridge | None = None


def bridge() -> Bridge | None:
    """This process's bridge; None in a colocated job."""
    return _BRIDGE


def init_roles(
    store: Any,
    placement: Placement,
    rank: int,
    *,
    backend: str,
    timeout: datetime.timedelta,
) -> Bridge:
    """Start this rank's role world as torch's default group, then the bridge (every rank of
    the job calls it once, with the job's rendezvous ``store``)."""
    global _BRIDGE
    role = "rollout" if placement.is_rollout(rank) else "trainer"
    size = placement.rollout_ranks if role == "rollout" else placement.trainer_ranks
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"role/{role}", store),
        rank=placement.role_rank(rank),
        world_size=size,
        timeout=timeout,
    )
    _BRIDGE = Bridge(store, placement, rank, timeout)
    return _BRIDGE


def close() -> None:
    """Drop the bridge (its groups are freed with it)."""
    global _BRIDGE
    _BRIDGE = None
