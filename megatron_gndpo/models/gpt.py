"""Build megatron-core GPT models (student and teacher) from a :class:`ModelConfig`.

Each model is built on the process groups of its own layout (``ParallelGroups``), so the teacher
may use a TP/PP different from the student's on the same ranks. Layer specs:

- ``transformer_impl: transformer_engine``: megatron-core's Transformer Engine spec, with the FP8
  format, recipe and amax history passed through to the TransformerConfig. Needs the ``te``
  extra; asking for it (or for FP8) without TE is a clear error.
- ``transformer_impl: local``: megatron-core's local spec, with its core attention replaced by
  :class:`SDPAttention` (``core_attention: sdpa``, the default) or left as megatron's own.

A mixture-of-experts model (``num_experts``) uses megatron-core's MoE layer spec (router,
alltoall token dispatcher, experts: ``SequentialMLP`` in the local spec, grouped GEMM in the TE
spec); when only some layers are MoE (``moe_layer_freq`` / ``moe_layer_pattern``) this stage's
layers get the dense or the MoE spec one by one, with the same attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import torch
import torch.nn.functional as F

from megatron_gndpo.config.extras import require_package
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.parallel.groups import ParallelGroups

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _require_transformer_engine(model: ModelConfig) -> None:
    require_package(
        "transformer_engine",
        what=f"fp8={model.fp8}" if model.fp8 else "transformer_impl=transformer_engine",
        extra="te",
        instead="set transformer_impl=local and fp8=null",
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig, **overrides: Any) -> Any:
    """megatron-core's TransformerConfig for this architecture and layout.

    ``overrides``: fields another model class counts differently (``models/hybrid.py``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    use_te = model.transformer_impl == "transformer_engine"
    if use_te or model.fp8:
        _require_transformer_engine(model)
    on_cpu = not torch.cuda.is_available()
    dtype = _DTYPES[model.params_dtype]
    fp8: dict[str, Any] = {}
    if model.fp8:
        fp8 = dict(
            fp8=model.fp8,
            fp8_recipe=model.fp8_recipe,
            fp8_amax_history_len=model.fp8_amax_history_len,
        )
    fields = dict(
        **transformer_widths(model),
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # activations exchanged between stages
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=parallel.sequence_parallel,
        # Initialise full weights on the CPU and shard them: the same seed gives the same model
        # at every TP size (for models without fused gate/up rows) and it is the only path on CPU.
        # Real runs load checkpoints, so the slower init does not matter there.
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only.
        bias_activation_fusion=model.swiglu and not on_cpu,
        masked_softmax_fusion=not on_cpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=not on_cpu,
        calculate_per_token_loss=True,
        # rollout batches are ragged: pipeline stages exchange each micro-batch's shape
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # unused by dense models; megatron checks it anyway
        **fp8,
        **_moe_fields(model, parallel),
    )
    return TransformerConfig(**(fields | overrides))


def transformer_widths(arch: ModelConfig | VisionConfig) -> dict[str, Any]:
    """TransformerConfig's sizes and norm of the transformer ``arch`` describes (a language
    model, or a VLM's vision encoder), without dropout (no model here trains with any)."""
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _moe_fields(model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig's MoE fields (none for a dense model)."""
    if not model.is_moe:
        return {}
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_ffn_hidden_size or None,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_softmax_before_topk,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff or None,
        moe_expert_capacity_factor=model.moe_capacity_factor,
        moe_layer_freq=[int(x) for x in model.moe_layers],
        moe_grouped_gemm=model.transformer_impl == "transformer_engine",
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.tensor_parallel,
        # megatron's RouterReplay on every router: inert until told to record or replay
        # (models/routing.py: the sampler's experts, rollout routing replay)
        moe_enable_routing_replay=True,
    )


def layer_spec(model: ModelConfig, *, moe: bool | None = None) -> Any:
    """The transformer-layer ModuleSpec for this model (see the module docstring).

    ``moe``: the MoE layer's spec (True) or the dense one (False); None means the model's kind.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = model.num_experts if (model.is_moe if moe is None else moe) else None
    if model.transformer_impl == "transformer_engine":
        _require_transformer_engine(model)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm,
            num_experts=num_experts,
            moe_grouped_gemm=num_experts is not None,
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
        num_experts=num_experts,
        moe_grouped_gemm=False,  # grouped GEMM needs Transformer Engine; SequentialMLP here
    )
    if model.core_attention == "sdpa":
        from megatron_gndpo.models.attention import SDPAttention

        attention = spec.submodules.self_attention
        attention.submodules = dataclasses.replace(
            attention.submodules, core_attention=SDPAttention
        )
    return spec


def stage_layer_spec(model: ModelConfig, parallel: ParallelConfig, stage: int) -> Any:
    """What GPTModel takes as its layer spec on pipeline stage ``stage``: one ModuleSpec when
    every layer is alike, else this stage's layers one by one (dense or MoE)."""
    kinds = model.moe_layers
    if all(kinds) or not any(kinds):
        return layer_spec(model)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    per_stage = model.num_layers // parallel.pipeline_parallel
    mine = kinds[stage * per_stage : (stage + 1) * per_stage]
    specs = {kind: layer_spec(model, moe=kind) for kind in set(mine)}
    return TransformerBlockSubmodules(
        layer_specs=[specs[k] for k in mine], layer_norm=final_norm_spec(model)
    )


def final_norm_spec(model: ModelConfig) -> Any:
    """The decoder's final norm: what megatron's own block spec (``get_gpt_decoder_block_spec``)
    puts there (TE fuses the layers' input norms into their first linear, so it names TENorm
    itself; the local spec's layers hold the norm a block uses)."""
    if model.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return layer_spec(model, moe=False).submodules.input_layernorm


def check_layout(parallel: ParallelConfig, groups: ParallelGroups) -> None:
    """Refuse process groups built for another layout than ``parallel``."""
    layout = groups.layout
    if (layout.tp, layout.pp, layout.ep) != (
        parallel.tensor_parallel,
        parallel.pipeline_parallel,
        parallel.expert_parallel,
    ):
        raise ValueError(
            f"the groups are for {groups.layout.describe()} but the parallel config asks for "
            f"TP={parallel.tensor_parallel} PP={parallel.pipeline_parallel} "
            f"EP={parallel.expert_parallel}"
        )


def build_gpt(
    model: ModelConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    *,
    parallel_output: bool = True,
) -> Any:
    """A GPTModel holding this rank's shard (its TP slice of its PP stage's layers).

    ``parallel_output=True`` keeps logits vocab-sharded ``[b, s, V/tp]`` (what the log-prob code
    wants); the vocabulary is padded to ``model.padded_vocab_size(tp)``.
    """
    from megatron.core.models.gpt import GPTModel

    if model.model_class != "gpt":
        raise ValueError(
            f"build_gpt builds GPTModels, and this model has model_class={model.model_class}: "
            "build it with megatron_gndpo.models.build.build_model"
        )
    common = language_model_args(model, parallel, groups, parallel_output=parallel_output)
    scaling: dict[str, Any] = {}
    if model.rotary_scaling_factor is not None:
        scaling = dict(rope_scaling=True, rope_scaling_factor=model.rotary_scaling_factor)
    return GPTModel(
        config=transformer_config(model, parallel),
        transformer_layer_spec=stage_layer_spec(model, parallel, groups.coords["pp"]),
        **common,
        **scaling,
    )


class LanguageModelArgs(TypedDict):
    """The arguments every language model class takes alike (GPTModel, HybridModel, the VLM's
    language model): vocabulary, positions, tying, this rank's pipeline stage and its groups."""

    vocab_size: int  # padded to a multiple of make_vocab_size_divisible_by x TP
    max_sequence_length: int
    pre_process: bool  # this rank's stage is the first (it holds the embedding)
    post_process: bool  # ... the last (it holds the output layer)
    parallel_output: bool
    share_embeddings_and_output_weights: bool
    position_embedding_type: str
    rotary_base: int
    pg_collection: Any


def language_model_args(
    model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, *, parallel_output: bool
) -> LanguageModelArgs:
    """:class:`LanguageModelArgs` of ``model`` on this rank, after checking that ``groups`` were
    built for ``parallel``."""
    check_layout(parallel, groups)
    return LanguageModelArgs(
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


def freeze(model: Any) -> Any:
    """``model`` as a teacher: eval mode, no gradients (so no optimizer state)."""
    model.eval()
    model.requires_grad_(False)
    return model


def build_teacher(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups) -> Any:
    """A frozen GPTModel teacher on its own layout (``models.build.build_teacher`` builds the
    class ``model.model_class`` names)."""
    return freeze(build_gpt(model, parallel, groups))
