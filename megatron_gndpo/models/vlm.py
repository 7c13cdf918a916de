"""Vision-language models (LLaVA / InternVL style) on megatron-core, student and teacher.

:class:`VisionLanguageModel` is megatron-core's ``LLaVAModel`` (language GPT + ViT + projector,
its parameter names, freezing, pipeline input handling and shared embeddings) with two changes:

- the encoder and projector are built by ``models/vision.py`` (the pieces megatron-core lacks
  without Transformer Engine, InternViT's layer scale and InternVL's projector);
- ``forward`` works on **expanded** token ids: every image tile occupies ``tokens_per_tile``
  consecutive placeholder ids (``VisionConfig.image_token_id``), each replaced one for one by an
  image embedding. The combined sequence is then the token sequence itself: position ``t`` of the
  ids is position ``t`` of the language model, the KV cache and the log-probs, so rollouts,
  scoring and the update need no position remapping. It also forwards an ``output_processor``
  (:class:`~megatron_gndpo.models.logprob_head.TokenLogProbs`) to the language model, so no
  logits are ever formed. ``LLaVAModel.forward`` does neither, and its labels path drops the
  response token right after an image.

With pipeline parallelism the encoder, the projector and the embedding live on the first stage;
the encoder is always one stage with the language model's tensor parallelism. The frozen parts
(the encoder, optionally the projector) have ``requires_grad=False``, so megatron's DDP gives them
no gradient buffer and ``get_megatron_optimizer`` leaves them out; they also run without autograd.
"""

from __future__ import annotations

from typing import Any, Self, TypedDict, Unpack, cast

import torch

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.models import vision as vision_parts
from megatron_gndpo.models.gpt import (
    LanguageModelArgs,
    language_model_args,
    layer_spec,
    transformer_config,
)
from megatron_gndpo.parallel.groups import ParallelGroups


class LanguageForward(TypedDict, total=False):
    """What the VLM's ``forward`` passes on to its language model (GPTModel's ``forward``)."""

    inference_context: Any  # the KV cache of a KV-cached decode
    output_processor: Any  # replaces the output layer (models/logprob_head.py), last stage
    output_processor_context: Any  # what the processor reads besides the hidden states
    runtime_gather_output: bool | None


