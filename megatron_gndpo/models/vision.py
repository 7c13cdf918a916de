"""Vision encoders and projectors of a VLM, built on megatron-core without Transformer Engine.

megatron-core has the ViT (``CLIPViTModel`` with ``clip``, ``siglip`` and ``internvit`` subtypes),
a local ViT layer spec and the LLaVA projector (``MultimodalProjector``). Without Transformer
Engine it lacks three pieces, written here small:

- the ViT's own norms: ``CLIPViTModel`` defaults ``ln_pre``/``ln_post`` to ``torch.nn.LayerNorm``
  when TE is absent, which rejects the ``config=`` argument megatron passes; megatron's
  ``WrappedTorchNorm`` is given instead;
- InternViT's layer scale: a learned per-channel factor on each residual branch
  (``x + ls * f(norm(x))``), as :class:`LayerScaleAdd` in place of the bias-dropout-add;
- InternVL's projector (``mlp1``): LayerNorm over the pixel-shuffled features, then the MLP, as
  :class:`NormMLPProjector` (megatron-core has it only as a fused TE LayerNorm-linear).

All encoder weights are sharded over the language model's tensor-parallel group; with pipeline
parallelism the encoder and the projector live on the first stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.models.gpt import transformer_widths


class LayerScaleAdd(torch.nn.Module):
    """InternViT's ``residual + gamma * dropout(x + bias)`` as a TransformerLayer "bda".

    megatron's TransformerLayer calls ``bda(training, fused)(x_with_bias, residual, prob)``;
    this module is that callable, holding ``gamma`` ``[h]`` (InternViT's ``ls1`` / ``ls2``).
    """

    def __init__(self, hidden_size: int, init: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=params_dtype))

    def forward(self, training: bool, fused: bool = False) -> Callable[..., torch.Tensor]:
        def scale_add(
            x_with_bias: tuple[torch.Tensor, torch.Tensor | None],
            residual: torch.Tensor,
            prob: float,
        ) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = F.dropout(x, p=prob, training=training)
            return residual + self.weight.to(x.dtype) * x

        return scale_add


class NormMLPProjector(torch.nn.Module):
    """InternVL's projector: ``LayerNorm(input) -> Linear -> GELU -> Linear`` (TP-sharded MLP).

    Wraps megatron's ``MultimodalProjector`` (type ``mlp``) behind a LayerNorm over its input.
    """

    def __init__(self, config: Any, input_size: int, tp_group: Any, eps: float) -> None:
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector

        super().__init__()
        self.tp_group = tp_group
        self.norm = torch.nn.LayerNorm(input_size, eps=eps, dtype=config.params_dtype)
        self.mlp = MultimodalProjector(
            config, _projector_submodules(), "mlp", input_size, tp_group=tp_group
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.norm(hidden_states))
        return out

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The MLP's TP shards as shards, the norm replicated (dist-checkpointing).

        Without this, megatron treats a plain torch module as replicated across TP ranks, and
        every rank would save and load TP rank 0's slice of the MLP.
        """
        from megatron.core.transformer.utils import sharded_state_dict_default

        out: dict[str, Any] = {}
        for name, child in self.named_children():
            out.update(
                sharded_state_dict_default(
                    child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        return out


def _projector_submodules() -> Any:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def encoder_transformer_config(vision: VisionConfig, language_config: Any) -> Any:
    """The encoder's TransformerConfig: its own widths, the language model's TP and dtype.

    The encoder is one pipeline stage (the first): its config has pipeline size 1.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **transformer_widths(vision),
        add_qkv_bias=True,
        pipeline_model_parallel_size=1,
        masked_softmax_fusion=language_config.masked_softmax_fusion,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        **_gelu_mlp_on(language_config),
    )
    # read by megatron's LLaVAModel and get_num_image_embeddings
    config.vision_model_type = vision.encoder
    return config


def projector_transformer_config(vision: VisionConfig, language_config: Any) -> Any:
    """The projector MLP's config: output width = the language model's hidden size.

    megatron checks the head count against TP even though the projector has no attention, so
    the language model's head count is reused.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    lm = language_config
    return TransformerConfig(
        num_layers=1,
        hidden_size=lm.hidden_size,
        ffn_hidden_size=vision.projector_ffn_hidden_size or lm.hidden_size,
        num_attention_heads=lm.num_attention_heads,
        **_gelu_mlp_on(lm),
    )


def _gelu_mlp_on(language_config: Any) -> dict[str, Any]:
    """TransformerConfig fields the encoder and the projector share: biased GELU MLPs (InternViT
    and InternVL's projector), unfused, on the language model's TP group, dtype and
    initialisation."""
    lm = language_config
    return dict(
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=lm.init_method_std,
        params_dtype=lm.params_dtype,
        bf16=lm.bf16,
        fp16=lm.fp16,
        tensor_model_parallel_size=lm.tensor_model_parallel_size,
        use_cpu_initialization=lm.use_cpu_initialization,
    )


def encoder_layer_spec(vision: VisionConfig, config: Any) -> Any:
    """megatron-core's local ViT layer spec, with layer scale when ``vision.layer_scale`` is set."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_vit_layer_with_local_spec()
    if vision.layer_scale is None:
        return spec
    scale = ModuleSpec(
        module=LayerScaleAdd,
        params=dict(
            hidden_size=vision.hidden_size,
            init=vision.layer_scale,
            params_dtype=config.params_dtype,
        ),
    )
    spec.submodules = dataclasses.replace(spec.submodules, self_attn_bda=scale, mlp_bda=scale)
    return spec


def build_encoder(vision: VisionConfig, config: Any, pg_collection: Any) -> Any:
    """The ViT: megatron-core's ``CLIPViTModel`` of the chosen subtype, with torch-wrapped norms."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return CLIPViTModel(
        config,
        encoder_layer_spec(vision, config),
        ln_pre_impl=WrappedTorchNorm,
        ln_post_impl=WrappedTorchNorm,
        add_class_token=vision.has_class_token,
        class_token_len=1 if vision.has_class_token else 0,
        patch_dim=vision.patch_size,
        img_h=vision.image_size,
        img_w=vision.image_size,
        model_subtype=vision.encoder,
        pg_collection=pg_collection,
    )


def build_projector(vision: VisionConfig, config: Any, tp_group: Any) -> torch.nn.Module:
    """The projector from ``vision.encoder_output_size`` to the language model's width."""
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector

    if vision.projector == "norm_mlp":
        eps = vision.projector_norm_epsilon
        eps = vision.norm_epsilon if eps is None else eps
        return NormMLPProjector(config, vision.encoder_output_size, tp_group, eps)
    return MultimodalProjector(
        config, _projector_submodules(), vision.projector, vision.encoder_output_size, tp_group
    )
