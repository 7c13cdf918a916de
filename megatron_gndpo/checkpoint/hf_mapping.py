"""Hugging Face <-> megatron-core GPTModel: configs, parameter names and tensor layouts.

One mapping shared by checkpoint conversion and the weight sync into vLLM, for both model
classes: names are GPTModel's, and a HybridModel's parameters are named so by
:func:`global_names` (``models/naming.py``). Pure torch: nothing here imports megatron-core.

Supported Hugging Face families (``model_type``): ``llama`` (incl. Llama-3.1 ``llama3`` RoPE
scaling), ``qwen2`` (Qwen2 / Qwen2.5: QKV bias), ``qwen3`` (per-head RMSNorm on queries and
keys, explicit ``head_dim``) and ``qwen3_moe`` (Qwen3's attention with mixture-of-experts MLPs,
whose router and experts :mod:`~megatron_gndpo.checkpoint.hf_moe` maps). All share the
parameter names below; the family only decides which optional tensors exist.

Names are those of the *full* model (TP=1, all layers, global layer index). megatron-core's
local spec is the reference naming; Transformer Engine's fused-norm names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) are accepted as aliases.

Layouts (legend: H hidden, nh query heads, ng KV heads, hd head dim, F ffn width,
V vocabulary, Vp padded vocabulary)::

    megatron                              Hugging Face
    embedding.word_embeddings.weight      model.embed_tokens.weight     [Vp, H] <-> [V, H]
    decoder.layers.i.input_layernorm      model.layers.i.input_layernorm
    ...self_attention.linear_qkv.weight   self_attn.{q,k,v}_proj.weight  (see below)
    ...self_attention.linear_qkv.bias     self_attn.{q,k,v}_proj.bias    (qwen2)
    ...self_attention.q_layernorm.weight  self_attn.q_norm.weight        [hd] (qwen3)
    ...self_attention.k_layernorm.weight  self_attn.k_norm.weight        [hd] (qwen3)
    ...self_attention.linear_proj.weight  self_attn.o_proj.weight        [H, nh*hd]
    ...pre_mlp_layernorm.weight           post_attention_layernorm.weight
    ...mlp.linear_fc1.weight              mlp.{gate,up}_proj.weight      [2F, H] = [gate; up]
    ...mlp.linear_fc2.weight              mlp.down_proj.weight           [H, F]
    decoder.final_layernorm.weight        model.norm.weight
    output_layer.weight                   lm_head.weight                 (untied only)

megatron's ``linear_qkv`` is grouped per KV head: ``[ng * (nh/ng + 2) * hd, H]`` where group g
holds its nh/ng query heads, then k_g, then v_g. Tensor parallelism splits it along dim 0 by
whole groups, so a TP shard is a contiguous slice (``ng % tp == 0``). The embedding and output
layer are padded with zero rows to Vp on import and trimmed to V on export.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

import torch

from megatron_gndpo.checkpoint import hf_moe
from megatron_gndpo.config.schema import Dtype, ModelConfig
from megatron_gndpo.errors import ConversionError
from megatron_gndpo.models import naming

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": hf_moe.ARCHITECTURE,
}
_HF_DTYPES: dict[str, Dtype] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DTYPE_NAMES = {v: k for k, v in _HF_DTYPES.items()}
# transformers' own defaults where a config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768}
_QWEN3_DEFAULT_HEAD_DIM = 128
# megatron-core's RotaryEmbedding._apply_scaling hard-codes these Llama-3.1 values; only the
# factor is configurable there, so a checkpoint that differs cannot be represented.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
# Keys whose presence (with a non-trivial value) marks a mixture-of-experts model.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# HF tensors that carry no weights (old Llama checkpoints store the RoPE frequencies).
_IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Transformer Engine fuses the pre-attention and pre-MLP norms into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

Kind = Literal["copy", "qkv", "fc1", "vocab"]


# ---------------------------------------------------------------------------------------------
# Configs


def _family_of(hf_config: Mapping[str, Any]) -> str:
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(
            f"unsupported Hugging Face model_type {model_type!r}: conversion supports "
            f"{', '.join(FAMILIES)} (Llama, Qwen2/Qwen2.5, Qwen3 dense models and Qwen3-MoE)"
        )
    return str(model_type)


def _required(hf_config: Mapping[str, Any], key: str) -> Any:
    if hf_config.get(key) is None:
        raise ConversionError(
            f"the Hugging Face config has no {key!r}; it is required for conversion"
        )
    return hf_config[key]


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope theta, llama3 scaling factor or None) from old- or new-style (v5) config keys."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(
            f"unsupported RoPE scaling {rope_type!r}: conversion supports plain RoPE and "
            "Llama-3.1 'llama3' scaling"
        )
    for key, value in _LLAMA3_FIXED.items():
        if float(scaling.get(key, value)) != value:
            raise ConversionError(
                f"unsupported llama3 RoPE scaling {key}={scaling[key]}: megatron-core fixes it "
                f"at {value} (only the factor is configurable)"
            )
    return theta, float(scaling["factor"])


def _check_features(hf_config: Mapping[str, Any], family: str) -> None:
    """Reject what the megatron model cannot represent instead of dropping it silently."""
    for key in _MOE_KEYS if family != hf_moe.FAMILY else ():
        if hf_config.get(key):
            raise ConversionError(
                f"unsupported mixture-of-experts config ({key}={hf_config[key]}) in a {family} "
                f"config: mixture-of-experts conversion supports {hf_moe.FAMILY} (Qwen3-MoE)"
            )
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(
            f"unsupported hidden_act {act!r}: only SwiGLU (silu) MLPs are supported"
        )
    if family in ("llama", "qwen3", "qwen3_moe") and hf_config.get("attention_bias"):
        raise ConversionError(
            f"unsupported attention_bias=true for {family}: it adds biases to q/k/v *and* o_proj, "
            "which the megatron model does not build"
        )
    if hf_config.get("mlp_bias"):
        raise ConversionError(
            "unsupported mlp_bias=true: the megatron model builds MLPs without bias"
        )
    layer_types = hf_config.get("layer_types") or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if not layer_types and hf_config.get("use_sliding_window") and hf_config.get("sliding_window"):
        first = int(hf_config.get("max_window_layers", 0))
        sliding = list(range(first, int(_required(hf_config, "num_hidden_layers"))))
    if sliding:
        raise ConversionError(
            f"unsupported sliding-window attention in layers {sliding}: the megatron model "
            "attends over the full context (set use_sliding_window=false only if the model was "
            "trained without it)"
        )


def model_config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (llama, qwen2, qwen3,
    qwen3_moe).

    Unsupported model types and features (MoE outside qwen3_moe, shared experts, sliding-window
    attention in use, biases the megatron model lacks, RoPE scalings other than llama3) are a
    ConversionError (a ValueError) naming them.
    """
    family = _family_of(hf_config)
    _check_features(hf_config, family)
    hidden = int(_required(hf_config, "hidden_size"))
    heads = int(_required(hf_config, "num_attention_heads"))
    layers = int(_required(hf_config, "num_hidden_layers"))
    moe = hf_moe.model_fields(hf_config, layers) if family == hf_moe.FAMILY else {}
    default_head_dim = _QWEN3_DEFAULT_HEAD_DIM if family == "qwen3" else hidden // heads
    head_dim = int(hf_config.get("head_dim") or default_head_dim)
    theta, scaling = _rope(hf_config)
    dtype_name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    if dtype_name not in _HF_DTYPES:
        raise ConversionError(
            f"unsupported torch_dtype {dtype_name!r}; use one of {list(_HF_DTYPES)}"
        )
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(_required(hf_config, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        kv_channels=None if head_dim * heads == hidden else head_dim,
        vocab_size=int(_required(hf_config, "vocab_size")),
        max_position_embeddings=int(
            hf_config.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[family]
        ),
        position_embedding="rope",
        rotary_base=theta,
        rotary_scaling_factor=scaling,
        normalization="RMSNorm",
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        add_qkv_bias=family == "qwen2",
        add_bias_linear=False,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
        params_dtype=_HF_DTYPES[dtype_name],
        **moe,
    )


def check_family(model: ModelConfig, family: str) -> None:
    """Raise a ConversionError (a ValueError) unless ``model`` is exactly representable as a
    ``family`` model."""
    if family not in FAMILIES:
        raise ConversionError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    problems = []
    if not model.swiglu:
        problems.append("swiglu=false (HF families use SwiGLU MLPs)")
    if model.normalization != "RMSNorm":
        problems.append(f"normalization={model.normalization} (HF families use RMSNorm)")
    if model.position_embedding != "rope":
        problems.append(f"position_embedding={model.position_embedding} (HF families use rope)")
    if model.add_bias_linear:
        problems.append("add_bias_linear=true (no HF family has o_proj/MLP biases)")
    if family == hf_moe.FAMILY:
        problems += hf_moe.family_problems(model)
    else:
        if model.add_qkv_bias != (family == "qwen2"):
            problems.append(
                f"add_qkv_bias={model.add_qkv_bias} (qwen2 has QKV bias, others do not)"
            )
        if model.qk_layernorm != (family == "qwen3"):
            problems.append(f"qk_layernorm={model.qk_layernorm} (only qwen3 has QK-norm)")
        if model.is_moe:
            problems.append(
                f"num_experts={model.num_experts} (a mixture-of-experts model: use family "
                f"{hf_moe.FAMILY})"
            )
    if model.rotary_scaling_factor is not None and family != "llama":
        problems.append("rotary_scaling_factor is set (llama3 RoPE scaling is a llama feature)")
    if problems:
        raise ConversionError(
            f"this model cannot be expressed as a {family} checkpoint: {'; '.join(problems)}"
        )


def hf_config_from_model(model: ModelConfig, family: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``model`` as a ``family`` (llama, qwen2, qwen3,
    qwen3_moe).

    Written in the long-standing key style (``rope_theta``, ``rope_scaling``, ``torch_dtype``),
    which transformers 4.x, 5.x and vLLM all read.
    """
    check_family(model, family)
    rope_scaling = None
    if model.rotary_scaling_factor is not None:
        rope_scaling = {"rope_type": "llama3", "factor": model.rotary_scaling_factor}
        rope_scaling |= _LLAMA3_FIXED
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": model.init_method_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES[model.params_dtype],
    }
    if family == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    else:
        if family in ("qwen3", "qwen3_moe"):
            config["attention_bias"] = False
        config |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": model.num_layers,
        }
    if family == hf_moe.FAMILY:
        config |= hf_moe.hf_config_fields(model)
    return config


# ---------------------------------------------------------------------------------------------
# Parameter mapping


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """One megatron parameter and the Hugging Face tensor(s) it is made of.

    ``kind`` names the layout change: ``copy`` (same tensor), ``qkv`` (q, k, v interleaved per
    KV group, weight or bias), ``fc1`` (``[gate; up]``), ``vocab`` (rows padded / trimmed).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind

    def to_megatron(
        self, tensors: Sequence[torch.Tensor], model: ModelConfig, *, padded_vocab: int
    ) -> torch.Tensor:
        """The full (TP=1) megatron tensor from the HF tensors named in ``hf`` (same order)."""
        if len(tensors) != len(self.hf):
            raise ConversionError(
                f"{self.megatron} needs {len(self.hf)} tensors, got {len(tensors)}"
            )
        if self.kind == "copy":
            return tensors[0]
        if self.kind == "qkv":
            return _qkv_to_megatron(tensors, model, self.megatron)
        if self.kind == "fc1":
            return torch.cat(list(tensors), dim=0)
        return _pad_vocab(tensors[0], model.vocab_size, padded_vocab, self.hf[0])

    def to_hf(self, tensor: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
        """The HF tensors (in ``hf`` order) from the full (TP=1) megatron tensor."""
        if self.kind == "copy":
            return (tensor,)
        if self.kind == "qkv":
            return _qkv_to_hf(tensor, model)
        if self.kind == "fc1":
            gate, up = tensor.chunk(2, dim=0)
            return gate, up
        if tensor.shape[0] < model.vocab_size:
            raise ConversionError(
                f"{self.megatron} has {tensor.shape[0]} rows, fewer than vocab_size "
                f"{model.vocab_size}"
            )
        return (tensor[: model.vocab_size],)


# Per layer: (megatron suffix, HF suffixes, kind, ModelConfig flag that must be set or None).
_LAYER_TABLE: tuple[tuple[str, tuple[str, ...], Kind, str | None], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "copy", None),
    ("self_attention.linear_qkv.weight",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv",
     None),
    ("self_attention.linear_qkv.bias",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv",
     "add_qkv_bias"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy", "qk_layernorm"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy", "qk_layernorm"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy", None),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy", None),
)  # fmt: skip
# A dense layer's MLP (an MoE layer's router and experts: hf_moe.layer_mappings).
_DENSE_MLP_TABLE: tuple[tuple[str, tuple[str, ...], Kind, str | None], ...] = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1", None),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy", None),
)  # fmt: skip


