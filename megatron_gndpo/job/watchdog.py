"""A job never waits forever on one of its ranks, and an error is printed once for the job.

A :class:`Watchdog` ends the job naming a rank whose heartbeat stopped (a stopped or frozen
process); :func:`report_error` prints an error every rank raises once for the whole job. Both
talk through the rendezvous store of the world ``parallel/distributed.py`` started. (Every
collective also has a timeout, ``trainer.collective_timeout_s``: see
``parallel.distributed.collective_timeout``; under torchrun the workers die with their
launcher: ``parallel.distributed.die_with_parent``.)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from megatron_gndpo.job.exit import forced_exit
from megatron_gndpo.parallel.distributed import DistributedEnv

_KEYS = "megatron_gndpo"
# Heartbeat values other than a (positive) beat count: done; failed with one of our errors,
# printed; ended by the watchdog, which said why; crashed (a traceback, a signal: nothing of ours
# was printed, the launcher names the rank).
_DONE, _FAILED, _ABORTED, _CRASHED = -1, -2, -3, -4
# The exit code of a rank the watchdog ends because another rank crashed: not 2, which tells
# `megatron-gndpo launch` that an error was printed already (it then names the crashed rank).
FOLLOWED_A_CRASH_EXIT = 1
# At least this long after a rank marked itself crashed: its interpreter still prints its
# traceback and tears down its process groups, which took over 2 s on a loaded 2-core machine
# (the follower then exited first and was named as the failure).
_CRASH_GRACE_S = 10.0
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
                    forced_exit(2)  # that rank has said why; end this one too
                if value == _CRASHED:
                    # after the crashed rank has exited (it marks itself on its way out), so
                    # that the launcher records its failure first and names it
                    time.sleep(max(2 * self.interval_s, _CRASH_GRACE_S))
                    forced_exit(FOLLOWED_A_CRASH_EXIT)
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
        forced_exit(2)

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
        forced_exit(2)


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
