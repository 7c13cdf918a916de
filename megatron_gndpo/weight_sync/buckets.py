"""Group (name, tensor) pairs into buckets of bounded size, lazily, in order, whole layers each."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def layer_of(name: str) -> str:
    """The layer a Hugging Face tensor belongs to: its name up to the first numeric part (a
    transformer block, ``model.layers.3``), else its module (``model.norm``, ``lm_head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def bucketed(
    items: Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    *,
    group: Callable[[str], str] = layer_of,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``items`` holding at most ``max_bytes`` each, order kept, a layer's
    tensors (``group(name)``) never split across two runs.

    An engine that re-processes a layer after loading it (vLLM's in-place reload: fused q/k/v
    and gate/up, repacked GEMM weights) needs all of a layer's parts in one call; a layer split
    across calls keeps uninitialised memory there. A layer larger than ``max_bytes`` forms a
    bucket of its own. Only the bucket being filled and the layer being read are held. A layer
    whose tensors are not consecutive in ``items`` is an error (the producer's order is wrong).
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    layer: list[tuple[str, torch.Tensor]] = []
    key: str | None = None
    done: set[str] = set()

    def flush_layer() -> Iterator[list[tuple[str, torch.Tensor]]]:
        nonlocal bucket, size
        layer_size = sum(nbytes(t) for _, t in layer)
        if bucket and size + layer_size > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer)
        size += layer_size

    for name, tensor in items:
        k = group(name)
        if k != key:
            if key is not None:
                yield from flush_layer()
                done.add(key)
            if k in done:
                raise ValueError(
                    f"{name!r} belongs to layer {k!r}, whose other tensors came earlier: a "
                    "layer's tensors must be consecutive so that no bucket splits it"
                )
            layer, key = [], k
        layer.append((name, tensor))
    if key is not None:
        yield from flush_layer()
    if bucket:
        yield bucket
