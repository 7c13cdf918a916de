"""Distributed start-up: one place reads the launcher's environment and starts torch.distributed.

Three launchers are understood, in this order of precedence:

- ``torchrun`` (also one torchrun per node started by Slurm's ``srun``): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- Slurm's ``srun`` with one task per GPU: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``; the rendezvous host is the first node of
  ``SLURM_JOB_NODELIST`` and the port is derived from ``SLURM_JOB_ID`` unless ``MASTER_PORT``
  is set.
- Nothing: a single process (rank 0 of 1) on a free local port.

On GPUs the default process group has two backends, ``cpu:gloo,cuda:nccl``: CUDA tensors go
through NCCL, and the few small CPU tensors the trainer reduces (stop flags, metric sums, widths)
through gloo, so a collective never fails for its tensor's device. Groups created later (megatron's
and ours) inherit both. Without CUDA the backend is gloo.

A job never waits forever on one of its ranks: every collective has a timeout
(``trainer.collective_timeout_s``, for every process group, see :func:`collective_timeout`) and
under torchrun the workers die with their launcher (:func:`die_with_parent`). The rest of the
job's lifecycle (the heartbeat watchdog, the once-per-job error report, the run directory's
lock) is in ``megatron_gndpo/job/``, which builds on this module and is never imported by it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Literal

import torch
import torch.distributed as dist

from megatron_gndpo.errors import DistributedStartError

Launcher = Literal["torchrun", "slurm", "single"]

# Slurm job ids are large integers; ports below 10000 are often taken by system services.
_SLURM_PORT_BASE = 10000
_SLURM_PORT_SPAN = 20000


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: Launcher


def rank() -> int:
    """This process's global rank; 0 before torch.distributed starts (one process)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes; 1 before torch.distributed starts."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """A barrier over every process once torch.distributed runs; nothing in one process."""
    if dist.is_initialized():
        dist.barrier()


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago (for single-process and test runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``"gpu-[001-003,007],login1"`` into host names.

    Handles comma-separated entries, bracketed ranges with zero padding, and several bracket
    groups in one name (``"rack[1-2]-node[01-02]"``).
    """
    hosts: list[str] = []
    for entry in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_entry(entry))
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p for p in parts if p]


def _expand_entry(entry: str) -> list[str]:
    match = re.search(r"\[([^\]]+)\]", entry)
    if match is None:
        return [entry]
    head, tail = entry[: match.start()], entry[match.end() :]
    names: list[str] = []
    for item in match.group(1).split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            names.extend(f"{head}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            names.append(f"{head}{item}")
    return [expanded for name in names for expanded in _expand_entry(name + tail)]


def _slurm_tasks_on_first_node(env: Mapping[str, str]) -> int:
    # SLURM_TASKS_PER_NODE looks like "8(x4),4"; SLURM_NTASKS_PER_NODE is a plain number.
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_TASKS_PER_NODE", "1").split(",")[0]
    return int(spec.split("(")[0])


def detect_env(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """Read the launcher's variables (``os.environ`` by default); pure, so it is unit-testable."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistributedEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise DistributedStartError(
                "SLURM_PROCID is set but SLURM_JOB_NODELIST is not: start the job with srun "
                "inside an sbatch allocation, or use torchrun"
            )
        if "MASTER_PORT" in env:
            port = int(env["MASTER_PORT"])
        else:
            port = _SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % _SLURM_PORT_SPAN
        return DistributedEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=_slurm_tasks_on_first_node(env),
            master_addr=env.get("MASTER_ADDR") or expand_slurm_nodelist(nodelist)[0],
            master_port=port,
            launcher="slurm",
        )
    return DistributedEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        launcher="single",
    )


