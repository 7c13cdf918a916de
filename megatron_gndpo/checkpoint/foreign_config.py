"""The architecture of a step that Megatron-Bridge or Megatron-LM wrote, as a :class:`ModelConfig`.

Ours is ``model_config.yaml`` beside the checkpoints. A step another tool wrote describes its
model in that tool's own form, which ``convert mcore-to-hf`` reads when ours is absent:

Megatron-Bridge
    ``run_config.yaml`` in the step (``ConfigContainer.to_yaml``). Its ``model`` section holds
    every field of a ``GPTModelProvider``: megatron-core's ``TransformerConfig`` (``num_layers``,
    ``gated_linear_unit``, ``layernorm_epsilon``, ...) plus ``vocab_size``, ``seq_length`` and
    ``share_embeddings_and_output_weights``; objects are written as ``{_target_: dotted.name,
    _call_: false}`` (``activation_func``, ``params_dtype``). ``hf_model_id`` names the Hugging
    Face model it was imported from.
Megatron-LM
    ``args`` in the step's common state (``dist_checkpointing.load_common_state_dict``): the
    ``argparse.Namespace`` of its command line (``--num-layers``, ``--swiglu``,
    ``--untie-embeddings-and-output-weights``, ...). ``vocab_size`` is usually unset there (the
    tokenizer decided it); ``padded_vocab_size``, the embedding's row count, then stands for it.

A required field that is missing or of the wrong type refuses, naming the file and
``--model-config``; a feature :class:`ModelConfig` cannot express (mixture of experts, MLA,
sliding windows, ...) refuses, naming the field.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gndpo.checkpoint import interop
from megatron_gndpo.config.schema import Dtype, ModelConfig
from megatron_gndpo.errors import UserError
from megatron_gndpo.fileio import read_json
from megatron_gndpo.models import naming

BRIDGE = "Megatron-Bridge"
MEGATRON_LM = "Megatron-LM"
_FIX = (
    "pass --model-config FILE (a YAML file with the ModelConfig, or a run config whose model "
    "section is one)"
)
_DTYPES: dict[str, Dtype] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_POSITIONS = ("rope", "learned_absolute")
_NORMS = ("RMSNorm", "LayerNorm")

# Features ModelConfig has no field for, by each tool's name: the value(s) meaning "not used".
_BRIDGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "num_moe_experts": (None, 0), "multi_latent_attention": (False,),
    "is_hybrid_model": (False,), "heterogeneous_block_specs": (False,),
    "mtp_num_layers": (None, 0), "window_size": (None,), "rotary_interleaved": (False,),
    "rotary_percent": (1.0,), "layernorm_zero_centered_gamma": (False,),
    "apply_residual_connection_post_layernorm": (False,), "attention_output_gate": (False,),
    "qk_l2_norm": (False,), "softmax_type": ("vanilla",), "softmax_scale": (None,),
    "experimental_attention_variant": (None,), "use_mup": (False,),
    "seq_len_interpolation_factor": (None,), "yarn_rotary_scaling_factor": (None,),
    "mrope_section": (None,), "no_rope_freq": (None,),
}  # fmt: skip
_MEGATRON_LM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "num_experts": (None, 0), "multi_latent_attention": (False,),
    "heterogeneous_layers_config_path": (None,), "mtp_num_layers": (None, 0),
    "window_size": (None,), "rotary_interleaved": (False,), "rotary_percent": (1.0,),
    "apply_layernorm_1p": (False,), "apply_residual_connection_post_layernorm": (False,),
    "squared_relu": (False,), "rotary_seq_len_interpolation_factor": (None,),
}  # fmt: skip


_REQUIRED = object()  # get()'s default: the field must be there


class ForeignConfigError(UserError, ValueError):
    """The model description another tool wrote is incomplete or describes an unsupported model."""


class _Fields:
    """One description's fields; every refusal names ``where`` and the way out."""

    def __init__(self, values: Mapping[str, Any], where: str) -> None:
        self.values, self.where = values, where

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        """The field's value, checked to be a ``kind``; ``default`` when it is missing or null
        (none given: the field is required)."""
        value = self.values.get(name)
        if value is None:
            if default is _REQUIRED:
                raise ForeignConfigError(
                    f"{self.where} does not say {name}, which the architecture needs; {_FIX}"
                )
            return default
        # bool is an int: a count given as true/false is as wrong as one given as text
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise ForeignConfigError(
                f"{self.where}: {name} is {value!r}, expected {_kind_names(kind)}; {_FIX}"
            )
        return value

    def choice(self, name: str, allowed: tuple[str, ...], default: Any = _REQUIRED) -> str:
        value: str = self.get(name, str, default)
        if value not in allowed:
            raise ForeignConfigError(
                f"{self.where}: {name}={value!r} is not supported here (this project's models "
                f"take {' or '.join(allowed)}); {_FIX} if the checkpoint is one of them"
            )
        return value

    def refuse_features(self, unused: Mapping[str, tuple[Any, ...]], tool: str) -> None:
        for name, off in unused.items():
            value = self.values.get(name)
            if name in self.values and value not in off:
                raise ForeignConfigError(
                    f"{self.where}: {name}={value!r} is a feature this project's models do not "
                    f"have (they need {name}={off[0]!r}), so it cannot convert this {tool} "
                    f"checkpoint; export it with {tool}'s own tools instead"
                )


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _kinds(kind))


