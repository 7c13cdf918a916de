"""A save that failed because the disk is full, said in one line.

A full disk shows up in many forms: ``OSError(ENOSPC)`` from our own writes, torch's
distributed checkpoint's ``CheckpointException`` wrapping every rank's traceback, or a
``RuntimeError`` from torch's zip writer ("unexpected pos 704 vs 598") with no errno at all.
:func:`disk_full` recognises all three: the error names ENOSPC or EDQUOT somewhere in its chain,
or the disk has less room left than the step needs (the size of the previous step, else of the
model's weights), measured before the half-written step is removed. megatron-core's writer
logs its failure too (two lines): :class:`HeldWriterErrors` holds them back until the save's
outcome is known, and lets them through unless the failure is said in our one line.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FULL = (errno.ENOSPC, errno.EDQUOT)
_WRITER_LOG = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class HeldWriterErrors(logging.Filter):
    """``with held:`` the errors megatron-core's checkpoint writer logs are kept, not printed;
    :meth:`release` prints them (a failure we do not explain ourselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        self.records.append(record)
        return False

    def __enter__(self) -> HeldWriterErrors:
        logging.getLogger(_WRITER_LOG).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(_WRITER_LOG).removeFilter(self)

    def release(self) -> None:
        logger = logging.getLogger(_WRITER_LOG)
        while self.records:
            logger.handle(self.records.pop(0))


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures torch's
    ``CheckpointException`` carries (``{rank: (exception, traceback)}``)."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)


def _said_full(err: BaseException) -> bool:
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    return False


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def step_bytes(previous: Path | None, model: Any) -> int:
    """What a step needs at least: the size of the ``previous`` step directory, else the bytes
    of ``model``'s parameters on this rank."""
    if previous is not None and previous.is_dir():
        return _bytes(previous)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mount_point(path: Path) -> Path:
    path = path.absolute()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full(err: BaseException, where: Path, needed: int) -> str | None:
    """Which disk is full, in words, when ``err`` (raised writing into ``where``) came of a
    full disk: it says so, or the disk has fewer than ``needed`` bytes left; None otherwise."""
    try:
        usage = shutil.disk_usage(where if where.exists() else where.parent)
    except OSError:
        usage = None
    if not _said_full(err) and (usage is None or usage.free >= needed):
        return None
    room = (
        f", {_size(usage.total)}: {_size(usage.free)} left when the save stopped"
        if usage is not None
        else ""
    )
    return f"the disk of {where.parent} is full (mounted at {_mount_point(where.parent)}{room})"


def cannot_save(step: int, full: str, newest: Path | None) -> str:
    """The one line of a save that stopped on a full disk (``full``: :func:`disk_full`'s words;
    ``newest``: the newest complete step, untouched)."""
    intact = (
        f"the newest checkpoint, {newest}, is intact and the same command resumes from it"
        if newest is not None
        else "no earlier step had been saved"
    )
    return (
        f"cannot save step {step}: {full}. Nothing of step {step} was kept and nothing saved "
        f"before was touched: {intact}. Free space there, or point checkpoint.save at a larger "
        "disk (checkpoint.keep_last=1 keeps one step)"
    )
