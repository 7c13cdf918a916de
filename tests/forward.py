"""A plain forward of a megatron GPT shard for the conversion tests: full log-probs, no schedule.

Shapes: tokens [b, s]; a stage's output [b, s, Vp/tp] on the last stage, [s, b, h] before it.
"""

from __future__ import annotations

from typing import Any

import torch


def full_logprobs(
    net: Any, groups: Any, tokens: torch.Tensor, *, hidden: int, vocab: int
) -> torch.Tensor | None:
    """log-probs [b, s, vocab] on every rank of the last pipeline stage (None on the others).

    Each stage receives the previous stage's activations and sends its own on (point-to-point
    over the pipeline); the last stage gathers the vocabulary shards over TP and trims the
    padding. Every rank of the model calls it with the same tokens.
    """
    import torch.distributed as dist

    layout, coords = groups.layout, groups.coords
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if not groups.is_first_stage:
            received = torch.empty(tokens.shape[1], tokens.shape[0], hidden)  # [s, b, h]
            dist.recv(received, src=layout.rank_of(coords | {"pp": coords["pp"] - 1}))
            net.set_input_tensor(received)
        out = net(tokens, positions, attention_mask=None)
        if not groups.is_last_stage:
            dist.send(out.contiguous(), dst=layout.rank_of(coords | {"pp": coords["pp"] + 1}))
            return None
        parts = [torch.empty_like(out) for _ in range(layout.tp)]  # out: [b, s, Vp/tp]
        dist.all_gather(parts, out.contiguous(), group=groups.tp)
        return torch.cat(parts, dim=-1)[..., :vocab].log_softmax(-1)
