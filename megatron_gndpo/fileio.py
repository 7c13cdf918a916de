"""Files: writing one so that a reader, or a restart after a crash, sees the old content or the
new, never a part (the new bytes go to ``NAME.tmp`` beside it, then replace it in one rename);
and saying what a path given as a file is when it is not one (a directory, a socket, ...),
while accepting streams read once (a pipe, ``/dev/fd/N`` from the shell's ``<(...)``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same directory, one ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file, in words, or None when it can: a regular file,
    or a stream read once (a named pipe, ``/dev/stdin``, the ``/dev/fd/N`` of a shell's process
    substitution ``<(...)``)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return f"{path} is a broken symbolic link (to {os.readlink(path)})"
        return f"{path} does not exist"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"{path} is a directory, not a file"
    if stat.S_ISSOCK(mode):
        return f"{path} is a socket, not a file"
    return f"{path} is not a regular file"


def is_stream(path: str | Path) -> bool:
    """Whether ``path`` is a stream read once (a pipe or a character device), not a file."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
