"""Multi-process test harness: gloo on CPU, a free port, and a bounded join so a hang fails.

    def _body(rank: int, world_size: int, scale: float) -> float:
        ...  # torch.distributed is initialised (gloo) here
        return value

    results = run_distributed(_body, world_size=4, args=(2.0,), timeout_s=120)

``fn`` must be a module-level function (it is pickled into spawned processes). Each rank's
return value comes back in rank order. The first exception on any rank fails the call with that
rank's traceback; a rank that does not report before the deadline fails it with a TimeoutError
naming the silent ranks, and every child is killed either way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_CHILD_THREADS = 1  # 2-core machines: more threads per rank only contend


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: Sequence[Any],
    results: Any,
    timeout_s: float,
    rollout_ranks: int = 0,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch

        torch.set_num_threads(_CHILD_THREADS)
        from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed

        # rollout ranks apart (rollout.disaggregate): each role its own world
        init_distributed(backend="gloo", timeout_s=timeout_s, rollout_ranks=rollout_ranks)
        try:
            value = fn(rank, world_size, *args)
        finally:
            shutdown_distributed()
        # Plain pickle bytes: torch's queue pickler shares tensor storage through file
        # descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))


# The port is free when chosen but another process may take it before rank 0 binds it.
_PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 180.0,
    rollout_ranks: int = 0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return values by rank.

    ``rollout_ranks`` > 0 starts the last ones as rollout ranks in a world of their own
    (``rollout.disaggregate``; ``rank`` is still the job's). A launch that fails only because
    its rendezvous port was taken meanwhile is retried once.
    """
    try:
        return _launch(fn, world_size, args, timeout_s, rollout_ranks)
    except RuntimeError as err:
        if not any(marker in str(err) for marker in _PORT_TAKEN):
            raise
        return _launch(fn, world_size, args, timeout_s, rollout_ranks)


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout_s: float,
    rollout_ranks: int,
) -> list[Any]:
    from megatron_gndpo.parallel.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, tuple(args), results, timeout_s, rollout_ranks),
            # not daemonic: megatron's checkpoint writer starts a Manager process of its own
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(
                    f"ranks {silent} of {world_size} did not finish within {timeout_s:.0f} s "
                    "(a collective that not every rank called, or a rank that died)"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not any(r in values for r in dead):
                    # a child crashed hard (segfault, OOM kill) without reporting
                    time.sleep(1.0)  # let a late report from a sibling arrive first
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(
                            f"ranks died without reporting: exit codes {codes}"
                        ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [values[r] for r in range(world_size)]
