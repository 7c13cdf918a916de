"""Training machinery on megatron-core: DDP, the distributed optimizer, forward/backward."""