def default_backend() -> str:
    """NCCL for CUDA tensors plus gloo for CPU tensors on GPUs; gloo alone on CPUs."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


# torch.distributed's own default; trainer.collective_timeout_s replaces it for a training job.
DEFAULT_TIMEOUT_S = 1800.0
_timeout_s = DEFAULT_TIMEOUT_S


def collective_timeout() -> datetime.timedelta:
    """The timeout the default process group was started with: pass it to every group built
    later (torch gives new groups its own 30-minute default, not the world's)."""
    return datetime.timedelta(seconds=_timeout_s)


def init_distributed(
    env: DistributedEnv | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rollout_ranks: int = 0,
) -> DistributedEnv:
    """Initialise the default process group once for this process and return where it sits.

    Calling it again in a process that is already initialised checks that the world matches and
    returns. On GPUs the current device is set to ``local_rank`` before any collective. Under
    torchrun the process is set to die with its launcher (a killed torchrun leaves no workers).

    ``rollout_ranks`` > 0 (``rollout.disaggregate``; fewer than the world) splits the job in two
    worlds, the trainers' and the rollout ranks', joined by a bridge (parallel/bridge.py): the
    default group is then this rank's role's world, and ``env`` still describes the whole job.
    """
    global _timeout_s
    env = detect_env() if env is None else env
    if dist.is_initialized():
        from megatron_gndpo.parallel import bridge

        if bridge.bridge() is not None:  # two worlds: this one is a role's, not the job's
            return env
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise DistributedStartError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {env.rank} of "
                f"{env.world_size}; do not initialise it twice"
            )
        return env
    backend = backend or default_backend()
    if "nccl" in backend:
        if torch.cuda.device_count() <= env.local_rank:
            raise DistributedStartError(
                f"local rank {env.local_rank} has no GPU (this node has "
                f"{torch.cuda.device_count()}): start at most one process per GPU"
            )
        torch.cuda.set_device(env.local_rank)
    if env.launcher == "torchrun":
        die_with_parent()
    _timeout_s = timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    init_method = f"tcp://{env.master_addr}:{env.master_port}"
    if 0 < rollout_ranks < env.world_size:  # else the config check reports it, on one world
        from megatron_gndpo.parallel import bridge

        placement = bridge.Placement(env.world_size, rollout_ranks)
        store, _, _ = next(dist.rendezvous(
            f"{init_method}?rank={env.rank}&world_size={env.world_size}", timeout=timeout
        ))  # fmt: skip
        bridge.init_roles(store, placement, env.rank, backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=env.rank,
            world_size=env.world_size, timeout=timeout,
        )  # fmt: skip
    export_torchrun_env(env)
    return env


def export_torchrun_env(env: DistributedEnv) -> None:
    """Describe this process in torchrun's variables when another launcher (srun, none) started
    it: libraries that join the job's world read them (vLLM's ``external_launcher`` executor
    reads ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``). Values already set are kept."""
    for name, value in (
        ("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
        ("LOCAL_WORLD_SIZE", env.local_world_size), ("MASTER_ADDR", env.master_addr),
        ("MASTER_PORT", env.master_port),
    ):  # fmt: skip
        os.environ.setdefault(name, str(value))


_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def before_shutdown(callback: Callable[[], None]) -> None:
    """Run ``callback`` in :func:`shutdown_distributed`, after megatron's groups are destroyed
    and before torch's world is: for engines that joined the world and must leave it first (a
    colocated vLLM engine's shutdown destroys its own groups and the world with them)."""
    _BEFORE_SHUTDOWN.append(callback)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent (torchrun) exits, however it exits.

    torchrun stops its workers when it is stopped politely; killed with SIGKILL it cannot, and
    the workers would live on as orphans, holding GPUs and ports. Returns whether it took effect
    (False off Linux). SIGKILL rather than SIGTERM: a worker waiting in a collective would never
    act on a polite signal.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def shutdown_distributed() -> None:
    """Destroy megatron-core's and torch's process groups (safe to call when not initialised)."""
    if not dist.is_initialized():
        return
    # Only when megatron-core is already loaded: importing it just to tear down costs ~6 s.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    while _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()
    from megatron_gndpo.parallel import bridge

    bridge.close()
