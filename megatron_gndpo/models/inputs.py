"""How a model takes a micro-batch: the one place the model families' inputs differ.

A language model (GPTModel, HybridModel, with or without MoE layers) takes
``(tokens, positions, attention_mask)``; a vision-language model (megatron-core's LLaVA,
``models/vlm.py``) takes its image tiles first. Scoring, the update and the decoders build their
forward's arguments here instead of each branching on the family.
"""

from __future__ import annotations

from typing import Any

import torch


def forward_args(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    vision: bool = False,
    images: torch.Tensor | None = None,
) -> list[Any]:
    """The positional arguments of the model's forward for one micro-batch; ``vision``: a
    vision-language model, which takes ``images`` (its rows' tiles ``[N, 3, H, W]``, None when
    none of its rows has an image) first."""
    inputs: list[Any] = [tokens, positions, attention_mask]
    if vision:
        inputs.insert(0, images)
    return inputs