def _dtype_name(value: Any) -> str | None:
    """``float32`` of ``torch.float32``, of its text, or of Bridge's
    ``{_target_: torch.float32}``."""
    if isinstance(value, Mapping):
        value = value.get("_target_")
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _params_dtype(fields: _Fields) -> Dtype:
    """The parameter dtype: ``params_dtype``, else the ``bf16`` / ``fp16`` flags, else fp32 (the
    default of both tools; an export takes the saved tensors' dtype anyway)."""
    name = _dtype_name(fields.values.get("params_dtype"))
    if name in _DTYPES:
        return _DTYPES[name]
    return "bf16" if fields.values.get("bf16") else "fp16" if fields.values.get("fp16") else "fp32"


def _rope_scaling(fields: _Fields, flag: str) -> float | None:
    """Llama-3.1-style RoPE frequency scaling: ``rope_scaling_factor`` when ``flag`` is on."""
    if not fields.values.get(flag):
        return None
    return float(fields.get("rope_scaling_factor", (int, float)))


def from_bridge_run_config(run_config: Mapping[str, Any], where: str) -> ModelConfig:
    """The :class:`ModelConfig` of Megatron-Bridge's ``run_config.yaml`` (read into a dict)."""
    section = run_config.get("model")
    if not isinstance(section, Mapping):
        raise ForeignConfigError(f"{where} has no model section; {_FIX}")
    fields = _Fields(section, f"{where} (model section)")
    fields.refuse_features(_BRIDGE_UNSUPPORTED, BRIDGE)
    activation = str((section.get("activation_func") or {}).get("_target_", ""))
    gated = fields.get("gated_linear_unit", bool)
    if (gated, activation.rsplit(".", 1)[-1]) not in ((True, "silu"), (False, "gelu")):
        raise ForeignConfigError(
            f"{fields.where}: activation_func {activation or 'unknown'} with gated_linear_unit="
            f"{gated} is not supported here (this project's models are SwiGLU, i.e. silu "
            f"gated, or plain gelu); {_FIX} if the checkpoint is one of them"
        )
    return ModelConfig(
        num_layers=fields.get("num_layers", int),
        hidden_size=fields.get("hidden_size", int),
        ffn_hidden_size=fields.get("ffn_hidden_size", int),
        num_attention_heads=fields.get("num_attention_heads", int),
        num_query_groups=fields.get("num_query_groups", int, None),
        kv_channels=fields.get("kv_channels", int, None),
        vocab_size=fields.get("vocab_size", int),
        make_vocab_size_divisible_by=fields.get("make_vocab_size_divisible_by", int, 128),
        max_position_embeddings=fields.get("seq_length", int),
        position_embedding=fields.choice("position_embedding_type", _POSITIONS),  # type: ignore[arg-type]
        rotary_base=float(fields.get("rotary_base", (int, float), 10000.0)),
        rotary_scaling_factor=_rope_scaling(fields, "rope_scaling"),
        normalization=fields.choice("normalization", _NORMS),  # type: ignore[arg-type]
        norm_epsilon=float(fields.get("layernorm_epsilon", (int, float))),
        swiglu=gated,
        add_qkv_bias=fields.get("add_qkv_bias", bool, False),
        add_bias_linear=fields.get("add_bias_linear", bool),
        qk_layernorm=fields.get("qk_layernorm", bool, False),
        tie_embeddings=fields.get("share_embeddings_and_output_weights", bool),
        init_method_std=float(fields.get("init_method_std", (int, float), 0.02)),
        params_dtype=_params_dtype(fields),
    )


