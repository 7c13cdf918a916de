"""Progress bars for the rollout and update loops, shown only where someone can watch them.

A bar draws on the logging process and only when stderr is a terminal: on other ranks it would
print the same bar N times, and in a batch job's log file every redraw becomes a line. ``force``
draws it anyway (a test, or a log viewer that understands carriage returns).
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress(
    total: int | None, desc: str, enabled: bool, *, force: bool = False, **tqdm_kwargs: Any
) -> tqdm:
    """A tqdm bar to use as ``with progress(n, "rollout", is_logging_rank) as bar: bar.update(k)``.

    enabled: false on the processes that do not log; the bar is then a no-op.
    force: draw even when stderr is not a terminal (still never when ``enabled`` is false).
    tqdm_kwargs: passed on (``unit="seq"``, ``file=...``); the bar is not left on screen.
    """
    file = tqdm_kwargs.get("file") or sys.stderr
    interactive = hasattr(file, "isatty") and file.isatty()
    disable = not enabled or not (interactive or force)
    tqdm_kwargs.setdefault("leave", False)
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(total=total, desc=desc, disable=disable, **tqdm_kwargs)
