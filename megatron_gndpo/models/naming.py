"""The one correspondence between GPTModel's and HybridModel's parameters (``model.model_class``).

A GPTModel layer holds an attention and an MLP (or MoE) sublayer under one index; megatron-core's
HybridModel gives each its own layer, from a layer pattern. The student and teachers built with
``model_class: hybrid`` use the pattern that preserves the GPT architecture, ``*-`` per dense
layer and ``*E`` per MoE layer, with ``|`` between pipeline stages (:func:`hybrid_pattern`), so
GPT layer ``i`` is hybrid layers ``2i`` (attention) and ``2i+1`` (MLP), and the names map one to
one (``...`` is the same suffix on both sides; TE's fused-norm names follow their linear)::

    GPTModel                                  HybridModel
    decoder.layers.i.input_layernorm...       decoder.layers.{2i}.input_layernorm...
    decoder.layers.i.self_attention...        decoder.layers.{2i}.self_attention...
    decoder.layers.i.pre_mlp_layernorm...     decoder.layers.{2i+1}.pre_mlp_layernorm...
    decoder.layers.i.mlp...                   decoder.layers.{2i+1}.mlp...   (router, experts)
    decoder.final_layernorm...                decoder.final_norm...
    embedding..., output_layer...             the same

The rest of the package speaks GPT names: the Hugging Face mapping (and through it conversion,
the weight sync into vLLM and the rollout ranks' weight check), routing replay and the interop
files. A HybridModel's names are translated here, where parameters are enumerated
(``checkpoint/hf_mapping.global_names``) and where checkpoint keys are matched
(``checkpoint/model_class.py``); the lean decoder walks :func:`decoder_blocks`. Names may carry
a prefix (``language_model.``, ``module.``, an optimizer's ``optimizer.state.exp_avg.``).

Nothing here imports torch or megatron-core.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from megatron_gndpo.config.schema import ModelClass

ATTENTION, MLP, MOE, PIPE = "*", "-", "E", "|"  # megatron-core's hybrid layer symbols
GPT_FINAL_NORM = "decoder.final_layernorm."
HYBRID_FINAL_NORM = "decoder.final_norm."
# What of a GPT layer lives in the hybrid attention layer; the rest lives in the MLP layer.
_ATTENTION_PARTS = ("input_layernorm.", "self_attention.")
_MLP_PARTS = ("pre_mlp_layernorm.", "mlp.")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


class NamingError(ValueError):
    """A name that has no counterpart in the other model class."""


def hybrid_pattern(moe_layers: Sequence[bool], pipeline_parallel: int = 1) -> str:
    """The HybridModel layer pattern of a GPT model whose layer ``i`` is MoE when
    ``moe_layers[i]``: ``*-`` or ``*E`` per layer, ``|`` between the ``pipeline_parallel``
    stages (each holding an equal share of the GPT layers, as GPTModel splits them)."""
    layers = [ATTENTION + (MOE if moe else MLP) for moe in moe_layers]
    if pipeline_parallel < 1 or len(layers) % pipeline_parallel:
        raise NamingError(
            f"{len(layers)} layers do not split evenly over {pipeline_parallel} pipeline stages"
        )
    per_stage = len(layers) // pipeline_parallel
    return PIPE.join(
        "".join(layers[s * per_stage : (s + 1) * per_stage]) for s in range(pipeline_parallel)
    )


def hybrid_moe_layers(moe_layers: Sequence[bool]) -> list[int]:
    """megatron's ``moe_layer_freq`` list over the hybrid layers (1 at each ``E``)."""
    return [int(kind) for moe in moe_layers for kind in (False, moe)]


def _replace_layer(name: str, match: re.Match[str], index: int) -> str:
    return f"{name[: match.start()]}decoder.layers.{index}.{name[match.end() :]}"


def to_gpt(name: str) -> str:
    """The GPTModel name of a HybridModel parameter (or checkpoint key); other names unchanged."""
    match = _LAYER.search(name)
    if match is None:
        return name.replace(HYBRID_FINAL_NORM, GPT_FINAL_NORM, 1)
    hybrid, rest = int(match.group(1)), name[match.end() :]
    parts = _MLP_PARTS if hybrid % 2 else _ATTENTION_PARTS
    if not rest.startswith(parts):
        kind = "an MLP" if hybrid % 2 else "an attention"
        raise NamingError(
            f"{name!r}: hybrid layer {hybrid} is {kind} layer of the '*-' pattern and holds no "
            f"{rest.split('.')[0]!r}"
        )
    return _replace_layer(name, match, hybrid // 2)


def to_hybrid(name: str) -> str:
    """The HybridModel name of a GPTModel parameter (or checkpoint key); other names unchanged."""
    match = _LAYER.search(name)
    if match is None:
        return name.replace(GPT_FINAL_NORM, HYBRID_FINAL_NORM, 1)
    layer, rest = int(match.group(1)), name[match.end() :]
    if rest.startswith(_ATTENTION_PARTS):
        return _replace_layer(name, match, 2 * layer)
    if rest.startswith(_MLP_PARTS):
        return _replace_layer(name, match, 2 * layer + 1)
    raise NamingError(f"{name!r} is in neither the attention nor the MLP of a GPT layer")


def convert(name: str, *, source: ModelClass, target: ModelClass) -> str:
    """``name`` of a ``source`` model as the ``target`` model class names it."""
    if source == target:
        return name
    return to_hybrid(name) if target == "hybrid" else to_gpt(name)


def model_class_of(model: Any) -> ModelClass:
    """Which class a built megatron language model is (any wrapper around it is looked through)."""
    while hasattr(model, "module"):
        model = model.module
    return "hybrid" if hasattr(model, "hybrid_layer_pattern") else "gpt"


def decoder_blocks(model: Any) -> list[tuple[Any, Any]]:
    """This pipeline stage's GPT layers as ``(attention sublayer, MLP sublayer)`` modules: the
    same layer twice for a GPTModel, consecutive layers ``2i`` and ``2i+1`` for a HybridModel
    (whose stages never split a pair: :func:`hybrid_pattern`)."""
    layers = list(model.decoder.layers)
    if model_class_of(model) == "gpt":
        return [(layer, layer) for layer in layers]
    if len(layers) % 2:
        raise NamingError(f"a hybrid stage of {len(layers)} layers is not '*-' pairs")
    return [(layers[i], layers[i + 1]) for i in range(0, len(layers), 2)]


def final_norm(model: Any) -> Any:
    """The decoder's final norm (None on a stage without one)."""
    decoder = model.decoder
    if model_class_of(model) == "gpt":
        return getattr(decoder, "final_layernorm", None)
    return getattr(decoder, "final_norm", None)
