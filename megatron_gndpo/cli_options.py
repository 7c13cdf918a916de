"""Command-line options as data, shared by the commands' parsers (``cli.py``, ``prune/cli.py``,
``checkpoint/convert_cli.py``).

An :class:`Option` is one ``add_argument``: the flag, its help and only the keywords it needs
(:func:`option`); :func:`add_options` adds a command's options in order, so a command's options
read as one table.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: ``parser.add_argument(flag, help=help, **settings)``."""

    flag: str
    help: str
    settings: dict[str, Any]


def option(flag: str, help: str, **settings: Any) -> Option:
    """An :class:`Option`; ``settings`` are ``add_argument``'s (type, default, choices, action,
    required, ...)."""
    return Option(flag, help, settings)


def add_options(parser: argparse._ActionsContainer, *options: Option) -> None:
    """Add ``options`` to ``parser`` (or to one of its groups), in order."""
    for o in options:
        parser.add_argument(o.flag, help=o.help, **o.settings)
