"""A forced exit: what runs before the watchdog ends this process with ``os._exit``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import NoReturn

_ON_FORCED_EXIT: list[Callable[[], None]] = []


def on_forced_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` before the watchdog ends this process with ``os._exit`` (no ``finally``
    runs then): what must not outlive the process, such as the run directory's lock."""
    _ON_FORCED_EXIT.append(callback)


def forced_exit(code: int) -> NoReturn:
    """Run the callbacks of :func:`on_forced_exit` (newest first; a failing one is skipped),
    then end the process with ``code`` at once: no ``finally`` and no atexit handler runs."""
    while _ON_FORCED_EXIT:
        with contextlib.suppress(Exception):
            _ON_FORCED_EXIT.pop()()
    os._exit(code)
