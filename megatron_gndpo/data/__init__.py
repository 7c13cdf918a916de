"""Prompt data: tokenizers, prompt sets and the data-parallel prompt sampler.

Nothing here imports torch; ``transformers`` and ``sentencepiece`` are imported only when a
tokenizer of theirs is loaded.
"""

from megatron_gndpo.data.datasets import (
    BUILTIN_DATASETS,
    EncodedPrompt,
    PromptExample,
    encode_prompts,
    load_prompts,
)
from megatron_gndpo.data.sampler import PromptSampler
from megatron_gndpo.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    vocabulary_fingerprint,
)

__all__ = [
    "BUILTIN_DATASETS",
    "CharTokenizer",
    "EncodedPrompt",
    "HFTokenizer",
    "PromptExample",
    "PromptSampler",
    "SentencePieceTokenizer",
    "Tokenizer",
    "encode_prompts",
    "load_prompts",
    "load_tokenizer",
    "vocabulary_fingerprint",
]
