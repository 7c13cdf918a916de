"""The student's rollout engine from the config: the built-in generator, its multimodal form,
or a colocated vLLM engine that starts from the architecture alone (the trainer loads the
weights)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gndpo.config import Config
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import Generator
from megatron_gndpo.rollout.builtin import MegatronGenerator


def never_sampled(cfg: Config) -> tuple[int, ...]:
    """Token ids no rollout samples: a VLM's image placeholder (the generators mask it)."""
    return () if cfg.model.vision is None else (cfg.model.vision.image_token_id,)


def build_generator(
    cfg: Config, student: Any, groups: ParallelGroups, tokenizer: Tokenizer, vocab: int
) -> Generator:
    """The engine ``rollout.engine`` names, for ``student`` on ``groups``; with rollout ranks
    apart (``rollout.disaggregate``) the built-in one, which the trainer evaluates with."""
    if cfg.rollout.engine == "builtin" and cfg.model.vision is not None:
        from megatron_gndpo.rollout.multimodal import MultimodalGenerator

        return MultimodalGenerator(
            student, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
            max_sequence_length=cfg.model.max_position_embeddings,
        )  # fmt: skip
    if cfg.rollout.engine == "builtin" or cfg.rollout.disaggregate.enabled:
        return MegatronGenerator(
            student, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
            max_sequence_length=cfg.model.max_position_embeddings,
            record_routing=cfg.model.is_moe,  # the trainer compares or replays the experts
        )  # fmt: skip
    from megatron_gndpo.rollout.vllm_engine import VLLMGenerator, write_engine_config

    # The engine starts from the architecture alone (dummy weights); the trainer loads them.
    engine_dir = Path(cfg.logging.run_dir) / "engine"
    if dist.get_rank() == 0:
        write_engine_config(
            engine_dir, cfg.model, family=cfg.model.hf_family, dtype=cfg.model.params_dtype,
            tokenizer_dir=cfg.data.tokenizer if cfg.model.vision is not None else None,
        )  # fmt: skip
    dist.barrier()
    return VLLMGenerator(
        cfg.rollout, engine_dir, pad_id=tokenizer.pad_id,
        tensor_parallel_size=cfg.parallel.tensor_parallel, dtype=cfg.model.params_dtype,
        seed=cfg.trainer.seed, max_model_len=cfg.model.max_position_embeddings,
        vision=_vision_input(cfg, student), vocab_size=vocab,
        model_vocab_size=cfg.model.vocab_size, excluded_ids=never_sampled(cfg),
        head_dim=cfg.model.head_dim,
    )  # fmt: skip


def _vision_input(cfg: Config, student: Any) -> Any:
    """How a VLM student's images reach vLLM (None for a text model)."""
    vision = cfg.model.vision
    if vision is None:
        return None
    from megatron_gndpo.data.images import ImageLayout
    from megatron_gndpo.models.vlm import rollout_image_embeddings
    from megatron_gndpo.rollout.vllm_engine import VisionInput

    return VisionInput(
        ImageLayout.of(vision),
        mode=cfg.rollout.vllm_image_input,
        embed=functools.partial(rollout_image_embeddings, student),
        freeze_encoder=vision.freeze_encoder,
        freeze_projector=vision.freeze_projector,
    )
