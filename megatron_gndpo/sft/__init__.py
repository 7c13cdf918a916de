"""Supervised fine-tuning on megatron-core's schedules: ``-log p`` of the response tokens.

One loop (``sft/loop.py``) for every model family; what differs between families (how the
model is built, how a micro-batch's sequences become tensors, how the model is called on one)
sits behind :class:`~megatron_gndpo.sft.loop.SFTFamily`: ``sft/text.py`` for a language model
(GPTModel or HybridModel), ``sft/vision.py`` for a vision-language model. Each family's module
also encodes its sequences (``encode_sft``, ``encode_sft_multimodal``).
"""

from megatron_gndpo.sft.loop import (
    SFTFamily,
    SFTModel,
    build_sft_model,
    check_batching,
    drawn_rows,
    run_sft,
    sft_loss,
    sft_step,
    sft_train,
)
from megatron_gndpo.sft.text import TEXT, SFTSequence, TextFamily, encode_sft, micro_batch
from megatron_gndpo.sft.vision import VisionFamily, VisionSFTSequence, encode_sft_multimodal

__all__ = [
    "TEXT",
    "SFTFamily",
    "SFTModel",
    "SFTSequence",
    "TextFamily",
    "VisionFamily",
    "VisionSFTSequence",
    "build_sft_model",
    "check_batching",
    "drawn_rows",
    "encode_sft",
    "encode_sft_multimodal",
    "micro_batch",
    "run_sft",
    "sft_loss",
    "sft_step",
    "sft_train",
]
