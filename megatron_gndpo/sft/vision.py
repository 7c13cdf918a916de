"""SFT of a vision-language model: ``-log p`` of a response given its images.

The model is a :class:`~megatron_gndpo.models.vlm.VisionLanguageModel` built by ``build_vlm``,
its pretrained encoder loaded before training. A row is encoded once by ``data/images.py``: its
ids hold ``tokens_per_tile`` placeholders per image tile, each replaced one for one by an image
embedding, so position ``t`` of the ids is position ``t`` of the language model and the text
family's next-token targets and response mask apply unchanged.

The loss covers the response (worked solution + EOS) only: the mask starts at the prompt's last
position, and image placeholders live in the prompt, so they are never a target. The frozen
encoder has ``requires_grad=False``: DDP gives it no gradient buffer and the optimizer never sees
it (``build_vlm``'s contract), so its weights stay bitwise unchanged.

Legend: b/L = a micro-batch's rows/positions, N = image tiles of the micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.images import ImageLayout, MultimodalExample, encode_multimodal
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.models.vlm import build_vlm
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.sft.text import SFTSequence, head_logprobs, micro_batch


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


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: a state dict of tensors has no ==
class VisionFamily:
    """A VLM of ``vision``'s encoder and image layout; ``encoder`` is a pretrained
    ``vision_model`` state dict loaded before training (on the first pipeline stage, which holds
    the encoder). The frozen parts (``vision``) are left out of DDP's buffers and the optimizer.
    """

    vision: VisionConfig
    encoder: Mapping[str, torch.Tensor] | None = None

    def build(self, model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups) -> Any:
        net = build_vlm(model, self.vision, parallel, groups)
        if self.encoder is not None and net.vision_model is not None:
            net.vision_model.load_state_dict(self.encoder)
        return net

    def batch(
        self, sequences: Sequence[VisionSFTSequence], pad_id: int, multiple: int
    ) -> dict[str, torch.Tensor]:
        """The text family's batch plus the rows' tiles, ``images [N, 3, H, W]`` in row order
        (absent when no row has an image)."""
        image_token_id = self.vision.image_token_id
        if pad_id == image_token_id:
            raise ValueError(f"the pad id {pad_id} must not be the image placeholder id")
        batch = micro_batch(sequences, pad_id, multiple)
        # a target that is an image placeholder has no text log-prob; the response never holds one
        if bool((batch["mask"] & (batch["targets"] == image_token_id)).any()):
            raise ValueError("an image placeholder falls inside a response; check prompt_length")
        tiles = [s.pixels for s in sequences if s.pixels is not None and s.pixels.shape[0] > 0]
        if tiles:
            batch["images"] = torch.cat(tiles)
        return batch

    def logprobs(self, net: Any, mb: dict[str, torch.Tensor], head: TokenLogProbs) -> torch.Tensor:
        """The images are embedded and spliced in at their placeholders first (the encoder
        without autograd when frozen)."""
        return head_logprobs(net, mb, head, mb.get("images"))
