"""Built-in rollouts for a VLM student: images prefilled into the KV cache, then text decoding.

:class:`MultimodalGenerator` is the built-in :class:`~megatron_gndpo.rollout.builtin.
MegatronGenerator` (KV cache, any TP/PP) on a
:class:`~megatron_gndpo.models.vlm.VisionLanguageModel`. Prompts carry expanded image
placeholders (``data/images.py``); each prompt's image embeddings are computed once, on the first
pipeline stage, before decoding starts. The lean decoder prefills each prompt whole, its text
and image embeddings combined as the model combines them; megatron's lock-step path instead
gives every forward chunk the embeddings of the placeholders it holds, in order (an image may
straddle the prefill of a shorter row and the lock-step steps of a longer one). Decoding then
runs on the language model alone. The placeholder id is never sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from megatron_gndpo.data.datasets import PromptImages, tiles_of
from megatron_gndpo.models.vlm import rollout_image_embeddings
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import Rollout, SamplingParams
from megatron_gndpo.rollout.builtin import Decoder, LastTokenLogits, MegatronGenerator
from megatron_gndpo.rollout.decode import inner_model


@dataclasses.dataclass(frozen=True)
class TextLogits(LastTokenLogits):
    """:class:`LastTokenLogits` that never lets the image placeholder be sampled."""

    image_token_id: int = -1

    def gathered(self, logits_bv: torch.Tensor, tp_group: Any) -> torch.Tensor:
        logits_bV = super().gathered(logits_bv, tp_group)
        logits_bV[:, self.image_token_id] = float("-inf")
        return logits_bV


class MultimodalGenerator(MegatronGenerator):
    """:class:`MegatronGenerator` whose prompts may carry images (one tile tensor per prompt)."""

    def __init__(
        self,
        model: Any,
        groups: ParallelGroups,
        *,
        vocab_size: int,
        pad_id: int,
        max_sequence_length: int,
        max_batch_rows: int | None = None,
        decoder: Decoder = "lean",
        record_routing: bool = False,
    ) -> None:
        super().__init__(
            model,
            groups,
            vocab_size=vocab_size,
            pad_id=pad_id,
            max_sequence_length=max_sequence_length,
            max_batch_rows=max_batch_rows,
            decoder=decoder,
            record_routing=record_routing,
        )
        self.image_token_id = int(model.image_token_index)
        if pad_id == self.image_token_id:
            raise ValueError(f"the pad id {pad_id} must not be the image placeholder id")
        self.head = TextLogits(vocab_size, image_token_id=self.image_token_id)
        self._row_embeddings: list[torch.Tensor] | None = None  # [P_r, h] per rollout row
        self._prompt_ids: list[list[int]] = []  # the prompt of each rollout row

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        images: Sequence[PromptImages | torch.Tensor | None] | None = None,
    ) -> Rollout:
        """Sample as :meth:`MegatronGenerator.generate`; ``images[i]`` are prompt i's images
        (:class:`PromptImages`, or just their tiles ``[n, 3, H, W]``); None: no images."""
        if images is None:
            images = [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"need one image entry per prompt, got {len(images)}")
        if self.groups.is_first_stage:
            per_prompt = [
                self._embeddings(p, tiles_of(x)) for p, x in zip(prompts, images, strict=True)
            ]
            k = params.samples_per_prompt
            self._row_embeddings = [e for e in per_prompt for _ in range(k)]
            self._prompt_ids = [list(p) for p in prompts for _ in range(k)]
        try:
            return super().generate(prompts, params, seeds=seeds)
        finally:
            self._row_embeddings, self._prompt_ids = None, []

    def _embeddings(self, prompt: Sequence[int], tiles: torch.Tensor | None) -> torch.Tensor:
        placeholders = sum(1 for t in prompt if t == self.image_token_id)
        n_tiles = 0 if tiles is None else tiles.shape[0]
        if placeholders != n_tiles * self.model.tokens_per_tile:
            raise ValueError(
                f"a prompt holds {placeholders} image placeholders but its {n_tiles} tile(s) "
                f"need {n_tiles * self.model.tokens_per_tile}"
            )
        if tiles is None or n_tiles == 0:
            return torch.empty(0)
        return rollout_image_embeddings(self.model, tiles)

    def _call_model(
        self, net: Any, tokens_BS: torch.Tensor, positions_BS: torch.Tensor, context: Any
    ) -> torch.Tensor:
        chunk: torch.Tensor | None = None
        if self._row_embeddings is not None:
            # each row's placeholders in [offset, offset + L) are a contiguous slice of its
            # embeddings: those before the chunk were consumed by earlier chunks
            offset = int(positions_BS[0, 0])
            parts = []
            for row, emb in enumerate(self._row_embeddings):
                if emb.numel() == 0:
                    continue
                ids = self._prompt_ids[row]
                before = sum(1 for t in ids[:offset] if t == self.image_token_id)
                inside = int((tokens_BS[row] == self.image_token_id).sum())
                parts.append(emb[before : before + inside])
            chunk = torch.cat(parts) if sum(p.shape[0] for p in parts) else None
        out: torch.Tensor = net(
            None,
            tokens_BS,
            positions_BS,
            None,
            image_embeddings=chunk,
            inference_context=context,
            output_processor=self.head,
        )
        return out

    def _language_model(self) -> Any:
        return inner_model(self.model).language_model

    def _prefill_embeddings(self, rows: list[int], tokens_RT: torch.Tensor) -> torch.Tensor | None:
        """Text and image embeddings of the prompts (first stage; rows right-padded)."""
        if not self.groups.is_first_stage:
            return None
        assert self._row_embeddings is not None
        parts = [self._row_embeddings[r] for r in rows if self._row_embeddings[r].numel()]
        device = next(self.model.parameters()).device
        tokens_RT = tokens_RT.to(device)
        positions_RT = torch.arange(tokens_RT.shape[1], device=device).expand_as(tokens_RT)
        embeddings: torch.Tensor = inner_model(self.model)._combined_embeddings(
            None, tokens_RT, positions_RT, torch.cat(parts) if parts else None
        )
        return embeddings  # [T, R, h]
