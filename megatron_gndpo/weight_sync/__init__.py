"""Push the trainer's weights to the rollout engine: TP/PP gather, Hugging Face names, buckets."""

from megatron_gndpo.weight_sync.buckets import bucketed
from megatron_gndpo.weight_sync.gather import iter_hf_weights, merge_tp_shards
from megatron_gndpo.weight_sync.sync import DEFAULT_BUCKET_BYTES, WeightReceiver, sync_weights

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WeightReceiver",
    "bucketed",
    "iter_hf_weights",
    "merge_tp_shards",
    "sync_weights",
]
