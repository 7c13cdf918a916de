"""Shared test helpers: the tiny megatron model most CPU tests build."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_gndpo.config.schema import ModelConfig

if TYPE_CHECKING:
    import torch

TINY_MODEL: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    make_vocab_size_divisible_by=64,
    max_position_embeddings=64,
    params_dtype="fp32",
)
"""The defaults of :func:`tiny_model`; every other field is ``ModelConfig``'s own default."""


def tiny_model(**overrides: Any) -> ModelConfig:
    """A tiny fp32 GPT config for CPU tests: 2 layers, hidden 32, FFN 64, 4 heads in 2 query
    groups, the vocabulary padded to a multiple of 64 (x TP), 64 positions.

    ``overrides`` are ``ModelConfig`` fields and win over these defaults; tests usually pass
    ``vocab_size`` and whatever else they need (``max_position_embeddings``, ``add_qkv_bias``).
    """
    return ModelConfig(**{**TINY_MODEL, **overrides})


def copy_tp_shards(
    reference: torch.nn.Module, sharded: torch.nn.Module, tp: int, rank: int, swiglu: bool
) -> None:
    """Load the TP=1 model's weights into this rank's TP shard (megatron layouts; ``swiglu``:
    fc1 stacks [gate; up], each rank holding its slice of both)."""
    import torch

    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            src = full[name]
            if not getattr(param, "tensor_model_parallel", False):
                param.copy_(src)
                continue
            dim = param.partition_dim
            if swiglu and "linear_fc1" in name:
                # [gate; up] stacked: each rank holds its slice of both halves.
                halves = [h.chunk(tp, dim)[rank] for h in src.chunk(2, dim=0)]
                param.copy_(torch.cat(halves, dim=0))
            else:
                param.copy_(src.chunk(tp, dim)[rank])
