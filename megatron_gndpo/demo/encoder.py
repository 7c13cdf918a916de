"""The multimodal demo's vision encoder, pretrained to read digits: the stage a real VLM inherits.

A VLM's encoder comes pretrained (CLIP, SigLIP, InternViT) and stays frozen while the projector
and language model learn (the paper's runs). A *random* frozen ViT is no substitute: on the
visual task, where the digits sit at a random offset, a linear probe reads the first digit from
its output no better than from raw pixels (~0.4 held-out), and a VLM fine-tuned on top of it
never looks at the image (its loss stalls at the blind floor, every answer the same). So the demo
first pretrains the encoder alone, a few hundred Adam steps of a linear readout of both digits
from its flattened patch tokens (the tokens the projector receives; the class token is dropped),
then freezes it. Teacher and student share this encoder (InternVL3.5's sizes share
InternViT-300M), so the gap between them is the language model's.

The encoder is megatron-core's ``CLIPViTModel`` as ``build_vlm`` builds it; the readout head is
thrown away. Cached as a plain state dict beside a hash of how it was made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.images import ImageLayout, normalise, tile_image
from megatron_gndpo.data.tasks import visual
from megatron_gndpo.parallel.groups import ParallelGroups

_STATE = "encoder.pt"
_META = "encoder.json"
_CACHE_VERSION = 1
# The digits a problem shows (difficulty 1: two), each one of ten classes.
_DIGITS = 2


@dataclasses.dataclass(frozen=True)
class EncoderRecipe:
    """How the shared encoder is pretrained (its architecture is the VisionConfig's)."""

    steps: int = 600
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 7


@dataclasses.dataclass(frozen=True)
class PretrainedEncoder:
    """The encoder's weights on disk and how well its readout reads held-out digits."""

    path: Path  # state dict of VisionLanguageModel.vision_model
    accuracy: float  # both digits right, on held-out images
    seconds: float
    cached: bool

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = torch.load(self.path, weights_only=True)
        return state


def pretrain_encoder(
    directory: str | Path,
    vision: VisionConfig,
    language: ModelConfig,
    groups: ParallelGroups,
    train: Sequence[visual.VisualProblem],
    held_out: Sequence[visual.VisualProblem],
    recipe: EncoderRecipe | None = None,
) -> PretrainedEncoder:
    """Pretrain (or reuse) the encoder of ``vision`` on ``train``'s images and digits.

    ``language`` is any language model the encoder will sit in (``build_vlm`` builds the whole
    VLM; only its encoder is kept). Every problem must show ``_DIGITS`` digits (difficulty 1).
    """
    from megatron_gndpo.models.vlm import build_vlm

    recipe = recipe or EncoderRecipe()
    directory = Path(directory)
    key = _key(vision, recipe, train, held_out)
    meta_file = directory / _META
    if meta_file.is_file() and (directory / _STATE).is_file():
        meta = json.loads(meta_file.read_text())
        if meta["key"] == key:
            return PretrainedEncoder(
                directory / _STATE, float(meta["accuracy"]), float(meta["seconds"]), True
            )
    if any(len(p.digits) != _DIGITS for p in [*train, *held_out]):
        raise ValueError(f"the encoder's readout expects {_DIGITS} digits per image (difficulty 1)")

    started = time.perf_counter()
    layout = ImageLayout.of(vision)
    torch.manual_seed(recipe.seed)
    # any TP=1 model will do: the encoder's weights are all we keep
    model = build_vlm(
        language, dataclasses.replace(vision, freeze_encoder=False), ParallelConfig(), groups
    )
    encoder = model.vision_model
    head = torch.nn.Linear(vision.tokens_per_tile * vision.hidden_size, _DIGITS * 10)
    x_train, y_train = _pixels(train, layout), _digits(train)
    x_test, y_test = _pixels(held_out, layout), _digits(held_out)
    parameters = [*encoder.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=recipe.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(recipe.seed)
    encoder.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(recipe, step)
        rows = torch.randint(0, x_train.shape[0], (recipe.batch_size,), generator=generator)
        logits = _readout(encoder, head, x_train[rows], vision)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), y_train[rows].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    encoder.eval()
    with torch.no_grad():
        predicted = _readout(encoder, head, x_test, vision).argmax(-1)
    accuracy = float((predicted == y_test).all(-1).float().mean())
    seconds = time.perf_counter() - started

    directory.mkdir(parents=True, exist_ok=True)
    torch.save(encoder.state_dict(), directory / _STATE)
    meta = {
        "key": key,
        "accuracy": accuracy,
        "seconds": seconds,
        "recipe": dataclasses.asdict(recipe),
    }
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")  # last: marks a complete entry
    return PretrainedEncoder(directory / _STATE, accuracy, seconds, False)


def _readout(
    encoder: Any, head: torch.nn.Linear, x: torch.Tensor, vision: VisionConfig
) -> torch.Tensor:
    """``[n, 2, 10]`` digit logits from the flattened patch tokens (class token dropped)."""
    tokens = encoder(x)
    if vision.has_class_token:
        tokens = tokens[:, encoder.class_token_len :]
    return head(tokens.reshape(x.shape[0], -1)).view(-1, _DIGITS, 10)


def _lr(recipe: EncoderRecipe, step: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    warm = min(1.0, (step + 1) / recipe.warmup_steps)
    return recipe.lr * warm * 0.5 * (1.0 + math.cos(math.pi * step / recipe.steps))


def _pixels(problems: Sequence[visual.VisualProblem], layout: ImageLayout) -> torch.Tensor:
    tiles = [tile for p in problems for tile in tile_image(p.image, layout.image_size, 1)]
    return normalise(tiles, layout)


def _digits(problems: Sequence[visual.VisualProblem]) -> torch.Tensor:
    return torch.tensor([p.digits for p in problems])


def _key(
    vision: VisionConfig,
    recipe: EncoderRecipe,
    train: Sequence[visual.VisualProblem],
    held_out: Sequence[visual.VisualProblem],
) -> str:
    h = hashlib.sha256(
        json.dumps(
            [_CACHE_VERSION, dataclasses.asdict(vision), dataclasses.asdict(recipe)], sort_keys=True
        ).encode()
    )
    for p in [*train, *held_out]:
        h.update(bytes(p.digits))
        h.update(p.image.tobytes())
    return h.hexdigest()
