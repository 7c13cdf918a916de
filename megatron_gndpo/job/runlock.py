"""One owner per run directory: a lock file naming the process that writes there.

Two ``train`` commands in one run directory would write the same checkpoints and metrics and
lose both (issue 35). The command takes ``DIR/megatron-gndpo.lock`` for the run directory and
for its checkpoint directory (another run may name it as its checkpoint.save) before it builds
anything, once for the job (rank 0),
and removes it when it ends. The file names the holder: host, pid, the process's start time,
and the Slurm job when there is one.

A lock another process still holds is refused, naming it and how to remove it. A stale lock
(its holder is gone) is taken over, with a warning:

- same host: the pid is not running, or runs another process (its start time differs), or the
  host rebooted since (another boot id);
- another host: the holder was an earlier start of this same Slurm job (a requeue: same job id,
  a lower restart count), or Slurm says its job is no longer running (``squeue``); otherwise
  nothing here can tell whether it still runs, and the lock is refused.

Taking a stale lock over is safe against a second taker: the stale file is renamed away first
(only one rename succeeds), then the new one is created exclusively (``O_EXCL``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.errors import UserError

LOCK_FILE = "megatron-gndpo.lock"
# A lock file younger than this that is still empty is being written by its creator.
_WRITE_GRACE_S = 5.0
_SQUEUE_TIMEOUT_S = 10.0


class RunDirLockedError(UserError, RuntimeError):
    """Another run writes into this directory (names it, and how to remove a stale lock)."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if unknown."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces
    return fields[19] if len(fields) > 19 else None


def _boot_id() -> str | None:
    return _read(Path("/proc/sys/kernel/random/boot_id"))


def holder_of_this_process(command: str) -> dict[str, Any]:
    """What the lock file says about this process."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "proc_start": _proc_start(os.getpid()),
        "boot_id": _boot_id(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "command": command,
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _slurm_job_running(job: str) -> bool | None:
    """Whether Slurm still runs ``job``; None when Slurm cannot be asked from here."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
            timeout=_SQUEUE_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # "Invalid job id specified": long gone
        return False if "invalid job id" in out.stderr.lower() else None
    return out.stdout.strip() in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")


def stale_reason(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why ``holder`` no longer holds its lock, or None while it may (see the module doc)."""
    pid = holder.get("pid")
    if holder.get("host") == me["host"]:
        if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
            return "its host has rebooted since"
        if not isinstance(pid, int) or not _pid_alive(pid):
            return "it is no longer running"
        if holder.get("proc_start") and _proc_start(pid) != holder["proc_start"]:
            return "it is no longer running (its pid now belongs to another process)"
        return None
    job = holder.get("slurm_job")
    if job and job == me["slurm_job"] and int(holder.get("slurm_restart", 0)) < me["slurm_restart"]:
        return f"Slurm requeued its job {job} (this is restart {me['slurm_restart']})"
    if job and _slurm_job_running(str(job)) is False:
        return f"Slurm says its job {job} is no longer running"
    return None


def _describe(holder: dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} (started "
        f"{holder.get('started', '?')}{job})"
    )


class RunLock:
    """The locks of a run's directories; :meth:`acquire` (raises
    :class:`RunDirLockedError`) and :meth:`release`, or ``with RunLock(...):``."""

    def __init__(self, directories: Sequence[str | Path], command: str, *, say: Any = None) -> None:
        unique: dict[Path, Path] = {}
        for d in directories:
            unique.setdefault(Path(d).absolute(), Path(d))
        self.paths = [d / LOCK_FILE for d in unique.values()]
        self.me = holder_of_this_process(command)
        self.say = say or (lambda m: print(f"megatron-gndpo: warning: {m}", file=sys.stderr))
        self.held: list[Path] = []

    def acquire(self) -> None:
        try:
            for path in self.paths:
                self._take(path)
                self.held.append(path)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Remove the locks this process holds (a lock someone took over stays)."""
        while self.held:
            path = self.held.pop()
            holder = self._holder(path)
            if holder is not None and (holder.get("host"), holder.get("pid")) == (
                self.me["host"], self.me["pid"],
            ):  # fmt: skip
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:  # the next run takes it over as stale, or names it
                    self.say(f"could not remove {path} ({err.strerror}): remove it by hand")

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -------------------------------------------------------------------------------------
    def _take(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            created = self._create(path)
        except OSError as err:  # a read-only file system, a directory of another user
            raise RunDirLockedError(
                f"cannot create the lock file {path} ({err.strerror}): the run's directories "
                "(logging.run_dir, checkpoint.save) must be ones this user can write"
            ) from None
        for _ in range(20):  # each round: create, or find the holder and decide
            if created or self._create(path):
                return
            holder = self._holder(path)
            if holder is None:  # vanished, or being written this instant: look again
                time.sleep(0.2)
                continue
            why = stale_reason(holder, self.me)
            if why is None:
                raise RunDirLockedError(
                    f"{path.parent} is in use by another megatron-gndpo run: "
                    f"{_describe(holder)} holds {path}. Wait for it to end, or give this run "
                    "its own logging.run_dir (and checkpoint.save); if that process is gone "
                    f"(a crashed host), remove the lock: rm {path}"
                )
            aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
            try:
                os.rename(path, aside)  # only one taker wins this rename
            except FileNotFoundError:
                continue
            except OSError as err:  # an immutable file (chattr +i), a directory we cannot write
                raise RunDirLockedError(
                    f"{path} names {_describe(holder)}, and {why}, but the lock cannot be taken "
                    f"over: renaming it failed ({err.strerror}). Remove it yourself: rm -f "
                    f"{path} (an immutable file needs chattr -i {path} first)"
                ) from None
            aside.unlink(missing_ok=True)
            self.say(f"{path} named {_describe(holder)}, and {why}: taking it over")
        raise RunDirLockedError(f"could not take {path}: it keeps changing; try again")

    def _create(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _holder(self, path: Path) -> dict[str, Any] | None:
        """The holder a lock file names; None when it is gone or still being written. A lock
        file that stays unreadable is named as an unknown holder (refused, with the fix)."""
        try:
            text = path.read_text()
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        except OSError as err:
            return {"host": f"? ({err.strerror})", "pid": None}
        with contextlib.suppress(ValueError):
            holder = json.loads(text)
            if isinstance(holder, dict):
                return holder
        if age < _WRITE_GRACE_S:
            return None
        return {"host": "? (an unreadable lock file)", "pid": None}


@contextlib.contextmanager
def locked(directories: Sequence[str | Path], command: str) -> Iterator[RunLock]:
    """``with locked([run_dir], "train"):`` — the run's directories are this process's."""
    with RunLock(directories, command) as lock:
        yield lock
