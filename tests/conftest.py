"""Test-session settings and fixtures shared by every test file.

Shared helpers that run inside spawned ranks (which fixtures cannot reach) live in plain
modules: ``tests/harness.py`` (multi-process runs), ``tests/trainers.py`` (trainers on the tiny
CPU example), ``tests/tiny.py`` (tiny model configs), ``tests/internvl.py`` (a tiny InternVL and
prompts with images). No test module imports another test module's private names.

With ``MEGATRON_GNDPO_NO_SKIPS=1`` (CI sets it once every test dependency is installed there:
setup.py's ``test`` extra, and shellcheck from Debian) a test skipped because a package or tool
is missing fails instead, naming what to install: otherwise a missing install step hides behind
a green run. Skips for hardware or engines CI does not have (tests marked ``gpu``, ``vllm``,
``slurm``) and skips because something *is* installed stay skips. A test marked ``real`` skipped
because the real-model tier was not fetched (``tests/real.py``) fails too, whatever its other
markers: CI fetches it. ``pytest -ra`` lists every skip in the summary either way.

Measurements the ``real`` tests take (log-prob differences, timings) are printed in a section of
the terminal summary, ``real-model measurements`` (the ``real_report`` fixture), so CI's log
shows them on a passing run too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from typing import Any

import pytest
import torch

from tests import real

STRICT_ENV = "MEGATRON_GNDPO_NO_SKIPS"
# How skips for an absent package read: pytest.importorskip's reason, and this project's
# "X is not installed" reasons.
_MISSING = re.compile(r"could not import|no module named|\bnot installed", re.IGNORECASE)
_OTHER_TIERS = ("gpu", "vllm", "slurm")


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").lower() in ("1", "true", "yes")


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _strict()):
        return
    reason = _reason(report)
    if item.get_closest_marker("real") and real.ABSENT in reason:
        report.outcome = "failed"
        report.longrepr = (
            f"{reason.removeprefix('Skipped: ')}; and {STRICT_ENV} is set: the real-model tier "
            "is part of this run (.ci/run fetches it)"
        )
        return
    if any(item.get_closest_marker(tier) for tier in _OTHER_TIERS):
        return
    if _MISSING.search(reason):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped for a missing package or tool ({reason.removeprefix('Skipped: ')}), "
            f"and {STRICT_ENV} is set: install it where the tests run (setup.py's test extra, "
            "or the system package)"
        )


@pytest.fixture(scope="module")
def one_thread() -> Generator[None, None, None]:
    """One torch thread for a module of tiny tensors: OpenMP hand-offs between threads would
    dominate, and on a loaded 2-core machine they cost ~10 ms per op (the harness's ranks use
    one thread too). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_REAL_REPORT = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def real_report(request: pytest.FixtureRequest) -> list[str]:
    """Lines a ``real`` test measured (one line each); printed in the terminal summary."""
    return request.config.stash.setdefault(_REAL_REPORT, [])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(_REAL_REPORT, [])
    if lines:
        terminalreporter.section("real-model measurements")
        for line in lines:
            terminalreporter.write_line(line)
