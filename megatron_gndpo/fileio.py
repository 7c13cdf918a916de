"""Files: writing one so that a reader, or a restart after a crash, sees the old content or the
new, never a part (the new bytes go to ``NAME.tmp`` beside it, then replace it in one rename);
and saying what a path given as a file is when it is not one (a directory, a socket, ...),
while accepting streams read once (a pipe, ``/dev/fd/N`` from the shell's ``<(...)``); and
reading a JSON file that may be damaged (truncated, not JSON) into one error naming it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from megatron_gndpo.errors import DataError


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


def read_json(path: str | Path) -> Any:
    """The JSON content of file ``path``; a :class:`~megatron_gndpo.errors.DataError` naming the
    file and where it breaks when it is not JSON (a truncated download, a half-written copy)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path} is not valid JSON ({err.msg}: line {err.lineno}, column {err.colno}): the "
            "file is truncated or damaged; copy or download it again"
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a JSON text file (it is not UTF-8)") from None
