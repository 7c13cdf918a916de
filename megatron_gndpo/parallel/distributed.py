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
(``trainer.collective_timeout_s``, for every process group, see :func:`collective_timeout`); a
:class:`Watchdog` ends the job naming a rank whose heartbeat stopped (a stopped or frozen
process); under torchrun the workers die with their launcher. :func:`report_error` prints an
error every rank raises once for the whole job.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

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


_ON_FORCED_EXIT: list[Callable[[], None]] = []


def on_forced_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` before the watchdog ends this process with ``os._exit`` (no ``finally``
    runs then): what must not outlive the process, such as the run directory's lock."""
    _ON_FORCED_EXIT.append(callback)


def _forced_exit(code: int) -> None:
    while _ON_FORCED_EXIT:
        with contextlib.suppress(Exception):
            _ON_FORCED_EXIT.pop()()
    os._exit(code)


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


# ---------------------------------------------------------------------------------------------
# Watchdog and once-per-job error reports, through the rendezvous store

_KEYS = "megatron_gndpo"
# Heartbeat values other than a (positive) beat count: done; failed with one of our errors,
# printed; ended by the watchdog, which said why; crashed (a traceback, a signal: nothing of ours
# was printed, the launcher names the rank).
_DONE, _FAILED, _ABORTED, _CRASHED = -1, -2, -3, -4
# The exit code of a rank the watchdog ends because another rank crashed: not 2, which tells
# `megatron-gndpo launch` that an error was printed already (it then names the crashed rank).
FOLLOWED_A_CRASH_EXIT = 1
_CRASH_GRACE_S = 2.0  # at least this long after a rank marked itself crashed
_REPORT_WAIT_S = 5.0  # how long a rank waits for rank 0 to report the same error


def _key_prefix() -> str:
    # torchrun keeps its store across restarts of the workers: one namespace per attempt.
    return f"{_KEYS}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _say_error(message: str) -> None:
    print(f"megatron-gndpo: error: {message}", file=sys.stderr, flush=True)


class Watchdog:
    """Ends the job when a rank stops responding, naming it, instead of waiting in a collective.

    Each rank's background thread adds one to its heartbeat counter in the rendezvous store
    every ``interval_s``. Rank 0 watches every rank's counter; the others watch rank 0's. A rank
    whose counter has not moved for ``timeout_s`` (SIGSTOP, a debugger, a frozen node) ends the
    job: the watching rank prints which rank went silent and exits with status 2, and the other
    ranks follow (rank 0 marks its counter aborted). A stopped process stops its threads too, so
    a heartbeat is a true sign of life; a slow but running rank keeps beating. A rank that
    finishes marks itself done, one that fails marks itself failed (its own message says why) or
    crashed (a traceback: the ranks that follow it exit with ``FOLLOWED_A_CRASH_EXIT``, not 2, so
    that the launcher names the crashed rank instead of taking the job's error as printed).
    """

    def __init__(
        self, env: DistributedEnv, timeout_s: float, *, interval_s: float | None = None
    ) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.interval_s = interval_s or min(max(timeout_s / 10, 0.2), 5.0)
        self._prefix = _key_prefix()
        # A connection of its own: a store that stops answering blocks only this thread.
        self._store = dist.TCPStore(
            env.master_addr, env.master_port, is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
        self._store.set(self._who(env.rank), f"{socket.gethostname()}, pid {os.getpid()}")
        self._store.set(self._beat(env.rank), "0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-gndpo-watchdog")
        self._thread.daemon = True
        self._thread.start()

    def _beat(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    def _who(self, rank: int) -> str:
        return f"{self._prefix}/who/{rank}"

    def stop(self, *, failed: bool = False, said_why: bool = True) -> None:
        """Stop beating and mark this rank done, or failed: with one of our errors, printed
        (``said_why``), or crashed (a traceback or a signal); the others stop watching it."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + self.timeout_s)
        mark = (_FAILED if said_why else _CRASHED) if failed else _DONE
        with contextlib.suppress(Exception):  # the store's host is gone: nobody left to tell
            self._store.set(self._beat(self.env.rank), str(mark))

    def _run(self) -> None:
        watched = range(self.env.world_size) if self.env.rank == 0 else [0]
        watched = [r for r in watched if r != self.env.rank]
        keys = [self._beat(r) for r in watched]
        try:  # every watched rank has published its first beat (started its watchdog)
            self._store.wait(keys)
        except Exception:
            missing = [r for r, key in zip(watched, keys, strict=True) if not self._has(key)]
            if missing and not self._stop.is_set():
                self._end([(r, self.timeout_s) for r in missing])
            return
        last: dict[int, tuple[int | None, float]] = {r: (None, time.monotonic()) for r in watched}
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._beat(self.env.rank), 1)
                values = [int(v) for v in self._store.multi_get(keys)] if keys else []
            except Exception:
                if not self._stop.is_set():
                    self._store_lost()
                return
            now = time.monotonic()
            silent: list[tuple[int, float]] = []
            for rank, value in zip(watched, values, strict=True):
                if value in (_FAILED, _ABORTED):
                    _forced_exit(2)  # that rank has said why; end this one too
                if value == _CRASHED:
                    # after the crashed rank has exited (it marks itself on its way out), so
                    # that the launcher records its failure first and names it
                    time.sleep(max(2 * self.interval_s, _CRASH_GRACE_S))
                    _forced_exit(FOLLOWED_A_CRASH_EXIT)
                if value == _DONE:
                    continue
                seen, since = last[rank]
                if value != seen:
                    last[rank] = (value, now)
                elif now - since > self.timeout_s:
                    silent.append((rank, now - since))
            if silent and not self._stop.is_set():
                self._end(silent)

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:
            return False

    def _describe(self, rank: int) -> str:
        try:
            return f"rank {rank} ({self._store.get(self._who(rank)).decode()})"
        except Exception:
            return f"rank {rank}"

    def _end(self, silent: list[tuple[int, float]]) -> None:
        names = ", ".join(f"{self._describe(r)} for {s:.0f} s" for r, s in silent)
        # Rank 0 speaks for the job; when rank 0 is the silent one, rank 1 does.
        if self.env.rank in (0, 1):
            for rank, _ in silent:
                self._kill_if_local(rank)
            _say_error(
                f"no heartbeat from {names} (trainer.heartbeat_timeout_s={self.timeout_s:g}): "
                "it is stopped (SIGSTOP, a debugger), frozen or cut off from the other ranks. "
                "Ending the job instead of waiting for it; a restart resumes from the newest "
                "checkpoint"
            )
        if self.env.rank == 0:
            # tell the others, and give them a beat to read it before the store goes
            with contextlib.suppress(Exception):
                self._store.set(self._beat(0), str(_ABORTED))
                time.sleep(2 * self.interval_s)
        _forced_exit(2)

    def _kill_if_local(self, rank: int) -> None:
        """SIGKILL a silent rank on this host: a stopped process acts on no other signal, so
        the launcher's polite SIGTERM would leave it (and its memory) for its grace period."""
        with contextlib.suppress(Exception):
            host, pid = self._store.get(self._who(rank)).decode().split(", pid ")
            if host == socket.gethostname():
                os.kill(int(pid), signal.SIGKILL)

    def _store_lost(self) -> None:
        if self.env.rank == 1:
            _say_error(
                f"the rendezvous store at {self.env.master_addr}:{self.env.master_port} has not "
                f"answered for {self.timeout_s:g} s (trainer.heartbeat_timeout_s): its host (rank "
                "0, or the torchrun agent) is stopped, frozen or gone. Ending the job"
            )
        _forced_exit(2)


def report_error(message: str) -> None:
    """Print ``megatron-gndpo: error: MESSAGE`` once for the whole job, not once per rank.

    Every rank that fails calls it. Rank 0 prints; another rank prints (with its rank) only when
    rank 0 did not report the same message within a few seconds: an error only it raised.
    Before torch.distributed starts, the launcher's rank decides.
    """
    if not dist.is_initialized():
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            _say_error(message)
        return
    rank = dist.get_rank()
    if dist.get_world_size() == 1:
        _say_error(message)
        return
    try:
        store: Any = dist.distributed_c10d._get_default_store()
        store.set(f"{_key_prefix()}/error/{rank}", message)
        if rank == 0:
            _say_error(message)
            return
        store.set_timeout(datetime.timedelta(seconds=_REPORT_WAIT_S))
        theirs = store.get(f"{_key_prefix()}/error/0").decode()
    except Exception:  # no store, or rank 0 did not fail in time
        theirs = None
    if rank == 0 or theirs != message:
        _say_error(f"(rank {rank}) {message}")
