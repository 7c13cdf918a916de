"""Hugging Face InternVL <-> :class:`~megatron_gndpo.models.vlm.VisionLanguageModel`: configs,
parameter names and tensor layouts.

The reference is transformers' native InternVL (``model_type: internvl``,
``InternVLForConditionalGeneration``; the ``-hf`` checkpoints such as
``OpenGVLab/InternVL3-1B-hf``): an InternViT encoder, the ``mlp1`` projector (LayerNorm -> Linear
-> GELU -> Linear on pixel-shuffled features) and a llama / qwen2 / qwen3 language model. The
language model reuses :mod:`~megatron_gndpo.checkpoint.hf_mapping` with both names prefixed;
this module adds the vision tower and the projector. Pure torch: nothing here imports
megatron-core.

Names are those ``save_pretrained`` writes (and the ``-hf`` hub checkpoints hold); transformers
5's in-memory names (``model.vision_tower.*``, ``model.language_model.*``, ``lm_head.*``) are
accepted on import (:func:`canonical_hf_name`). Legend: h ViT width, n patches per tile,
nh ViT heads, hd = h / nh::

    megatron                                     Hugging Face (vision_tower.)
    vision_model.class_token         [1, 1, h]   embeddings.cls_token
    vision_model.position_embeddings.weight      embeddings.position_embeddings  [n+1, h] <->
                                                                                 [1, n+1, h]
    vision_model.conv1.{weight,bias}             embeddings.patch_embeddings.projection
    vision_model.decoder.layers.i.               encoder.layer.i.
      input_layernorm                              layernorm_before
      self_attention.linear_qkv                    attention.{q,k,v}_proj  (see below)
      self_attention.linear_proj                   attention.projection_layer
      self_attn_bda.weight  [h]                    lambda_1  (layer scale)
      pre_mlp_layernorm                            layernorm_after
      mlp.linear_fc1 / mlp.linear_fc2              mlp.fc1 / mlp.fc2
      mlp_bda.weight        [h]                    lambda_2
    vision_projection.norm                       multi_modal_projector.layer_norm
    vision_projection.mlp.encoder.linear_fc1     multi_modal_projector.linear_1
    vision_projection.mlp.encoder.linear_fc2     multi_modal_projector.linear_2
    language_model.<GPT name>                    language_model.<causal-LM name>
                                                   (model.* and lm_head.weight, hf_mapping's)

The ViT's ``linear_qkv`` is grouped per head (multi-head attention: one KV group per head):
``[nh * 3 * hd, h]`` where head j holds q_j, k_j, v_j, so a TP shard is whole heads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from megatron_gndpo.checkpoint import hf_mapping
from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.config.vision import IMAGENET_MEAN, IMAGENET_STD, VisionConfig
from megatron_gndpo.errors import ConversionError

MODEL_TYPE = "internvl"
_ARCHITECTURE = "InternVLForConditionalGeneration"
# InternVL's mlp1 LayerNorm is built without an eps argument: torch's default.
PROJECTOR_NORM_EPS = 1e-5
# Pixel shuffle folds 2x2 patches: transformers' downsample_ratio 0.5 (the only one supported).
_DOWNSAMPLE_RATIO = 0.5
_NORM_TYPES = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}
_HF_NORM_TYPES = {v: k for k, v in _NORM_TYPES.items()}
# transformers 5 renames the saved (legacy) prefixes in memory; save_pretrained reverts them.
_IN_MEMORY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_LM = "language_model."
_IGNORED_HF = re.compile(r"language_model\.model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

Kind = Literal["copy", "vit_qkv", "positions", "lm"]
# The VLM's parts (what a weight sync may send separately): megatron and Hugging Face prefixes.
PARTS: dict[str, tuple[str, str]] = {
    "language": ("language_model.", "language_model."),
    "projector": ("vision_projection.", "multi_modal_projector."),
    "encoder": ("vision_model.", "vision_tower."),
}


# ---------------------------------------------------------------------------------------------
# Configs


def _required(config: Mapping[str, Any], key: str, where: str = "") -> Any:
    if config.get(key) is None:
        raise ConversionError(f"the Hugging Face config has no {where}{key!r}; it is required")
    return config[key]


def _square(value: Any, key: str) -> int:
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(set(sides)) != 1:
        raise ConversionError(
            f"vision_config.{key}={value}: only square images and patches are supported"
        )
    return int(sides[0])


def _vision_problems(hf_config: Mapping[str, Any], vis: Mapping[str, Any]) -> list[str]:
    """What the megatron VLM cannot represent, each naming the key (empty when convertible)."""
    wanted: tuple[tuple[Mapping[str, Any], str, Any, Any, str], ...] = (
        (hf_config, "downsample_ratio", 0.5, _DOWNSAMPLE_RATIO,
         "pixel shuffle folds 2x2 patches only"),
        (hf_config, "vision_feature_layer", -1, -1,
         "the megatron ViT feeds its last layer's output to the projector"),
        (hf_config, "vision_feature_select_strategy", "default", "default",
         "the class token is dropped before pixel shuffle"),
        (hf_config, "projector_hidden_act", "gelu", "gelu", "the projector uses exact (erf) GELU"),
        (vis, "hidden_act", "gelu", "gelu", "the ViT MLP uses exact (erf) GELU"),
        (vis, "attention_bias", False, True,
         "the megatron ViT has q/k/v biases (InternViT-300M); InternViT-6B is not supported"),
        (vis, "use_qk_norm", False, False,
         "InternViT-6B's QK-norm over all heads has no megatron counterpart"),
        (vis, "use_mean_pooling", True, True,
         "use_mean_pooling=false adds a final LayerNorm the megatron ViT does not build"),
        (vis, "use_absolute_position_embeddings", True, True,
         "the megatron ViT has learned absolute position embeddings"),
        (vis, "use_mask_token", False, False, "the mask token (masked image modelling) is unused"),
        (vis, "num_channels", 3, 3, "images are RGB"),
    )  # fmt: skip
    problems = []
    for config, key, default, expected, why in wanted:
        value = config.get(key, default)
        if value != expected:
            where = "" if config is hf_config else "vision_config."
            problems.append(f"{where}{key}={value!r} (supported: {expected!r}; {why})")
    norm = vis.get("norm_type", "layer_norm")
    if norm not in _NORM_TYPES:
        problems.append(f"vision_config.norm_type={norm!r} (supported: {list(_NORM_TYPES)})")
    return problems


def vlm_configs_from_hf(
    hf_config: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None
) -> tuple[ModelConfig, VisionConfig]:
    """The language :class:`ModelConfig` and the :class:`VisionConfig` of an InternVL
    ``config.json`` (and its ``preprocessor_config.json``, for the image mean and std).

    Features the megatron VLM cannot represent are a ValueError listing each with its key.
    """
    model_type = hf_config.get("model_type")
    if model_type != MODEL_TYPE:
        hint = (
            ": this is the original remote-code InternVL format; convert it to transformers' "
            "native format first (transformers' models/internvl/convert_internvl_weights_to_hf.py)"
            if model_type == "internvl_chat"
            else f"; VLM conversion supports {MODEL_TYPE!r} (transformers' InternVL)"
        )
        raise ConversionError(f"unsupported Hugging Face model_type {model_type!r}{hint}")
    vis = dict(_required(hf_config, "vision_config"))
    problems = _vision_problems(hf_config, vis)
    if problems:
        raise ConversionError(
            "this InternVL checkpoint cannot be converted:\n  - " + "\n  - ".join(problems)
        )
    text = dict(_required(hf_config, "text_config"))
    # The top-level config decides tying for the whole model (transformers ties lm_head to the
    # language model's embedding from it) and names the dtype the weights are stored in.
    text["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", True))
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if dtype:
        text["torch_dtype"] = dtype
    model = hf_mapping.model_config_from_hf(text)
    pre = preprocessor or {}
    hidden = int(_required(vis, "hidden_size", "vision_config."))
    vision = VisionConfig(
        encoder="internvit",
        image_size=_square(_required(vis, "image_size", "vision_config."), "image_size"),
        patch_size=_square(_required(vis, "patch_size", "vision_config."), "patch_size"),
        num_layers=int(_required(vis, "num_hidden_layers", "vision_config.")),
        hidden_size=hidden,
        ffn_hidden_size=int(_required(vis, "intermediate_size", "vision_config.")),
        num_attention_heads=int(_required(vis, "num_attention_heads", "vision_config.")),
        normalization=_NORM_TYPES[vis.get("norm_type", "layer_norm")],  # type: ignore[arg-type]
        norm_epsilon=float(vis.get("layer_norm_eps", 1e-6)),
        layer_scale=float(vis.get("layer_scale_init_value", 0.1)),
        drop_class_token=True,
        pixel_shuffle=True,
        projector="norm_mlp",
        projector_norm_epsilon=PROJECTOR_NORM_EPS,
        image_token_id=int(_required(hf_config, "image_token_id")),
        image_mean=tuple(float(x) for x in pre.get("image_mean", IMAGENET_MEAN)),  # type: ignore[arg-type]
        image_std=tuple(float(x) for x in pre.get("image_std", IMAGENET_STD)),  # type: ignore[arg-type]
    )
    seq = hf_config.get("image_seq_length")
    if seq is not None and int(seq) != vision.tokens_per_tile:
        raise ConversionError(
            f"image_seq_length={seq} but a {vision.image_size}px tile of {vision.patch_size}px "
            f"patches gives {vision.tokens_per_tile} tokens after pixel shuffle"
        )
    if not 0 <= vision.image_token_id < model.vocab_size:
        raise ConversionError(
            f"image_token_id={vision.image_token_id} is outside the vocabulary "
            f"[0, {model.vocab_size})"
        )
    return model, vision


def internvl_problems(model: ModelConfig, vision: VisionConfig) -> list[str]:
    """Why ``vision`` (with language model ``model``) is no InternVL checkpoint (empty if it is)."""
    problems = []
    if vision.encoder != "internvit":
        problems.append(f"encoder={vision.encoder} (InternVL has internvit)")
    if not (vision.pixel_shuffle and vision.drop_class_token):
        problems.append("pixel_shuffle and drop_class_token must both be true")
    if vision.projector != "norm_mlp":
        problems.append(f"projector={vision.projector} (InternVL's mlp1 is norm_mlp)")
    if vision.projector_ffn_hidden_size not in (None, model.hidden_size):
        problems.append(
            f"projector_ffn_hidden_size={vision.projector_ffn_hidden_size} (InternVL's is the "
            f"language model's hidden size, {model.hidden_size})"
        )
    eps = (
        vision.norm_epsilon
        if vision.projector_norm_epsilon is None
        else vision.projector_norm_epsilon
    )
    if eps != PROJECTOR_NORM_EPS:
        problems.append(f"projector norm epsilon {eps} (InternVL's mlp1 uses {PROJECTOR_NORM_EPS})")
    if vision.layer_scale is None:
        problems.append("layer_scale=null (InternViT scales every residual branch)")
    return problems


def hf_config_from_vlm(model: ModelConfig, vision: VisionConfig, family: str) -> dict[str, Any]:
    """The InternVL ``config.json`` of the VLM, its language model a ``family`` model.

    A VLM that is not InternVL-shaped is a ValueError listing why.
    """
    problems = internvl_problems(model, vision)
    if problems:
        raise ConversionError(
            "this VLM cannot be written as an InternVL checkpoint: " + "; ".join(problems)
        )
    text = hf_mapping.hf_config_from_model(model, family)
    size, patch = vision.image_size, vision.patch_size
    return {
        "architectures": [_ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "downsample_ratio": _DOWNSAMPLE_RATIO,
        "image_seq_length": vision.tokens_per_tile,
        "image_token_id": vision.image_token_id,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": text["torch_dtype"],
        "text_config": text,
        "vision_config": {
            "model_type": "internvl_vision",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.ffn_hidden_size,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_attention_heads,
            "hidden_act": "gelu",
            "attention_bias": True,
            "use_qk_norm": False,
            "norm_type": _HF_NORM_TYPES[vision.normalization],
            "layer_norm_eps": vision.norm_epsilon,
            "layer_scale_init_value": vision.layer_scale,
            "image_size": [size, size],
            "patch_size": [patch, patch],
            "num_channels": 3,
            "use_mean_pooling": True,
            "use_absolute_position_embeddings": True,
            "use_mask_token": False,
            "initializer_range": model.init_method_std,
        },
    }


# ---------------------------------------------------------------------------------------------
# Parameter mapping


@dataclasses.dataclass(frozen=True)
class VLMMapping:
    """One megatron parameter of the VLM and the Hugging Face tensor(s) it is made of.

    ``kind``: ``copy``; ``vit_qkv`` (q, k, v interleaved per head); ``positions`` (the ViT's
    position embeddings lose / regain HF's leading batch dimension); ``lm`` (a language-model
    parameter: ``lm`` is hf_mapping's mapping of the unprefixed names).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    lm: hf_mapping.WeightMapping | None = None

    def to_megatron(
        self,
        tensors: Sequence[torch.Tensor],
        model: ModelConfig,
        vision: VisionConfig,
        *,
        padded_vocab: int,
    ) -> torch.Tensor:
        """The full (TP=1) megatron tensor from the HF tensors named in ``hf`` (same order)."""
        if self.lm is not None:
            return self.lm.to_megatron(tensors, model, padded_vocab=padded_vocab)
        if self.kind == "vit_qkv":
            return _vit_qkv_to_megatron(tensors, vision.num_attention_heads)
        (tensor,) = tensors
        if self.kind == "positions":
            if tensor.dim() != 3 or tensor.shape[0] != 1:
                raise ConversionError(
                    f"{self.hf[0]}: expected [1, n+1, h], got {tuple(tensor.shape)}"
                )
            return tensor[0]
        return tensor

    def to_hf(
        self, tensor: torch.Tensor, model: ModelConfig, vision: VisionConfig
    ) -> tuple[torch.Tensor, ...]:
        """The HF tensors (in ``hf`` order) from the full (TP=1) megatron tensor."""
        if self.lm is not None:
            return self.lm.to_hf(tensor, model)
        if self.kind == "vit_qkv":
            return _vit_qkv_to_hf(tensor, vision.num_attention_heads)
        if self.kind == "positions":
            return (tensor.unsqueeze(0),)
        return (tensor,)


def canonical_hf_name(name: str) -> str:
    """An InternVL tensor name in saved form (transformers 5's in-memory prefixes reverted)."""
    for in_memory, saved in _IN_MEMORY_PREFIXES:
        if name.startswith(in_memory):
            return saved + name.removeprefix(in_memory)
    return name


def _lm_mapping(mapping: hf_mapping.WeightMapping) -> VLMMapping:
    return VLMMapping(_LM + mapping.megatron, tuple(_LM + n for n in mapping.hf), "lm", lm=mapping)


# Per ViT layer: (megatron suffix, HF suffixes, kind); "{b}" is weight or bias.
_VIT_LAYER_TABLE: tuple[tuple[str, tuple[str, ...], Kind], ...] = (
    ("input_layernorm.{b}", ("layernorm_before.{b}",), "copy"),
    ("self_attention.linear_qkv.{b}",
     ("attention.q_proj.{b}", "attention.k_proj.{b}", "attention.v_proj.{b}"), "vit_qkv"),
    ("self_attention.linear_proj.{b}", ("attention.projection_layer.{b}",), "copy"),
    ("pre_mlp_layernorm.{b}", ("layernorm_after.{b}",), "copy"),
    ("mlp.linear_fc1.{b}", ("mlp.fc1.{b}",), "copy"),
    ("mlp.linear_fc2.{b}", ("mlp.fc2.{b}",), "copy"),
)  # fmt: skip


def _vit_layer_mappings(vision: VisionConfig, layer: int) -> Iterator[VLMMapping]:
    mg, hf = f"vision_model.decoder.layers.{layer}.", f"vision_tower.encoder.layer.{layer}."
    for suffix, hf_suffixes, kind in _VIT_LAYER_TABLE:
        norm = suffix.endswith("layernorm.{b}")
        for b in ("weight", "bias"):
            if norm and b == "bias" and vision.normalization == "RMSNorm":
                continue  # RMSNorm has no bias (in both models)
            yield VLMMapping(
                mg + suffix.format(b=b), tuple(hf + h.format(b=b) for h in hf_suffixes), kind
            )
    yield VLMMapping(mg + "self_attn_bda.weight", (hf + "lambda_1",), "copy")
    yield VLMMapping(mg + "mlp_bda.weight", (hf + "lambda_2",), "copy")


def iter_vision_mappings(vision: VisionConfig) -> Iterator[VLMMapping]:
    """The vision tower's and the projector's mappings (megatron: the first pipeline stage's)."""
    emb = "vision_tower.embeddings."
    yield VLMMapping("vision_model.class_token", (emb + "cls_token",), "copy")
    yield VLMMapping("vision_model.position_embeddings.weight", (emb + "position_embeddings",),
                     "positions")  # fmt: skip
    for b in ("weight", "bias"):
        yield VLMMapping(f"vision_model.conv1.{b}", (f"{emb}patch_embeddings.projection.{b}",),
                         "copy")  # fmt: skip
    for layer in range(vision.num_layers):
        yield from _vit_layer_mappings(vision, layer)
    proj = "multi_modal_projector."
    for mg, hf in (("norm", "layer_norm"), ("mlp.encoder.linear_fc1", "linear_1"),
                   ("mlp.encoder.linear_fc2", "linear_2")):  # fmt: skip
        for b in ("weight", "bias"):
            yield VLMMapping(f"vision_projection.{mg}.{b}", (f"{proj}{hf}.{b}",), "copy")


def iter_vlm_mappings(model: ModelConfig, vision: VisionConfig) -> Iterator[VLMMapping]:
    """Every mapping of the full VLM (TP=1, PP=1): vision tower, projector, language model."""
    yield from iter_vision_mappings(vision)
    for mapping in hf_mapping.iter_mappings(model):
        yield _lm_mapping(mapping)


def vlm_mapping_for(megatron_name: str, model: ModelConfig, vision: VisionConfig) -> VLMMapping:
    """The mapping of one full-model megatron parameter (global layer index).

    Also covers the language model's ``output_layer.weight`` of a tied model, which the last
    pipeline stage holds.
    """
    if megatron_name.startswith(_LM):
        return _lm_mapping(hf_mapping.mapping_for(megatron_name.removeprefix(_LM), model))
    for mapping in iter_vision_mappings(vision):
        if mapping.megatron == megatron_name:
            return mapping
    raise ConversionError(
        f"no Hugging Face mapping for megatron parameter {megatron_name!r}; the vision config "
        "(layers, normalization) may not match the checkpoint"
    )


@dataclasses.dataclass(frozen=True)
class VLMTable:
    """The VLM's table (``hf_mapping.MappingTable``): the vision tower's and the projector's
    mappings, then the language model's table under both prefixes."""

    model: ModelConfig
    vision: VisionConfig
    subject: ClassVar[str] = "megatron VLM"
    names_hint: ClassVar[str] = "layers, norms, tie_word_embeddings"
    config_hint: ClassVar[str] = "the model or vision config"
    ignored_hf: ClassVar[re.Pattern[str]] = _IGNORED_HF

    @property
    def language(self) -> hf_mapping.LanguageTable:
        return hf_mapping.LanguageTable(self.model)

    def mappings(self) -> list[VLMMapping]:
        return list(iter_vlm_mappings(self.model, self.vision))

    def mapping_for(self, megatron_name: str) -> VLMMapping:
        return vlm_mapping_for(megatron_name, self.model, self.vision)

    def to_megatron(
        self, m: VLMMapping, tensors: Sequence[torch.Tensor], *, padded_vocab: int
    ) -> torch.Tensor:
        return m.to_megatron(tensors, self.model, self.vision, padded_vocab=padded_vocab)

    def to_hf(self, m: VLMMapping, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return m.to_hf(tensor, self.model, self.vision)

    def gated(self, m: VLMMapping) -> bool:
        # only the language model's MLP is gated (the ViT's linear_fc1 is one plain matrix)
        return m.lm is not None and self.language.gated(m.lm)

    def canonical_hf(self, name: str) -> str:
        return canonical_hf_name(name)

    def unused_hf(self) -> set[str]:
        return {_LM + n for n in self.language.unused_hf()}

    def unused_megatron(self) -> set[str]:
        return {_LM + n for n in self.language.unused_megatron()}


def expected_hf_names(model: ModelConfig, vision: VisionConfig) -> set[str]:
    """Every tensor name (saved form) an InternVL checkpoint of this VLM holds."""
    return hf_mapping.table_hf_names(VLMTable(model, vision))


def check_hf_names(
    names: Iterable[str], model: ModelConfig, vision: VisionConfig, *, where: str = ""
) -> None:
    """Missing tensors, and tensors the megatron VLM would drop, are ValueErrors naming them.

    ``names`` may use the saved or the in-memory prefixes. A tied model's checkpoint may still
    hold ``language_model.lm_head.weight``; it is ignored.
    """
    hf_mapping.check_table_names(VLMTable(model, vision), names, where=where)


# ---------------------------------------------------------------------------------------------
# Layout transforms


def _vit_qkv_to_megatron(tensors: Sequence[torch.Tensor], heads: int) -> torch.Tensor:
    """q, k, v ``[nh*hd, (h)]`` -> ``[nh * 3 * hd, (h)]``, grouped per head."""
    rest = tensors[0].shape[1:]  # (h,) for weights, () for biases
    if any(t.shape != tensors[0].shape for t in tensors) or tensors[0].shape[0] % heads:
        shapes = [tuple(t.shape) for t in tensors]
        raise ConversionError(f"ViT q/k/v shapes {shapes} do not split into {heads} equal heads")
    grouped = torch.stack([t.reshape(heads, -1, *rest) for t in tensors], dim=1)
    return grouped.reshape(-1, *rest)  # [nh, 3, hd, (h)] flattened


def _vit_qkv_to_hf(
    tensor: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = tensor.shape[1:]
    grouped = tensor.reshape(heads, 3, -1, *rest)
    q, k, v = (grouped[:, i].reshape(-1, *rest) for i in range(3))
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Whole state dicts


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    model: ModelConfig,
    vision: VisionConfig,
    *,
    padded_vocab: int,
) -> dict[str, torch.Tensor]:
    """Full megatron (TP=1, PP=1) VLM state dict from a full InternVL one (either name form)."""
    return hf_mapping.table_to_megatron(
        VLMTable(model, vision), hf_state, padded_vocab=padded_vocab
    )


def iter_megatron_to_hf(
    mcore_state: Mapping[str, Any],
    model: ModelConfig,
    vision: VisionConfig,
    *,
    consume: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs (saved form) from a full megatron VLM state dict.

    ``_extra_state`` entries are skipped. With ``consume=True`` (and a mutable mapping) each
    megatron tensor is removed once mapped.
    """
    yield from hf_mapping.table_to_hf(VLMTable(model, vision), mcore_state, consume=consume)


def megatron_to_hf(
    mcore_state: Mapping[str, Any], model: ModelConfig, vision: VisionConfig
) -> dict[str, torch.Tensor]:
    """Full InternVL state dict (saved names) from a full megatron (TP=1, PP=1) VLM one."""
    return dict(iter_megatron_to_hf(mcore_state, model, vision))


def internvl_processor_files(vision: VisionConfig) -> dict[str, dict[str, Any]]:
    """``preprocessor_config.json`` and ``processor_config.json`` of transformers' InternVL
    processor, set to tile and normalise images as ``data/images.py`` does (vLLM's InternVL
    builds its processor from them)."""
    return {
        "preprocessor_config.json": {
            "image_processor_type": "GotOcr2ImageProcessor",
            "processor_class": "InternVLProcessor",
            "crop_to_patches": vision.max_tiles > 1,
            "min_patches": 1,
            "max_patches": vision.max_tiles,
            "size": {"height": vision.image_size, "width": vision.image_size},
            "do_resize": True,
            "resample": 3,  # bicubic
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(vision.image_mean),
            "image_std": list(vision.image_std),
            "do_convert_rgb": True,
        },
        "processor_config.json": {
            "processor_class": "InternVLProcessor",
            "image_seq_length": vision.tokens_per_tile,
        },
    }
