"""The vision side of a vision-language model: encoder, projector, image preprocessing.

A frozen dataclass like the others in ``schema.py``; each field is documented once, right below
it. It is the optional ``model.vision`` section of :class:`~megatron_gndpo.config.schema.
ModelConfig` (null = text-only): ``model.vision`` for the student, ``teacher.model.vision`` for
the teacher. ``__post_init__`` only checks (the loader reports its errors under the section's
key); it never rewrites a value.

The number of image tokens one image tile becomes in the language model's sequence
(:attr:`VisionConfig.tokens_per_tile`) follows from the encoder, the image and patch sizes, the
class token and pixel shuffle. The data path expands each image's placeholder into that many
placeholder ids once per row, so student and teacher see the same ids.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# CLIP's normalisation (also what InternViT and LLaVA use up to rounding): per-channel mean and
# standard deviation of the pixel values in [0, 1].
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageNet's, which InternVL's image processor uses.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Pixel shuffle (InternVL) folds 2x2 neighbouring patches into one token of 4x the width.
PIXEL_SHUFFLE_FACTOR = 2


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Vision encoder, projector and image preprocessing of a LLaVA/InternVL-style model."""

    encoder: Literal["clip", "siglip", "internvit"] = "clip"
    """ViT flavour (megatron-core's CLIPViTModel subtypes): clip (pre-LayerNorm, class token, no
    patch bias), siglip (no class token, final LayerNorm), internvit (class token, patch bias,
    layer scale; use with pixel_shuffle and projector norm_mlp for InternVL)."""
    image_size: int = 28
    """Side of the square tile the encoder sees, in pixels; images are resized (and tiled, see
    max_tiles) to it."""
    patch_size: int = 7
    """Side of one ViT patch, in pixels; must divide image_size."""
    num_layers: int = 2
    """Transformer layers of the encoder."""
    hidden_size: int = 32
    """Width of the encoder."""
    ffn_hidden_size: int = 64
    """Width of the encoder's MLP."""
    num_attention_heads: int = 2
    """Attention heads of the encoder (must divide by the tensor-parallel size)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalisation layer of the encoder (InternViT-6B uses RMSNorm, the others LayerNorm)."""
    norm_epsilon: float = 1e-6
    """Epsilon of the encoder's normalisation layers."""
    layer_scale: float | None = None
    """Initial value of the learned per-channel layer scale on each residual branch (InternViT:
    0.1); null for none (CLIP, SigLIP)."""
    drop_class_token: bool = True
    """Drop the class token before the projector (LLaVA, InternVL). Must be false for siglip,
    which has none."""
    pixel_shuffle: bool = False
    """InternVL's pixel shuffle: 2x2 neighbouring patches become one token of 4x the width, so a
    tile gives a quarter of the tokens. Needs drop_class_token and an even patch grid."""
    projector: Literal["mlp", "norm_mlp", "affine"] = "mlp"
    """Vision-to-language projector: mlp (Linear-GELU-Linear, LLaVA-1.5), norm_mlp (LayerNorm
    first, InternVL's mlp1) or affine (one Linear)."""
    projector_ffn_hidden_size: int | None = None
    """Hidden width of the projector MLP; null means the language model's hidden size."""
    projector_norm_epsilon: float | None = None
    """Epsilon of the norm_mlp projector's LayerNorm; null means norm_epsilon. InternVL's mlp1
    uses torch's default, 1e-5 (Hugging Face conversion sets it)."""
    image_token_id: int = 3
    """Id of the image placeholder token in the language model's vocabulary; each image tile
    occupies tokens_per_tile consecutive copies of it."""
    image_start_id: int | None = None
    """Id of a token written before each image's placeholders (InternVL's ``<img>``); null writes
    none. vLLM's InternVL wraps every image in ``<img>`` ... ``</img>``, so rollout.engine=vllm
    with a VLM needs both ids set to match it."""
    image_end_id: int | None = None
    """Id of a token written after each image's placeholders (InternVL's ``</img>``); null writes
    none."""
    max_tiles: int = 1
    """Tiles per image (InternVL dynamic tiling: the image is cut into up to max_tiles tiles of
    image_size plus a thumbnail when it needs more than one); 1 resizes the whole image."""
    image_mean: tuple[float, float, float] = CLIP_MEAN
    """Per-channel mean subtracted from pixel values in [0, 1]."""
    image_std: tuple[float, float, float] = CLIP_STD
    """Per-channel standard deviation the centred pixel values are divided by."""
    freeze_encoder: bool = True
    """Keep the vision encoder frozen (no gradients, not in the optimizer), as in the paper."""
    freeze_projector: bool = False
    """Keep the projector frozen too."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid vision config:\n  - " + "\n  - ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency, each with its fix (empty when valid)."""
        out = []
        if self.image_size < 1 or self.patch_size < 1 or self.image_size % self.patch_size:
            out.append(
                f"patch_size ({self.patch_size}) must divide image_size ({self.image_size}); "
                "choose an image_size that is a multiple of patch_size"
            )
        if self.hidden_size % self.num_attention_heads:
            out.append(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                f"({self.hidden_size})"
            )
        if self.encoder == "siglip" and self.drop_class_token:
            out.append("siglip has no class token: set drop_class_token=false")
        if self.pixel_shuffle:
            if not self.drop_class_token:
                out.append("pixel_shuffle needs drop_class_token=true (it folds a square grid)")
            grid = self.image_size // max(self.patch_size, 1)
            if grid % PIXEL_SHUFFLE_FACTOR:
                out.append(
                    f"pixel_shuffle needs an even patch grid; image_size/patch_size = {grid}"
                )
        if self.max_tiles < 1:
            out.append(f"max_tiles must be >= 1, got {self.max_tiles}")
        if self.image_token_id < 0:
            out.append(f"image_token_id must be a vocabulary id (>= 0), got {self.image_token_id}")
        if (self.image_start_id is None) != (self.image_end_id is None):
            out.append(
                "set both image_start_id and image_end_id (the tokens around each image) or neither"
            )
        if (
            self.image_start_id is not None
            and len({self.image_start_id, self.image_end_id, self.image_token_id}) < 3
        ):
            out.append(
                "image_start_id, image_end_id and image_token_id must be three different ids"
            )
        if any(s <= 0 for s in self.image_std):
            out.append(f"image_std must be positive, got {self.image_std}")
        return out

    @property
    def has_class_token(self) -> bool:
        return self.encoder != "siglip"

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens one tile becomes in the language model's sequence."""
        n = self.patches_per_tile
        if self.has_class_token and not self.drop_class_token:
            n += 1
        if self.pixel_shuffle:
            n //= PIXEL_SHUFFLE_FACTOR**2
        return n

    @property
    def encoder_output_size(self) -> int:
        """Width of what the projector receives (4x the encoder's with pixel shuffle)."""
        return self.hidden_size * (PIXEL_SHUFFLE_FACTOR**2 if self.pixel_shuffle else 1)