def from_megatron_lm_args(args: argparse.Namespace | Mapping[str, Any], where: str) -> ModelConfig:
    """The :class:`ModelConfig` of Megatron-LM's saved ``args``. A flag missing from an older
    Megatron-LM's namespace means its default (the feature did not exist)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    fields = _Fields(values, f"{where} (Megatron-LM args)")
    fields.refuse_features(_MEGATRON_LM_UNSUPPORTED, MEGATRON_LM)
    if not fields.has("position_embedding_type") and fields.has("use_rotary_position_embeddings"):
        position = "rope" if values["use_rotary_position_embeddings"] else "learned_absolute"
    else:
        position = fields.choice("position_embedding_type", _POSITIONS, "learned_absolute")
    grouped = bool(values.get("group_query_attention"))
    # vocab_size is set only by --vocab-size; otherwise the tokenizer gave padded_vocab_size.
    vocab = "vocab_size" if fields.has("vocab_size") else "padded_vocab_size"
    return ModelConfig(
        **_megatron_lm_layers(fields),
        hidden_size=fields.get("hidden_size", int),
        ffn_hidden_size=fields.get("ffn_hidden_size", int),
        num_attention_heads=fields.get("num_attention_heads", int),
        num_query_groups=fields.get("num_query_groups", int) if grouped else None,
        kv_channels=fields.get("kv_channels", int, None),
        vocab_size=fields.get(vocab, int),
        make_vocab_size_divisible_by=fields.get("make_vocab_size_divisible_by", int, 128),
        max_position_embeddings=fields.get(
            "max_position_embeddings" if fields.has("max_position_embeddings") else "seq_length",
            int,
        ),
        position_embedding=position,  # type: ignore[arg-type]
        rotary_base=float(fields.get("rotary_base", (int, float), 10000)),
        rotary_scaling_factor=_rope_scaling(fields, "use_rope_scaling"),
        normalization=fields.choice("normalization", _NORMS, "LayerNorm"),  # type: ignore[arg-type]
        norm_epsilon=float(fields.get("norm_epsilon", (int, float), 1e-5)),
        swiglu=bool(values.get("swiglu")),
        add_qkv_bias=bool(values.get("add_qkv_bias")),
        add_bias_linear=fields.get("add_bias_linear", bool, True),  # --disable-bias-linear
        qk_layernorm=bool(values.get("qk_layernorm")),
        tie_embeddings=not values.get("untie_embeddings_and_output_weights"),
        init_method_std=float(fields.get("init_method_std", (int, float), 0.02)),
        params_dtype=_params_dtype(fields),
    )


def _megatron_lm_layers(fields: _Fields) -> dict[str, Any]:
    """``num_layers`` and ``model_class`` of Megatron-LM's args: a HybridModel
    (``pretrain_hybrid.py``) whose pattern is attention and dense MLP layers in pairs is this
    project's ``model_class: hybrid`` (``models/naming.py``); other patterns are refused."""
    pattern = fields.get("hybrid_layer_pattern", str, None)
    hybrid = bool(pattern) or bool(fields.values.get("is_hybrid_model"))
    if not hybrid:
        return {"num_layers": fields.get("num_layers", int)}
    main = (pattern or "").replace(naming.PIPE, "")
    pairs = len(main) // 2
    if not main or main != (naming.ATTENTION + naming.MLP) * pairs:
        raise ForeignConfigError(
            f"{fields.where}: hybrid_layer_pattern={pattern!r} is not attention and dense MLP "
            f"layers in pairs ('*-*-...'), the only HybridModel this project builds; export it "
            f"with {MEGATRON_LM}'s own tools instead"
        )
    return {"num_layers": pairs, "model_class": "hybrid"}


def bridge_run_config(step: Path) -> dict[str, Any] | None:
    """The ``run_config.yaml`` of a step (None when there is none)."""
    import yaml

    path = step / interop.BRIDGE_RUN_CONFIG
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ForeignConfigError(f"{path} is unreadable ({err}); {_FIX}") from err
    if not isinstance(data, dict):
        raise ForeignConfigError(f"{path} does not hold a mapping; {_FIX}")
    return data


def megatron_lm_args(step: Path) -> argparse.Namespace | None:
    """The ``args`` in a step's common state (None when the step saved none)."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(str(step))
    except Exception:  # no or an unreadable common.pt: no args to read
        return None
    args = common.get("args") if isinstance(common, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


def read_model_config(step: Path) -> ModelConfig | None:
    """The architecture a step of Megatron-Bridge (``run_config.yaml``) or Megatron-LM (its
    ``args``) describes; None when it carries neither."""
    run_config = bridge_run_config(step)
    if run_config is not None:
        return from_bridge_run_config(run_config, str(step / interop.BRIDGE_RUN_CONFIG))
    args = megatron_lm_args(step)
    if args is not None:
        return from_megatron_lm_args(args, f"{step}'s common state")
    return None


def source_hf_config(step: Path) -> dict[str, Any] | None:
    """The ``config.json`` of the Hugging Face model a Megatron-Bridge step was imported from
    (its ``hf_model_id``), when that is a local directory still holding one."""
    try:
        run_config = bridge_run_config(step)
    except ForeignConfigError:
        return None
    section = (run_config or {}).get("model")
    source = section.get("hf_model_id") if isinstance(section, dict) else None
    path = Path(source) / "config.json" if isinstance(source, str) and source else None
    if path is None or not path.is_file():
        return None
    data = read_json(path)
    return data if isinstance(data, dict) else None


def written_by(step: Path) -> str:
    """Which tool wrote a step that has no ``megatron_gndpo.json``: Megatron-Bridge when its run
    config or train state is in the step, Megatron-LM when its ``args`` are in the common state
    or its tracker is beside the step."""
    if any(
        (step / name).is_file() for name in (interop.BRIDGE_RUN_CONFIG, interop.BRIDGE_TRAIN_STATE)
    ):
        return BRIDGE
    if megatron_lm_args(step) is not None or (step.parent / interop.MEGATRON_LM_TRACKER).is_file():
        return MEGATRON_LM
    return "another tool"
