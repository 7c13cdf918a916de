"""A tiny InternVL shared by the VLM conversion and vLLM multimodal tests: its transformers
config, and prompts with images (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.data.images import ImageLayout, normalise, tile_image

VOCAB = 96
IMAGE = 5  # image_token_id
TOKENS_PER_TILE = 4  # (28 / 7)^2 patches, pixel shuffle folds 2x2


def hf_config(**top: Any) -> Any:
    """The tiny InternVL's transformers config (``top``: more top-level keys)."""
    from transformers import InternVLConfig

    return InternVLConfig(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=28, patch_size=7, attention_bias=True, layer_scale_init_value=0.1,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2,
        ),
        image_token_id=IMAGE, image_seq_length=TOKENS_PER_TILE, dtype="float32", **top,
    )  # fmt: skip


def tiny_image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def prompt_images(layout: ImageLayout, *images: Any) -> PromptImages:
    tiles = [tile_image(i, layout.image_size, layout.max_tiles) for i in images]
    return PromptImages(
        normalise([t for per in tiles for t in per], layout),
        tuple(len(per) for per in tiles),
        tuple(images),
    )


def tiny_prompts(layout: ImageLayout) -> tuple[list[list[int]], list[PromptImages | None]]:
    """[text, wide image, text], [image, text, square image, text], [text]."""
    wide, square = tiny_image(70, 30, seed=1), tiny_image(28, 28, seed=2)
    first = prompt_images(layout, wide)
    second = prompt_images(layout, square, wide)
    g = torch.Generator().manual_seed(3)

    def text(n: int) -> list[int]:
        return [int(t) for t in torch.randint(6, VOCAB, (n,), generator=g)]

    ids = [
        text(3) + layout.image_ids(first.tiles_per_image[0]) + text(2),
        layout.image_ids(second.tiles_per_image[0]) + text(2)
        + layout.image_ids(second.tiles_per_image[1]) + text(1),
        text(5),
    ]  # fmt: skip
    return ids, [first, second, None]
