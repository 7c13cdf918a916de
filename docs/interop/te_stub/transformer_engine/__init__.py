"""A stand-in for Transformer Engine so megatron.bridge imports on a CPU-only machine
(megatron/bridge/peft/lora_layers.py imports transformer_engine.pytorch unconditionally).
Import megatron.core before this is on sys.path: megatron-core must see no TE."""
