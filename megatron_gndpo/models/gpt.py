"""Build a megatron-core GPTModel from a :class:`ModelConfig` on a given parallel layout.

This is the foundation's builder (local spec, any TP/PP through the layout's process groups);
the model issue extends it with the Transformer Engine spec, FP8 and SDPA core attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.parallel.groups import ParallelGroups

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> Any:
    """megatron-core's TransformerConfig for this architecture and layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if model.transformer_impl != "local":
        raise NotImplementedError(
            "transformer_impl=transformer_engine is not built yet in this version; use local"
        )
    on_cpu = not torch.cuda.is_available()
    dtype = _DTYPES[model.params_dtype]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # activations exchanged between stages
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=parallel.sequence_parallel,
        # Initialise full weights on the CPU and shard them: the same seed gives the same model
        # at every TP size (what the invariance tests compare), and it is the only path on CPU.
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only.
        bias_activation_fusion=False if on_cpu else model.swiglu,
        masked_softmax_fusion=not on_cpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=not on_cpu,
        calculate_per_token_loss=True,
    )


def build_gpt(
    model: ModelConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    *,
    parallel_output: bool = True,
) -> Any:
    """A GPTModel holding this rank's shard (its TP slice of its PP stage's layers).

    ``parallel_output=True`` keeps logits vocab-sharded ``[s, b, V/tp]`` (what the log-prob code
    wants); the vocabulary is padded to ``model.padded_vocab_size(tp)``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layout = groups.layout
    if layout.tp != parallel.tensor_parallel or layout.pp != parallel.pipeline_parallel:
        raise ValueError(
            f"the groups are for {groups.layout.describe()} but the parallel config asks for "
            f"TP={parallel.tensor_parallel} PP={parallel.pipeline_parallel}"
        )
    spec = get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm, normalization=model.normalization
    )
    gpt = GPTModel(
        config=transformer_config(model, parallel),
        transformer_layer_spec=spec,
        vocab_size=model.padded_vocab_size(parallel.tensor_parallel),
        max_sequence_length=model.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_base=int(model.rotary_base),
        pg_collection=groups.pg_collection(),
    )
    return gpt
