"""Qwen3-MoE (``model_type: qwen3_moe``): the mixture-of-experts part of the HF <-> megatron map.

Used by :mod:`~megatron_gndpo.checkpoint.hf_mapping`, which owns the attention, norms,
embeddings and the dense layers' MLPs; this module adds the MoE layers' router and experts and
the MoE keys of ``config.json``. Pure torch, no megatron-core.

Names are those of the *full* model, with the *global* expert index ``e`` (legend: H hidden,
I expert FFN width, E experts)::

    megatron (decoder.layers.i.mlp.)                 Hugging Face (model.layers.i.mlp.)
    router.weight                                    gate.weight                  [E, H]
    experts.local_experts.e.linear_fc1.weight        experts.e.{gate,up}_proj.weight
                                                     [2I, H] = [gate; up]
    experts.local_experts.e.linear_fc2.weight        experts.e.down_proj.weight   [H, I]

The Hugging Face names are the checkpoint format (what ``save_pretrained`` writes and vLLM's
Qwen3-MoE ``load_weights`` reads). transformers 5 holds the experts fused in memory
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) and
converts on save and load; a state dict in that form is split by :func:`split_fused_experts`.

Expert parallelism: rank ``r`` of the expert-parallel group holds the experts
``r * E/EP .. (r+1) * E/EP - 1`` as its ``local_experts.0 ..`` (megatron-core's
``SequentialMLP.sharded_state_dict`` numbers them the same way); :func:`global_expert_name`
turns a rank's local name into the full model's. Expert tensor parallelism equals TP here, and
the expert ``linear_fc1`` / ``linear_fc2`` are split like the dense ones (column / row).
Transformer Engine's grouped experts (``TEGroupedMLP``, the GPU spec) name local expert ``j``'s
weights ``experts.linear_fc1.weight{j}``; :func:`global_expert_name` reads those as aliases
(by megatron-core 0.19's naming; not run here, where Transformer Engine cannot be installed).

Layers: Qwen3-MoE makes layer ``i`` (0-based) an MoE layer when ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the others are dense MLPs of
``intermediate_size``. That becomes ``moe_layer_pattern`` (empty when every layer is MoE).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.errors import ConversionError

FAMILY = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
# transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out.
_DEFAULT_SPARSE_STEP = 1
_DEFAULT_NORM_TOPK = False
_DEFAULT_AUX_LOSS = 0.001
# Shared-expert keys of other MoE families (Qwen2-MoE, DeepSeek): Qwen3-MoE has none.
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts")
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)")
_TE_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")


def _get(hf_config: Mapping[str, Any], key: str) -> Any:
    if hf_config.get(key) is None:
        raise ConversionError(
            f"the qwen3_moe config.json has no {key!r}; it is required for conversion"
        )
    return hf_config[key]


def model_fields(hf_config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The :class:`ModelConfig` MoE fields of a ``qwen3_moe`` ``config.json``.

    What megatron cannot build is a ConversionError naming it and the fix: shared experts, a top-1
    router with ``norm_topk_prob`` (every weight 1), a config with no MoE layer.
    """
    # transformers 5 writes num_local_experts (its attribute_map), the Hub's configs num_experts
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if not experts:
        raise ConversionError(
            "the qwen3_moe config.json has no num_experts (or num_local_experts); it is required "
            "for conversion"
        )
    for key in _SHARED_EXPERT_KEYS:
        if hf_config.get(key):
            raise ConversionError(
                f"unsupported shared expert ({key}={hf_config[key]}) in a qwen3_moe config: "
                "Qwen3-MoE has none and the converter maps routed experts only; remove the key "
                "if the checkpoint holds no shared-expert weights"
            )
    topk = int(_get(hf_config, "num_experts_per_tok"))
    norm = bool(hf_config.get("norm_topk_prob", _DEFAULT_NORM_TOPK))
    if topk == 1 and norm:
        raise ConversionError(
            "unsupported num_experts_per_tok=1 with norm_topk_prob=true (every routing weight is "
            "1): megatron-core's top-1 softmax router weights each token by its expert's "
            "probability; set norm_topk_prob=false only if the model was trained that way"
        )
    pattern = moe_layer_pattern(hf_config, num_layers)
    return dict(
        num_experts=int(experts),
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(_get(hf_config, "moe_intermediate_size")),
        # HF: softmax over all experts, top-k, then (norm_topk_prob) renormalise
        moe_router_pre_softmax=True,
        moe_norm_topk_prob=norm,
        moe_aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", _DEFAULT_AUX_LOSS)),
        moe_layer_pattern=pattern if not all(pattern) else (),
    )


