"""The names Megatron-Bridge's import touches (peft/lora_layers.py), none of them usable."""

import types as _types


class _Missing:
    def __init__(self, *a: object, **k: object) -> None:
        raise RuntimeError("Transformer Engine is a stub on this machine")


Linear = LayerNormLinear = GroupedLinear = _Missing
ops = _types.SimpleNamespace(
    Sequential=_Missing, LayerNorm=_Missing, RMSNorm=_Missing, Quantize=_Missing,
    BasicLinear=_Missing,
)  # fmt: skip
