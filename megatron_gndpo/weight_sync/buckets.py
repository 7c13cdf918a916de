"""Group (name, tensor) pairs into buckets of bounded size, lazily, in order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(
    items: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``items`` holding at most ``max_bytes`` each, order kept.

    A tensor larger than ``max_bytes`` forms a bucket of its own. Only the bucket being filled
    is held, so at most one bucket (or one oversized tensor) of the input is alive at a time.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        n = nbytes(tensor)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
