"""engine/host_memory.py: a CPU step reuses the pages the previous one freed.

Each measurement runs in a fresh interpreter: what earlier tests allocated and freed in this one
changes how glibc serves the next block."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_gndpo.engine import host_memory

pytestmark = pytest.mark.skipif(
    host_memory._glibc() is None or torch.cuda.is_available(), reason="glibc on a CPU machine"
)

_MEASURE = """
import json, resource, sys, torch
from megatron_gndpo.engine import host_memory

MB = 1 << 20

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])

def step():  # a training step's pattern: large buffers of different sizes, freed out of order
    a, b = torch.ones(64 * MB // 4), torch.ones(32 * MB // 4)
    del a
    c, d = torch.ones(60 * MB // 4), torch.ones(4 * MB // 4)
    del b, c, d

def faults(steps=3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def given_back(mb):  # a buffer larger than any before, filled and freed: pages returned
    buffer = torch.ones(mb * MB // 4)
    held = resident()
    del buffer
    return held - resident()

out = {"default": faults(), "default_back": given_back(256)}
with host_memory.reuse_freed_memory() as kept:
    out["kept"] = kept
    for _ in range(3):  # the heap grows to the steps' peak (its free blocks settle)
        faults()
    out["warm"], out["resident"] = faults(), resident()
    out["later"], out["resident_later"] = faults(), resident()
    out["kept_back"] = given_back(320)
out["after_back"] = given_back(384)
print(json.dumps(out))
"""
PAGES = 160 * (1 << 20) // 4096  # what one step allocates, in 4 KiB pages


def _measure(env: dict[str, str] | None = None) -> dict[str, int]:
    run = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, check=True, timeout=120)  # fmt: skip
    return json.loads(run.stdout.splitlines()[-1])


def test_a_step_reuses_the_pages_the_last_one_freed() -> None:
    m = _measure()
    assert m["default"] > 2 * PAGES  # glibc's default: mmap, munmap, fault the pages in again
    assert m["default_back"] > 256 * 256 // 2  # a freed 256 MB buffer leaves at once
    assert m["kept"]
    assert m["warm"] < PAGES // 20 and m["later"] < PAGES // 20  # steps fault nothing anew
    assert m["resident_later"] <= m["resident"] + PAGES // 20  # and the footprint holds
    assert m["kept_back"] < 320 * 256 // 20  # freed memory stays mapped
    assert m["after_back"] > 384 * 256 // 2  # glibc's defaults are back after the block


def test_release_keeps_glibcs_defaults() -> None:
    m = _measure({host_memory.ENV: "release"})
    assert not m["kept"]
    assert m["warm"] > 2 * PAGES
    assert m["kept_back"] > 320 * 256 // 2


def test_the_model_commands_run_under_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_gndpo import cli
    from megatron_gndpo.prune import cli as prune_cli

    entered: list[bool] = []
    real = host_memory.reuse_freed_memory

    def spy():  # type: ignore[no-untyped-def]
        entered.append(True)
        return real()

    monkeypatch.setattr(host_memory, "reuse_freed_memory", spy)
    monkeypatch.setattr(prune_cli, "main", lambda args: 0)
    assert cli.main(["config", "show"]) == 0  # builds no model: glibc's defaults
    assert not entered
    assert cli.main(["prune", "--teacher", "t", "--out", "o", "--num-layers", "2",
                     "--calib-data", "d"]) == 0  # fmt: skip
    assert entered
