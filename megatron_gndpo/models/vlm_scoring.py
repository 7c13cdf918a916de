"""Forward-only log-probs of a VLM on rows with images, at any TP/PP, never forming logits.

The multimodal counterpart of ``engine/scoring.score_tokens`` (same contract, same micro-batch
planning and schedule arguments), for a :class:`~megatron_gndpo.models.vlm.VisionLanguageModel`:
each row's ids hold its images' expanded placeholders (``data/images.py``), so the log-prob at
position ``t`` is that of ``tokens[t]`` given everything before it, image embeddings included; a
response that starts right after an image gets the log-prob of its first token from the last
image position, which megatron's LLaVA labels path would drop.

Legend: B = rows, S = padded row length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups


def score_multimodal(
    model: Any,
    groups: ParallelGroups,
    tokens_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    images: Sequence[torch.Tensor | None],
    *,
    head: TokenLogProbs,
    token_budget: int,
) -> torch.Tensor | None:
    """Log-probs of every text token given its prefix and images, float32 ``[B, S]``.

    ``out[b, t] = log p(tokens[b, t] | tokens[b, :t], images of row b)`` for
    ``1 <= t < lengths[b]`` where ``tokens[b, t]`` is not an image placeholder; 0 at image
    positions, at t = 0 and at padding. ``images[b]`` is row b's tiles ``[N_b, 3, H, W]`` (None
    without images). Every rank of the model's layout calls it with the same rows; ranks off the
    last stage get None. The trainer's scoring (``engine/scoring.score_batch`` with ``images``)
    with the image positions zeroed.
    """
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_gndpo.engine.scoring import score_batch

    if len(images) != tokens_BS.shape[0]:
        raise ValueError(
            f"expected one image entry per row: {tokens_BS.shape[0]} rows, {len(images)} entries"
        )
    scores = score_batch(
        model, groups, tokens_BS, lengths_B, head=head, token_budget=token_budget, images=images
    )
    if scores is None:
        return None
    out_BS = scores.logprobs
    image_token_id = get_attr_wrapped_model(model, "image_token_index")
    out_BS[tokens_BS == image_token_id] = 0.0  # an image position has no token log-prob
    return out_BS
