"""Keep freed host memory mapped while a model computes on the CPU.

A training step on the CPU frees and allocates the same large buffers again and again (the
activations of each micro-batch, the log-prob head's ``[tokens, vocab]`` logits chunks, the
gradients). glibc's malloc serves every block above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with a fresh ``mmap`` and returns it to the kernel on ``free``, and it
trims the top of its heap as soon as 128 KiB lie free there. Each new step then faults the same
pages in again, zeroed by the kernel: on the real model's update at batch 8 that was 0.8-2.5 GB
a step, 400,000-900,000 minor faults and 4-7 s of system time on a step of ~30 s, against
1.2 s with the pages kept (benchmarks/results/real-model-cpu-2026-12-08.md). A GPU run does
not pay this: CUDA's caching allocator keeps what it freed.

:func:`reuse_freed_memory` gives the CPU the same policy for the length of a command: no mmap
for large blocks (they come from the heap) and no trimming of the heap, so a step reuses the
pages the previous one freed. The process keeps its peak footprint meanwhile (as a caching
allocator does); on exit the previous settings come back and the free pages are returned with
``malloc_trim``. Applied explicitly by the commands that build models (``train``, ``demo``,
``compress``, ``prune``), never on import; only on a machine without CUDA, and only under glibc.
``MEGATRON_GNDPO_HOST_MEMORY=release`` keeps glibc's defaults (a machine short of memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator

ENV = "MEGATRON_GNDPO_HOST_MEMORY"
# mallopt(3) parameters and glibc's defaults
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt and malloc_trim are glibc's), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only; musl and macOS lack it)
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def wanted() -> bool:
    """Whether this process should keep freed memory: computing on the CPU (no CUDA) and not
    opted out with ``MEGATRON_GNDPO_HOST_MEMORY=release``."""
    import torch

    return os.environ.get(ENV, "keep") != "release" and not torch.cuda.is_available()


@contextlib.contextmanager
def reuse_freed_memory() -> Iterator[bool]:
    """For the ``with`` block: large blocks from the heap and no heap trimming (module
    docstring). Yields whether the policy is in force (False: not glibc, CUDA present, or opted
    out). Afterwards glibc's default thresholds come back and free memory goes back to the
    kernel."""
    libc = _glibc() if wanted() else None
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, -1)):
        yield False
        return
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
