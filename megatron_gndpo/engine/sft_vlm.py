"""Supervised fine-tuning of a vision-language model: ``-log p`` of a response given its images.

The multimodal counterpart of ``engine/sft.py`` and the same machinery (megatron-core DDP and
optimizer, ``get_forward_backward_func``, the fused :class:`TokenLogProbs` head, megatron's
``(Σ -log p, token count, report)`` loss contract, the seeded data stream), on a
:class:`~megatron_gndpo.models.vlm.VisionLanguageModel` built by ``build_vlm``. A row is encoded
once by ``data/images.py``: its ids hold ``tokens_per_tile`` placeholders per image tile, each
replaced one for one by an image embedding, so position ``t`` of the ids is position ``t`` of the
language model and the text path's next-token targets and response mask apply unchanged.

The loss covers the response (worked solution + EOS) only: the mask starts at the prompt's last
position, and image placeholders live in the prompt, so they are never a target. The frozen
encoder has ``requires_grad=False``: DDP gives it no gradient buffer and the optimizer never sees
it (``build_vlm``'s contract), so its weights stay bitwise unchanged.

Legend: b/L = a micro-batch's rows/positions, N = image tiles of the micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.images import ImageLayout, MultimodalExample, encode_multimodal
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.engine.optimizer import build_optimizer, build_scheduler, wrap_ddp
from megatron_gndpo.engine.sft import SFTModel, SFTSequence, check_batching, micro_batch, run_sft
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.models.vlm import build_vlm
from megatron_gndpo.parallel.groups import ParallelGroups


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: a tensor field has no ==
class VisionSFTSequence(SFTSequence):
    """An expanded prompt (image placeholders included), its response + EOS, and its tiles."""

    pixels: torch.Tensor | None = None  # [N, 3, H, W]; None for a text-only row


def encode_sft_multimodal(
    tokenizer: Tokenizer,
    layout: ImageLayout,
    rows: Iterable[tuple[MultimodalExample, str]],
) -> list[VisionSFTSequence]:
    """``(example, response text)`` -> expanded chat-templated prompt + response ids + EOS."""
    out = []
    for example, response in rows:
        row = encode_multimodal(example, tokenizer, layout)
        response_ids = tokenizer.encode(response)
        if layout.image_token_id in response_ids:
            raise ValueError(
                f"a response encodes to the image placeholder id {layout.image_token_id}: the "
                "tokenizer does not cover its text; choose a placeholder id it never produces"
            )
        tokens = (*row.ids, *response_ids, tokenizer.eos_id)
        out.append(VisionSFTSequence(tokens, len(row.ids), row.pixels))
    return out


def vision_sft_batch(
    sequences: Sequence[VisionSFTSequence], pad_id: int, image_token_id: int
) -> dict[str, torch.Tensor]:
    """:func:`~megatron_gndpo.engine.sft.micro_batch` plus the rows' tiles, ``images [N, 3, H,
    W]`` in row order (absent when no row has an image)."""
    if pad_id == image_token_id:
        raise ValueError(f"the pad id {pad_id} must not be the image placeholder id")
    batch = micro_batch(sequences, pad_id)
    # a target that is an image placeholder has no text log-prob; the response never holds one
    if bool((batch["mask"] & (batch["targets"] == image_token_id)).any()):
        raise ValueError("an image placeholder falls inside a response; check prompt_length")
    tiles = [s.pixels for s in sequences if s.pixels is not None and s.pixels.shape[0] > 0]
    if tiles:
        batch["images"] = torch.cat(tiles)
    return batch


def vlm_logprobs(net: object, mb: dict[str, torch.Tensor], head: TokenLogProbs) -> torch.Tensor:
    """A VisionLanguageModel's log-probs of ``mb["targets"]``, ``[b, L]``: the images are
    embedded and spliced in at their placeholders first (the encoder without autograd when
    frozen)."""
    positions = torch.arange(mb["tokens"].shape[1], device=mb["tokens"].device)
    logprobs_bL: torch.Tensor = net(  # type: ignore[operator]
        mb.get("images"), mb["tokens"], positions.expand_as(mb["tokens"]), None,
        output_processor=head, output_processor_context=mb["targets"],
    )  # fmt: skip
    return logprobs_bL


def build_vlm_sft_model(
    model_cfg: ModelConfig,
    vision_cfg: VisionConfig,
    parallel_cfg: ParallelConfig,
    groups: ParallelGroups,
    optimizer_cfg: OptimizerConfig,
    *,
    vocab_size: int,
    steps: int,
    seed: int,
    init: str | Path | None = None,
    encoder: Mapping[str, torch.Tensor] | None = None,
) -> SFTModel:
    """A trainable VLM on the student's groups: random from ``seed``, or loaded from ``init``.

    As :func:`~megatron_gndpo.engine.sft.build_sft_model`; ``encoder`` is a pretrained
    ``vision_model`` state dict loaded before training (on the first pipeline stage, which holds
    the encoder). The frozen parts (``vision_cfg``) are left out of DDP's buffers and the
    optimizer.
    """
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({vocab_size}); build the model with vocab_size >= {vocab_size}"
        )
    torch.manual_seed(seed)  # weights are initialised on the CPU generator
    model = build_vlm(model_cfg, vision_cfg, parallel_cfg, groups)
    if encoder is not None and model.vision_model is not None:
        model.vision_model.load_state_dict(encoder)
    if init is not None:
        load_checkpoint(init, model)
    ddp = wrap_ddp(model, use_distributed_optimizer=optimizer_cfg.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, optimizer_cfg)
    scheduler = build_scheduler(
        optimizer, optimizer_cfg, total_steps=steps, warmup_steps=optimizer_cfg.warmup_steps
    )
    return SFTModel(
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        head=TokenLogProbs(vocab_size=vocab_size),
        groups=groups,
    )


def vlm_sft_train(
    model_cfg: ModelConfig,
    vision_cfg: VisionConfig,
    parallel_cfg: ParallelConfig,
    groups: ParallelGroups,
    sequences: Sequence[VisionSFTSequence],
    *,
    optimizer: OptimizerConfig,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    seed: int,
    vocab_size: int,
    pad_id: int,
    init: str | Path | None = None,
    encoder: Mapping[str, torch.Tensor] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[SFTModel, list[dict[str, float]]]:
    """Build a VLM (from ``seed``, or loaded from ``init``) and fine-tune it ``steps`` steps.

    ``encoder`` as :func:`build_vlm_sft_model`. Batching, ``on_step`` and the returned metrics as
    :func:`~megatron_gndpo.engine.sft.sft_train`.
    """
    check_batching(groups, steps, batch_size, micro_batch_size)
    m = build_vlm_sft_model(
        model_cfg, vision_cfg, parallel_cfg, groups, optimizer,
        vocab_size=vocab_size, steps=steps, seed=seed, init=init, encoder=encoder,
    )  # fmt: skip
    image_token_id = vision_cfg.image_token_id
    history = run_sft(
        m, sequences, lambda rows: vision_sft_batch(rows, pad_id, image_token_id),
        steps=steps, batch_size=batch_size, micro_batch_size=micro_batch_size, seed=seed,
        call=vlm_logprobs, on_step=on_step,
    )  # fmt: skip
    return m, history