def _layer_mappings(model: ModelConfig, layer: int) -> list[WeightMapping]:
    mg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    moe = model.moe_layers[layer] if 0 <= layer < model.num_layers else False
    table = _LAYER_TABLE + (() if moe else _DENSE_MLP_TABLE)
    mappings = [
        WeightMapping(mg + suffix, tuple(hf + h for h in hf_suffixes), kind)
        for suffix, hf_suffixes, kind, flag in table
        if flag is None or getattr(model, flag)
    ]
    if moe:
        mappings += [WeightMapping(*m) for m in hf_moe.layer_mappings(model, layer)]
    return mappings


def _embedding_mapping() -> WeightMapping:
    return WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                         "vocab")  # fmt: skip


def _output_mapping(model: ModelConfig) -> WeightMapping:
    # Tied: megatron's last pipeline stage keeps its own copy of the embedding as output_layer.
    source = "model.embed_tokens.weight" if model.tie_embeddings else "lm_head.weight"
    return WeightMapping("output_layer.weight", (source,), "vocab")


def iter_mappings(
    model: ModelConfig, *, layers: Iterable[int] | None = None
) -> Iterator[WeightMapping]:
    """The mappings of the full model (TP=1, PP=1): embedding, layer by layer, final norm, output.

    ``layers`` restricts the transformer layers (global indices; ``()`` for none). A tied model
    has no ``output_layer`` entry (a TP=1/PP=1 megatron model allocates none); see
    :func:`mapping_for` for the copy a last pipeline stage holds.
    """
    _check_mappable(model)
    yield _embedding_mapping()
    for layer in range(model.num_layers) if layers is None else layers:
        yield from _layer_mappings(model, layer)
    yield WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy")
    if not model.tie_embeddings:
        yield _output_mapping(model)