def moe_layer_pattern(hf_config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """1 for each MoE layer, 0 for each dense one (Qwen3-MoE's rule, see the module docstring)."""
    step = int(hf_config.get("decoder_sparse_step") or _DEFAULT_SPARSE_STEP)
    dense = hf_config.get("mlp_only_layers") or []
    outside = sorted(set(dense) - set(range(num_layers)))
    if outside:
        raise ConversionError(
            f"mlp_only_layers names layers {outside} of a model with {num_layers} layers; fix "
            "mlp_only_layers in config.json"
        )
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(num_layers))
    if not any(pattern):
        raise ConversionError(
            f"the qwen3_moe config makes no layer an MoE layer (decoder_sparse_step={step}, "
            f"mlp_only_layers={list(dense)}): convert it as the dense model it is (qwen3) or fix "
            "config.json"
        )
    return pattern


def family_problems(model: ModelConfig) -> list[str]:
    """Why ``model`` is not a Qwen3-MoE model (empty when it is)."""
    if not model.is_moe:
        return ["num_experts is not set (qwen3_moe is a mixture-of-experts family)"]
    p = []
    if not model.qk_layernorm:
        p.append("qk_layernorm=false (Qwen3-MoE has QK-norm)")
    if model.add_qkv_bias:
        p.append("add_qkv_bias=true (Qwen3-MoE has no QKV bias)")
    if model.moe_shared_expert_ffn_hidden_size:
        p.append("moe_shared_expert_ffn_hidden_size > 0 (Qwen3-MoE has no shared expert)")
    if model.moe_router_score_function != "softmax":
        p.append(f"moe_router_score_function={model.moe_router_score_function} (Qwen3-MoE's "
                 "router is a softmax)")  # fmt: skip
    return p


def hf_config_fields(model: ModelConfig) -> dict[str, Any]:
    """The MoE keys of a ``qwen3_moe`` ``config.json`` for ``model``."""
    dense = [i for i, moe in enumerate(model.moe_layers) if not moe]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": FAMILY,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.expert_ffn_hidden_size,
        # megatron renormalises the top-k weights unless it takes the softmax first
        "norm_topk_prob": not model.moe_softmax_before_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
    }


def layer_mappings(
    model: ModelConfig, layer: int
) -> list[tuple[str, tuple[str, ...], Literal["copy", "fc1"]]]:
    """(megatron name, HF names, kind) of the router and every expert of MoE layer ``layer``
    (global layer and expert indices; kinds as in ``hf_mapping.WeightMapping``)."""
    mg, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    out: list[tuple[str, tuple[str, ...], Literal["copy", "fc1"]]] = [
        (mg + "router.weight", (hf + "gate.weight",), "copy")
    ]
    for e in range(model.num_experts or 0):
        expert, hf_expert = f"{mg}experts.local_experts.{e}.", f"{hf}experts.{e}."
        out += [
            (expert + "linear_fc1.weight",
             (hf_expert + "gate_proj.weight", hf_expert + "up_proj.weight"), "fc1"),
            (expert + "linear_fc2.weight", (hf_expert + "down_proj.weight",), "copy"),
        ]  # fmt: skip
    return out


def experts_per_rank(model: ModelConfig, ep: int) -> int:
    experts = model.num_experts or 0
    if ep < 1 or experts % ep:
        raise ConversionError(
            f"num_experts ({experts}) is not divisible by expert_parallel ({ep}); choose an "
            "expert-parallel size that divides it"
        )
    return experts // ep


def global_expert_name(name: str, offset: int) -> str:
    """``...local_experts.j...`` -> ``...local_experts.{j + offset}...`` (other names as they are).

    ``offset``: the first expert this rank holds, ``ep_rank * experts_per_rank``. Transformer
    Engine's grouped ``...experts.linear_fc1.weight{j}`` becomes the same local-spec name.
    """
    te = _TE_GROUPED_EXPERT.fullmatch(name)
    if te is not None:
        name = f"{te.group(1)}.local_experts.{te.group(3)}.{te.group(2)}.weight"
    match = _LOCAL_EXPERT.fullmatch(name)
    if match is None or not offset:
        return name
    return f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"


def expert_index(name: str) -> int | None:
    """The expert index in a megatron expert parameter's name; None for other parameters."""
    match = _LOCAL_EXPERT.fullmatch(name)
    return None if match is None else int(match.group(2))


def split_fused_experts(
    hf_state: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """A state dict in checkpoint form: transformers 5's in-memory fused experts
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) split into
    ``mlp.experts.e.{gate,up,down}_proj.weight``; other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state:
        match = _FUSED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix = match.group(1)
        for e, expert in enumerate(tensor.unbind(0)):
            if match.group(2) == "down_proj":
                out[f"{prefix}{e}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
    return out
