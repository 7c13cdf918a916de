"""Push the trainer's weights into a rollout engine, bucket by bucket.

Call between the optimizer update and the next rollout, on every rank of every model replica
(the gathers are collectives); ranks that host an engine pass it, the others pass None.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import Any, Protocol

import torch

from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.weight_sync.buckets import bucketed, nbytes
from megatron_gndpo.weight_sync.gather import iter_hf_weights

# Largest group of tensors handed to the engine at once: big enough that per-call overhead
# vanishes, small enough to stay a minor fraction of GPU memory next to a colocated engine.
DEFAULT_BUCKET_BYTES = 512 * 1024**2


class WeightReceiver(Protocol):
    """An engine that takes full Hugging Face-named tensors (vLLM's ``model.load_weights``).

    It may be called several times per sync with disjoint sets of names, each holding whole
    layers (:func:`~megatron_gndpo.weight_sync.buckets.bucketed`); it copies what it needs
    before returning.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


def sync_weights(
    engine: WeightReceiver | None,
    model: Any,
    groups: ParallelGroups,
    model_cfg: ModelConfig,
    *,
    family: str,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    vision: VisionConfig | None = None,
    parts: Collection[str] | None = None,
) -> dict[str, float]:
    """Load every weight of ``model`` (this replica's TP/PP shards) into ``engine``.

    ``engine`` is None on ranks that host none: they still take part in the gathers. ``dtype``
    casts before sending (the engine's dtype; None keeps the model's). A vision-language model
    passes its ``vision`` config and the ``parts`` to send (see :func:`iter_hf_weights`). Returns
    ``weight_sync/{tensors,bytes,buckets,seconds}`` (tensors and bytes are those produced
    on this rank, whether or not it loads them).
    """
    started = time.perf_counter()
    tensors = total = buckets = 0
    weights = iter_hf_weights(
        model, groups, model_cfg, family=family, dtype=dtype, vision=vision, parts=parts
    )
    for bucket in bucketed(weights, bucket_bytes):
        if engine is not None:
            engine.load_weights(bucket)
        tensors += len(bucket)
        total += sum(nbytes(t) for _, t in bucket)
        buckets += 1
        del bucket  # the engine has copied it: free before the next gathers
    return {
        "weight_sync/tensors": float(tensors),
        "weight_sync/bytes": float(total),
        "weight_sync/buckets": float(buckets),
        "weight_sync/seconds": time.perf_counter() - started,
    }