def global_names(
    net: torch.nn.Module, layers: str = "decoder.layers.", *, expert_offset: int = 0
) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, full-model name, parameter) for this rank's parameters.

    Full-model names are GPTModel's: a HybridModel's are translated (``models/naming.py``), so
    every user of this mapping serves both model classes.
    A pipeline stage numbers its layers from 0; ``layer_number`` (1-based) is global. ``layers``:
    where the decoder's layers sit (``language_model.decoder.layers.`` in a VLM, whose vision
    encoder is never split over stages). ``expert_offset``: the global index of this rank's
    first expert (``ep_rank * experts_per_rank``; :func:`expert_offset`).
    """
    owner: Any = net
    for attr in layers.rstrip(".").split("."):
        owner = getattr(owner, attr, None)
    offsets = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(owner or [])}
    hybrid = naming.model_class_of(net) == "hybrid"
    for name, param in net.named_parameters():
        full = name
        if name.startswith(layers):
            local, rest = name.removeprefix(layers).split(".", 1)
            full = f"{layers}{offsets[local]}.{rest}"
        if hybrid:
            full = naming.to_gpt(full)
        yield name, hf_moe.global_expert_name(full, expert_offset), param


def expert_offset(model: ModelConfig, layout: Any, rank: int) -> int:
    """The global index of the first expert rank ``rank`` of ``layout`` (a ParallelLayout) holds
    (0 for a dense model)."""
    if not model.is_moe:
        return 0
    ep_rank = int(layout.expert_coords(rank)["ep"])
    return ep_rank * hf_moe.experts_per_rank(model, layout.ep)


def canonical_name(megatron_name: str) -> str:
    """A megatron parameter name in local-spec form (Transformer Engine fused-norm aliases)."""
    match = _LAYER.fullmatch(megatron_name)
    if match and match.group(2) in _TE_ALIASES:
        return f"decoder.layers.{match.group(1)}.{_TE_ALIASES[match.group(2)]}"
    return megatron_name


def is_extra_state(megatron_name: str) -> bool:
    """megatron's ``_extra_state`` entries (FP8 metadata): not weights, never converted."""
    return megatron_name.endswith("._extra_state")


