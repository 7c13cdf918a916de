"""Parameter counts per rank, following megatron-core's local GPT spec exactly (the tests compare
them with real GPTModel shards at TP=1/2 and PP=2): the vocabulary padded to
``make_vocab_size_divisible_by * tp`` and split over TP, attention and MLP matrices split over
TP, norms and row-parallel biases replicated, embedding on the first stage, final norm and output
layer on the last (a tied output layer is a copy of the embedding there when PP > 1). An MoE
layer holds its router (replicated) and ``num_experts / EP`` experts, each split over TP (expert
TP = TP), plus the shared expert; expert parameters are counted apart because their optimizer
state is sharded over the expert data-parallel group (EDP), not DP x CP.
"""

from __future__ import annotations

import dataclasses

from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.parallel.groups import ParallelLayout


def _norm_params(model: ModelConfig, width: int) -> int:
    return width * (2 if model.normalization == "LayerNorm" else 1)


def _mlp_params(model: ModelConfig, ffn: int, tp: int) -> int:
    """One MLP of width ``ffn`` on one TP rank (fc1, fc2 and their biases)."""
    h = model.hidden_size
    fc1_rows = ffn * (2 if model.swiglu else 1) // tp
    bias = model.add_bias_linear
    return fc1_rows * h + (fc1_rows if bias else 0) + h * (ffn // tp) + (h if bias else 0)


def expert_layer_params(model: ModelConfig, tp: int, ep: int) -> int:
    """Routed-expert parameters of one MoE layer on one rank: ``num_experts / ep`` experts."""
    if not model.is_moe:
        return 0
    return (model.num_experts or 0) // ep * _mlp_params(model, model.expert_ffn_hidden_size, tp)


def layer_params(model: ModelConfig, tp: int, *, moe: bool = False, ep: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank (``moe``: an MoE layer, of which
    this rank holds ``num_experts / ep`` experts)."""
    h, hd = model.hidden_size, model.head_dim
    qkv_rows = (model.num_attention_heads + 2 * model.query_groups) * hd // tp
    fc1_rows = model.ffn_hidden_size * (2 if model.swiglu else 1) // tp
    has_qkv_bias = model.add_qkv_bias or model.add_bias_linear
    attention = (
        qkv_rows * h
        + (qkv_rows if has_qkv_bias else 0)
        + h * (model.num_attention_heads * hd // tp)
        + (h if model.add_bias_linear else 0)
        + (2 * _norm_params(model, hd) if model.qk_layernorm else 0)
    )
    mlp = (
        fc1_rows * h
        + (fc1_rows if model.add_bias_linear else 0)
        + h * (model.ffn_hidden_size // tp)
        + (h if model.add_bias_linear else 0)
    )
    if moe:  # router (replicated over TP) + this rank's experts + the shared expert
        shared = model.moe_shared_expert_ffn_hidden_size
        mlp = (model.num_experts or 0) * h + expert_layer_params(model, tp, ep)
        mlp += _mlp_params(model, shared, tp) if shared else 0
    return 2 * _norm_params(model, h) + attention + mlp


def _stage_layers(model: ModelConfig, layout: ParallelLayout, stage: int) -> tuple[bool, ...]:
    """Which of stage ``stage``'s layers are MoE layers."""
    per_stage = model.num_layers // layout.pp
    return model.moe_layers[stage * per_stage : (stage + 1) * per_stage]


def stage_expert_params(model: ModelConfig, layout: ParallelLayout, stage: int) -> int:
    """Routed-expert parameters held by each rank of stage ``stage`` (already divided by EP);
    part of :func:`stage_params`."""
    moe_layers = sum(_stage_layers(model, layout, stage))
    return expert_layer_params(model, layout.tp, layout.ep) * moe_layers


def stage_params(model: ModelConfig, layout: ParallelLayout, stage: int) -> int:
    """Parameters held by each rank of pipeline stage ``stage`` (an MoE layer's experts divided
    by EP)."""
    tp, pp = layout.tp, layout.pp
    vocab_shard = model.padded_vocab_size(tp) // tp * model.hidden_size
    total = sum(
        layer_params(model, tp, moe=moe, ep=layout.ep)
        for moe in _stage_layers(model, layout, stage)
    )
    if stage == 0:
        total += vocab_shard
        if model.position_embedding == "learned_absolute":
            total += model.max_position_embeddings * model.hidden_size
    if stage == pp - 1:
        total += _norm_params(model, model.hidden_size)
        if not model.tie_embeddings or pp > 1:
            total += vocab_shard
    return total


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the whole model (vocabulary unpadded, tied output counted once)."""
    unpadded = dataclasses.replace(model, make_vocab_size_divisible_by=1)
    layout = ParallelLayout(world_size=1)
    return stage_params(unpadded, layout, 0)
