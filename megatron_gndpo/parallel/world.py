"""A world to build and run models in outside the trainer: torch.distributed as one process and
megatron-core's model-parallel state, started together and torn down together.

The demo, ``prune``, the HF export of a checkpoint and the benchmarks run in it. Whatever already
runs is used, not started again, and only what was started here is torn down: so a caller may
nest it (the demo's world around each model's preparation) or run under a world a launcher or a
test started.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from megatron_gndpo.errors import DistributedStartError
from megatron_gndpo.parallel import distributed
from megatron_gndpo.parallel.groups import (
    ParallelGroups,
    ParallelLayout,
    build_groups,
    build_student_groups,
)


@contextlib.contextmanager
def distributed_world(alone: str | None = None) -> Iterator[int]:
    """torch.distributed as one process (gloo on a CPU, with megatron-core's CPU compat; NCCL and
    gloo on a GPU) unless it already runs; shut down on exit when started here. Yields the
    world's size.

    ``alone`` names who must run as one process (``"the demo"``): a larger world is refused
    with a :class:`DistributedStartError` saying so. Without it a running world of any size is
    used as it is.
    """
    from megatron_gndpo.compat import cpu

    started = not dist.is_initialized()
    if started:
        distributed.init_distributed()
    try:
        world = dist.get_world_size()
        if alone is not None and world != 1:
            raise DistributedStartError(
                f"{alone} runs as one process, not {world}: start it without a launcher"
            )
        cpu.enable_if_no_cuda()
        yield world
    finally:
        if started:
            distributed.shutdown_distributed()


@contextlib.contextmanager
def one_process_world(
    seed: int | None = None, *, reuse: bool = False, alone: str | None = None
) -> Iterator[ParallelGroups]:
    """:func:`distributed_world` and megatron-core's model-parallel state: the student's groups
    at TP=1/PP=1 over the world (data-parallel over a larger one), megatron's RNG tracker seeded
    with ``seed`` when given; the state is destroyed on exit when created here.

    When megatron's state already exists, ``reuse`` builds TP=1/PP=1 groups of their own over
    the world beside it (an export while the trainer's layout is up); without ``reuse`` that is
    refused (:func:`~megatron_gndpo.parallel.groups.build_student_groups`' error).
    """
    from megatron.core import parallel_state

    with distributed_world(alone) as world:
        if reuse and parallel_state.model_parallel_is_initialized():
            yield build_groups(ParallelLayout(world), name="export")
            return
        groups = build_student_groups(ParallelLayout(world), seed=seed)
        try:
            yield groups
        finally:
            parallel_state.destroy_model_parallel()