def mapping_for(megatron_name: str, model: ModelConfig) -> WeightMapping:
    """The mapping of one full-model megatron parameter (global layer index).

    Also covers ``output_layer.weight`` of a tied model, which the last pipeline stage holds.
    """
    name = canonical_name(megatron_name)
    match = _LAYER.fullmatch(name)
    if match:
        candidates = _layer_mappings(model, int(match.group(1)))
    elif name == "output_layer.weight":
        candidates = [_output_mapping(model)]
    else:
        candidates = list(iter_mappings(model, layers=()))
    for mapping in candidates:
        if mapping.megatron == name:
            return dataclasses.replace(mapping, megatron=megatron_name)
    raise ConversionError(
        f"no Hugging Face mapping for megatron parameter {megatron_name!r}; the model config "
        "(qkv bias, qk-norm, tied embeddings, experts and MoE layers) may not match the "
        "checkpoint"
    )


def expected_hf_names(model: ModelConfig) -> set[str]:
    """Every tensor name a Hugging Face checkpoint of ``model`` holds."""
    return table_hf_names(LanguageTable(model))


def check_hf_names(names: Iterable[str], model: ModelConfig, *, where: str = "") -> None:
    """Missing tensors, and tensors the megatron model would drop, are ConversionErrors naming them.

    A tied model's checkpoint may still hold ``lm_head.weight``; it is ignored.
    """
    check_table_names(LanguageTable(model), names, where=where)