class _ExpandedPlaceholders:
    """The methods :class:`VisionLanguageModel` adds to or replaces in megatron-core's
    ``LLaVAModel`` (mixed in before it, so ``forward`` and ``train`` are these): the images
    embedded and spliced in one for one at their placeholder ids, and the language model's
    output processor passed through (module docstring)."""

    # set by LLaVAModel.__init__ or VisionLanguageModel.__init__
    vision: VisionConfig
    vision_model: Any
    vision_projection: Any
    language_model: Any
    image_token_index: int
    img_seq_len: int
    pre_process: bool

    @property
    def tokens_per_tile(self) -> int:
        return int(self.img_seq_len)

    def train(self, mode: bool = True) -> Self:
        super().train(mode)  # type: ignore[misc]
        # a frozen encoder stays in eval mode (dropout off), as in the paper's runs
        if self.vision_model is not None and self.vision.freeze_encoder:
            self.vision_model.eval()
        return self

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` tiles -> ``[n * tokens_per_tile, h_lm]`` projected embeddings.

        Frozen parts run without autograd: no activations are kept for them.
        """
        from megatron.core.models.multimodal.llava_model import pixel_shuffle

        vision = self.vision
        with torch.set_grad_enabled(torch.is_grad_enabled() and not vision.freeze_encoder):
            x = self.vision_model(images.to(self.vision_model.conv1.weight.dtype))
            if vision.drop_class_token and vision.has_class_token:
                x = x[:, self.vision_model.class_token_len :, :]
            if vision.pixel_shuffle:
                x = pixel_shuffle(x)  # [n, tokens_per_tile, 4 * h_vit]
        x = x.permute(1, 0, 2).contiguous()  # [tokens_per_tile, n, h]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not vision.freeze_projector):
            x = self.vision_projection(x)  # [tokens_per_tile, n, h_lm]
        # tile-major: tile 0's tokens, then tile 1's, ... (the placeholders' order)
        return x.transpose(0, 1).reshape(-1, x.shape[-1])

    def forward(
        self,
        images: torch.Tensor | None,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        *,
        image_embeddings: torch.Tensor | None = None,
        **language: Unpack[LanguageForward],
    ) -> torch.Tensor:
        """Language-model output on the combined sequence (logits, or the processor's).

        ``input_ids [b, s]`` hold ``tokens_per_tile`` placeholder ids per tile of
        ``images [n, 3, H, W]`` (all rows' tiles, row-major); every placeholder position
        takes the next image embedding. Stages after the first ignore ``images`` and ids.
        ``image_embeddings [P, h]`` (from :meth:`image_embeddings`) may replace ``images``:
        one per placeholder in the ids, in order (a KV-cached prefill or decode chunk may
        hold only part of an image). ``language`` goes to the language model as it is.
        """
        decoder_input = None
        if self.pre_process:
            assert input_ids is not None
            decoder_input = self._combined_embeddings(
                images, input_ids, position_ids, image_embeddings
            )
        return self.language_model(
            None, position_ids, attention_mask, decoder_input=decoder_input, **language
        )

    def _combined_embeddings(
        self,
        images: torch.Tensor | None,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        image_NH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        image_mask_BS = input_ids == self.image_token_index
        n_placeholders = int(image_mask_BS.sum())
        if image_NH is not None:
            if image_NH.shape[0] != n_placeholders:
                raise ValueError(
                    f"{image_NH.shape[0]} image embeddings for {n_placeholders} placeholders"
                )
            images = None
        n_tiles = 0 if images is None else images.shape[0]
        if image_NH is None and n_placeholders != n_tiles * self.tokens_per_tile:
            raise ValueError(
                f"the ids hold {n_placeholders} image placeholders (id "
                f"{self.image_token_index}) but {n_tiles} image tile(s) need "
                f"{n_tiles} x {self.tokens_per_tile}; expand each image's placeholder with "
                "megatron_gndpo.data.images before scoring"
            )
        text_ids = input_ids.masked_fill(image_mask_BS, 0)
        embeddings_SBH: torch.Tensor = self.language_model.embedding(
            input_ids=text_ids, position_ids=position_ids
        )
        if image_NH is None:
            if images is None or n_tiles == 0:
                return embeddings_SBH
            image_NH = self.image_embeddings(images)
        image_NH = image_NH.to(embeddings_SBH.dtype)
        # [s, b] order of the mask must visit placeholders row by row: transpose to [b, s]
        embeddings_BSH = embeddings_SBH.transpose(0, 1)
        mask_BSH = image_mask_BS.unsqueeze(-1).expand_as(embeddings_BSH)
        embeddings_BSH = embeddings_BSH.masked_scatter(mask_BSH, image_NH)
        return embeddings_BSH.transpose(0, 1).contiguous()


def _class() -> type:
    """The model class, defined on first use (megatron-core is imported lazily)."""
    global _VLM_CLASS
    if _VLM_CLASS is None:
        _VLM_CLASS = _define_class()
    return _VLM_CLASS


_VLM_CLASS: type | None = None


def _define_class() -> type:
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.transformer.enums import ModelType

    class VisionLanguageModel(_ExpandedPlaceholders, LLaVAModel):
        """LLaVAModel on expanded image placeholders, with a log-prob output processor."""

        def __init__(
            self,
            *,
            vision: VisionConfig,
            language_config: Any,
            language_spec: Any,
            rope_scaling_factor: float | None = None,
            **lm: Unpack[LanguageModelArgs],
        ) -> None:
            encoder_config = vision_parts.encoder_transformer_config(vision, language_config)
            projector_config = vision_parts.projector_transformer_config(vision, language_config)
            # LLaVAModel builds the language model; the encoder is built below instead (its
            # own builder cannot take the norms or the layer scale megatron-core lacks).
            pre_process, pg_collection = lm["pre_process"], lm["pg_collection"]
            super().__init__(
                language_transformer_config=language_config,
                language_transformer_layer_spec=language_spec,
                language_vocab_size=lm["vocab_size"],
                language_max_sequence_length=lm["max_sequence_length"],
                vision_transformer_config=encoder_config,
                vision_transformer_layer_spec=None,
                drop_vision_class_token=vision.drop_class_token,
                vision_projection_config=projector_config,
                vision_projection_layer_spec=None,
                parallel_output=lm["parallel_output"],
                share_embeddings_and_output_weights=lm["share_embeddings_and_output_weights"],
                language_position_embedding_type=lm["position_embedding_type"],
                pre_process=pre_process,
                post_process=lm["post_process"],
                add_encoder=False,
                add_decoder=True,
                img_h=vision.image_size,
                img_w=vision.image_size,
                patch_dim=vision.patch_size,
                language_rotary_base=lm["rotary_base"],
                language_rope_scaling=rope_scaling_factor is not None,
                language_rope_scaling_factor=rope_scaling_factor or 8.0,
                image_token_index=vision.image_token_id,
                pixel_shuffle=vision.pixel_shuffle,
                pg_collection=pg_collection,
            )
            # megatron's schedules read model_type; LLaVAModel does not set it
            self.model_type = ModelType.encoder_or_decoder
            self.vision = vision
            if pre_process:
                self.add_encoder = True
                self._drop_vision_class_token = vision.drop_class_token
                self.vision_model = vision_parts.build_encoder(
                    vision, encoder_config, pg_collection
                )
                self.vision_projection = vision_parts.build_projector(
                    vision, projector_config, pg_collection.tp
                )
            if self.img_seq_len != vision.tokens_per_tile:
                raise AssertionError(
                    f"megatron-core counts {self.img_seq_len} image tokens per tile, "
                    f"VisionConfig {vision.tokens_per_tile}: update VisionConfig.tokens_per_tile"
                )
            self.freeze(
                freeze_language_model=False,
                freeze_vision_model=vision.freeze_encoder,
                freeze_vision_projection=vision.freeze_projector,
            )

    return VisionLanguageModel


def build_vlm(
    model: ModelConfig,
    vision: VisionConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    *,
    parallel_output: bool = True,
) -> Any:
    """A :class:`VisionLanguageModel` holding this rank's shard, encoder frozen per ``vision``.

    The language model is the GPT of ``model`` (same TransformerConfig and layer spec as
    :func:`~megatron_gndpo.models.gpt.build_gpt`), sharded over ``parallel``'s TP and PP.
    """
    common = language_model_args(model, parallel, groups, parallel_output=parallel_output)
    if parallel.sequence_parallel or parallel.context_parallel > 1:
        raise ValueError(
            "megatron-core's LLaVA model supports sequence/context parallelism only with "
            "Transformer Engine attention; set sequence_parallel=false and context_parallel=1"
        )
    tp = parallel.tensor_parallel
    if vision.num_attention_heads % tp:
        raise ValueError(
            f"the vision encoder's num_attention_heads ({vision.num_attention_heads}) must divide "
            f"by tensor_parallel ({tp})"
        )
    if not 0 <= vision.image_token_id < model.vocab_size:
        raise ValueError(
            f"vision.image_token_id ({vision.image_token_id}) is not in the language model's "
            f"vocabulary [0, {model.vocab_size}); use the tokenizer's image placeholder id"
        )
    return _class()(
        vision=vision,
        language_config=transformer_config(model, parallel),
        language_spec=layer_spec(model),
        rope_scaling_factor=model.rotary_scaling_factor,
        **common,
    )


def build_vlm_teacher(
    model: ModelConfig, vision: VisionConfig, parallel: ParallelConfig, groups: ParallelGroups
) -> Any:
    """The frozen VLM teacher: eval mode, no gradients, its own layout."""
    teacher = build_vlm(model, vision, parallel, groups)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def frozen_parameters(model: Any) -> dict[str, torch.Tensor]:
    """Copies of the parameters that do not train (the frozen encoder/projector), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def rollout_image_embeddings(model: Any, tiles: torch.Tensor) -> torch.Tensor:
    """``[n, 3, H, W]`` tiles -> ``[n * tokens_per_tile, h_lm]``, as a rollout sees them: eval
    mode (no dropout), no autograd, on the model's device (the first pipeline stage's)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return cast(torch.Tensor, model.image_embeddings(tiles.to(device)))
    finally:
        model.train(was_training)
