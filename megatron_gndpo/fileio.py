"""Writing a file so that a reader, or a restart after a crash, sees the old content or the
new, never a part: the new bytes go to ``NAME.tmp`` beside it, then replace it in one rename."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (same directory, one ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