def _check_mappable(model: ModelConfig) -> None:
    if not model.swiglu or model.normalization != "RMSNorm" or model.add_bias_linear:
        raise ConversionError(
            "only SwiGLU + RMSNorm models without linear biases map to Hugging Face "
            f"(got swiglu={model.swiglu}, normalization={model.normalization}, "
            f"add_bias_linear={model.add_bias_linear})"
        )
    if model.query_groups == 0 or model.num_attention_heads % model.query_groups:
        raise ConversionError(
            f"num_attention_heads ({model.num_attention_heads}) must be a multiple of "
            f"num_query_groups ({model.query_groups})"
        )


# ---------------------------------------------------------------------------------------------
# Layout transforms


def _qkv_to_megatron(
    tensors: Sequence[torch.Tensor], model: ModelConfig, name: str
) -> torch.Tensor:
    q, k, v = tensors
    ng, hd = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // ng
    expected = {"q": ng * per_group * hd, "k": ng * hd, "v": ng * hd}
    for label, t in zip("qkv", tensors, strict=True):
        if t.shape[0] != expected[label]:
            raise ConversionError(
                f"{name}: the {label} projection has {t.shape[0]} rows, expected "
                f"{expected[label]} ({model.num_attention_heads} heads, {ng} KV heads, head dim "
                f"{hd}); check num_key_value_heads and head_dim in config.json"
            )
    rest = q.shape[1:]  # (H,) for weights, () for biases
    grouped = torch.cat(
        [
            q.reshape(ng, per_group, hd, *rest),
            k.reshape(ng, 1, hd, *rest),
            v.reshape(ng, 1, hd, *rest),
        ],
        dim=1,
    )  # [ng, nh/ng + 2, hd, (H)]
    return grouped.reshape(ng * (per_group + 2) * hd, *rest)


