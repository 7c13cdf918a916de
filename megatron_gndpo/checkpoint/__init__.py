"""Checkpoints (megatron-core dist-checkpointing, atomic, resharding) and HF conversion."""