def _qkv_to_hf(
    tensor: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // ng
    rest = tensor.shape[1:]
    grouped = tensor.reshape(ng, per_group + 2, hd, *rest)
    q = grouped[:, :per_group].reshape(ng * per_group * hd, *rest)
    k = grouped[:, per_group].reshape(ng * hd, *rest)
    v = grouped[:, per_group + 1].reshape(ng * hd, *rest)
    return q, k, v


def _pad_vocab(tensor: torch.Tensor, vocab: int, padded: int, name: str) -> torch.Tensor:
    if tensor.shape[0] != vocab:
        raise ConversionError(
            f"{name} has {tensor.shape[0]} rows but config.json says vocab_size={vocab}"
        )
    if padded < vocab:
        raise ConversionError(f"padded vocabulary {padded} is smaller than vocab_size {vocab}")
    if padded == vocab:
        return tensor
    pad = tensor.new_zeros(padded - vocab, *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


# ---------------------------------------------------------------------------------------------
# Whole state dicts and TP shards


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], model: ModelConfig, *, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """Full megatron (TP=1, PP=1) state dict from a full Hugging Face one.

    ``_extra_state`` entries are not produced: leave the megatron model's own in place
    (``load_state_dict(strict=False)`` or fill parameters one by one). Fused experts
    (transformers 5's in-memory Qwen3-MoE form) are split first.
    """
    hf_state = hf_moe.split_fused_experts(hf_state.items())
    return table_to_megatron(LanguageTable(model), hf_state, padded_vocab=padded_vocab)


def iter_megatron_to_hf(
    mcore_state: Mapping[str, Any], model: ModelConfig, *, consume: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from a full megatron state dict, one mapping at a time.

    With ``consume=True`` (and a mutable mapping) each megatron tensor is removed once mapped,
    so a caller that writes and drops what it receives never holds two full copies.
    """
    yield from table_to_hf(LanguageTable(model), mcore_state, consume=consume)


def megatron_to_hf(
    mcore_state: Mapping[str, Any], model: ModelConfig, *, family: str
) -> dict[str, torch.Tensor]:
    """Full Hugging Face state dict from a full megatron (TP=1, PP=1) one; vocabulary trimmed.

    ``_extra_state`` entries are skipped; a tied model gets no ``lm_head.weight``.
    """
    check_family(model, family)
    return dict(iter_megatron_to_hf(mcore_state, model))


def shard_for_rank(
    name: str, full: torch.Tensor, param: Any, *, tp: int, tp_rank: int, swiglu: bool
) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor, shaped like ``param``.

    Uses the parameter's ``tensor_model_parallel`` / ``partition_dim`` attributes. A gated
    ``linear_fc1`` holds ``[gate; up]``: each rank takes its slice of both halves. Linear QKV is
    grouped per KV head, so a plain dim-0 slice is whole groups. A shape mismatch is a
    ConversionError naming the parameter and both shapes.
    """
    shard = full
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        dim = int(param.partition_dim)
        if full.shape[dim] % tp:
            raise ConversionError(
                f"{name}: dim {dim} of the full tensor {tuple(full.shape)} does not divide by "
                f"TP={tp}"
            )
        if swiglu and ".linear_fc1." in name:  # a dense MLP's or an expert's
            halves = full.chunk(2, dim=0)
            shard = torch.cat([h.chunk(tp, dim=dim)[tp_rank] for h in halves], dim=0)
        else:
            shard = full.chunk(tp, dim=dim)[tp_rank]
    if tuple(shard.shape) != tuple(param.shape):
        raise ConversionError(
            f"{name}: the converted tensor has shape {tuple(shard.shape)} (full "
            f"{tuple(full.shape)}, TP={tp}) but the model's parameter has {tuple(param.shape)}; "
            "config.json and the weights disagree"
        )
    return shard


# ---------------------------------------------------------------------------------------------
# The one walk over a model family's table (this module's for a language model, vlm_mapping's
# for a VLM, which adds its vision tower and projector to the language model's)


class Mapped(Protocol):
    """One megatron parameter and the Hugging Face tensors it is made of (any family's)."""

    @property
    def megatron(self) -> str: ...

    @property
    def hf(self) -> tuple[str, ...]: ...


class MappingTable[M: Mapped](Protocol):
    """A model family's parameters, their layouts and what its HF checkpoints may hold
    besides; read by :func:`check_table_names`, :func:`table_to_megatron`,
    :func:`table_to_hf` and conversion's shard filling."""

    subject: ClassVar[str]  # the megatron side in messages: "megatron model"
    names_hint: ClassVar[str]  # what a missing HF tensor says about config.json
    config_hint: ClassVar[str]  # what an unmapped megatron parameter says about the config
    ignored_hf: ClassVar[re.Pattern[str]]  # HF tensors that carry no weights

    def mappings(self) -> list[M]:
        """Every mapping of the full model (TP=1, PP=1), in checkpoint order."""
        ...

    def mapping_for(self, megatron_name: str) -> M:
        """The mapping of one full-model parameter (global layer index)."""
        ...

    def to_megatron(
        self, m: M, tensors: Sequence[torch.Tensor], *, padded_vocab: int
    ) -> torch.Tensor:
        """The full (TP=1) megatron tensor of ``m`` from its HF tensors."""
        ...

    def to_hf(self, m: M, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``m``'s HF tensors from its full (TP=1) megatron tensor."""
        ...

    def gated(self, m: M) -> bool:
        """Whether ``m``'s TP shards hold ``[gate_r; up_r]`` (:func:`shard_for_rank`)."""
        ...

    def canonical_hf(self, name: str) -> str:
        """An HF tensor name as the table names it (another form a loader may use, undone)."""
        ...

    def unused_hf(self) -> set[str]:
        """HF tensors a checkpoint may hold that no parameter reads (a tied ``lm_head``)."""
        ...

    def unused_megatron(self) -> set[str]:
        """Megatron parameters that are no HF tensor (a tied model's last-stage output copy)."""
        ...


@dataclasses.dataclass(frozen=True)
class LanguageTable:
    """The table of a language model (GPTModel names; :func:`global_names` gives a
    HybridModel's so)."""

    model: ModelConfig
    subject: ClassVar[str] = "megatron model"
    names_hint: ClassVar[str] = (
        "layers, qkv bias, qk-norm, tie_word_embeddings, num_experts, mlp_only_layers"
    )
    config_hint: ClassVar[str] = "the model config"
    ignored_hf: ClassVar[re.Pattern[str]] = _IGNORED_HF

    def mappings(self) -> list[WeightMapping]:
        return list(iter_mappings(self.model))

    def mapping_for(self, megatron_name: str) -> WeightMapping:
        return mapping_for(megatron_name, self.model)

    def to_megatron(
        self, m: WeightMapping, tensors: Sequence[torch.Tensor], *, padded_vocab: int
    ) -> torch.Tensor:
        return m.to_megatron(tensors, self.model, padded_vocab=padded_vocab)

    def to_hf(self, m: WeightMapping, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return m.to_hf(tensor, self.model)

    def gated(self, m: WeightMapping) -> bool:
        return self.model.swiglu  # shard_for_rank splits only linear_fc1 (dense or expert)

    def canonical_hf(self, name: str) -> str:
        return name

    def unused_hf(self) -> set[str]:
        return {"lm_head.weight"} if self.model.tie_embeddings else set()

    def unused_megatron(self) -> set[str]:
        return {"output_layer.weight"} if self.model.tie_embeddings else set()


def table_hf_names[M: Mapped](table: MappingTable[M]) -> set[str]:
    """Every tensor name a Hugging Face checkpoint of the table's model holds."""
    return {name for mapping in table.mappings() for name in mapping.hf}


def check_table_names[M: Mapped](
    table: MappingTable[M], names: Iterable[str], *, where: str = ""
) -> None:
    """Missing HF tensors, and HF tensors the megatron model would drop, are ConversionErrors
    naming them (``names`` in any form ``table.canonical_hf`` takes)."""
    names = {table.canonical_hf(n) for n in names}
    expected = table_hf_names(table)
    source = f" in {where}" if where else ""
    missing = sorted(expected - names)
    if missing:
        raise ConversionError(
            f"tensor {missing[0]!r} is missing{source} ({len(missing)} missing in all); the "
            f"checkpoint does not match its config.json ({table.names_hint})"
        )
    unexpected = sorted(
        n for n in names - expected - table.unused_hf() if not table.ignored_hf.fullmatch(n)
    )
    if unexpected:
        raise ConversionError(
            f"tensor {unexpected[0]!r}{source} has no place in the {table.subject} "
            f"({len(unexpected)} such tensors); the architecture has features conversion does "
            "not support"
        )


def table_to_megatron[M: Mapped](
    table: MappingTable[M], hf_state: Mapping[str, torch.Tensor], *, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """Full megatron (TP=1, PP=1) state dict from a full Hugging Face one (checked first)."""
    check_table_names(table, hf_state)
    state = {table.canonical_hf(k): v for k, v in hf_state.items()}
    return {
        m.megatron: table.to_megatron(m, [state[n] for n in m.hf], padded_vocab=padded_vocab)
        for m in table.mappings()
    }


def table_to_hf[M: Mapped](
    table: MappingTable[M], mcore_state: Mapping[str, Any], *, consume: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from a full megatron state dict, one mapping at a time;
    ``_extra_state`` entries are skipped. With ``consume=True`` (and a mutable mapping) each
    megatron tensor is removed once mapped."""
    names = {n for n in mcore_state if not is_extra_state(n)}
    mappings = table.mappings()
    extra = sorted(names - {m.megatron for m in mappings} - table.unused_megatron())
    if extra:
        raise ConversionError(
            f"megatron parameter {extra[0]!r} has no Hugging Face mapping ({len(extra)} such); "
            f"{table.config_hint} does not match the checkpoint"
        )
    for mapping in mappings:
        if mapping.megatron not in mcore_state:
            raise ConversionError(f"megatron state has no {mapping.megatron!r}")
        if consume:
            assert isinstance(mcore_state, MutableMapping)
            tensor = mcore_state.pop(mapping.megatron)
        else:
            tensor = mcore_state[mapping.megatron]
        yield from zip(mapping.hf, table.to_hf(mapping, tensor), strict=True)
