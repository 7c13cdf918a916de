"""Vocabulary rows that differ between a checkpoint and the model loading it.

We pad the embedding and the output layer to a multiple of ``make_vocab_size_divisible_by × TP``
(as Megatron-LM does), Megatron-Bridge builds exactly Hugging Face's row count, and another TP
size or padding multiple gives another count. megatron-core saves those two tensors with
``allow_shape_mismatch``, so dist-checkpointing loads the rows both have: rows the checkpoint
lacks come back as zeros and rows the model lacks are dropped. Rows at or past
``model.vocab_size`` take no probability mass in our scoring (``TokenLogProbs`` masks them), so
zeros there are harmless. What must not pass silently:

- the checkpoint has fewer rows than ``model.vocab_size``: real tokens would load as zeros;
- the dropped rows belong to the checkpoint's own vocabulary. Its size is read from beside it
  (by the caller); where nothing tells it, the dropped rows must be all zero (padding as
  converters write it);

No collectives and no files here: :func:`megatron_gndpo.checkpoint.dist.load_checkpoint` calls
:func:`vocab_rows_problem` on rank 0 with what it read of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

Shape = tuple[int, ...]


def vocab_rows_problem(
    directory: Path,
    flexible: Mapping[str, Shape],
    saved: Mapping[str, tuple[Shape, torch.dtype]],
    *,
    vocab_size: int | None,
    saved_vocab: int | None,
    read: Callable[[str], torch.Tensor],
    config_path: Path,
) -> str:
    """Why loading ``directory`` would lose or invent vocabulary rows ("" when it would not).

    ``flexible``: the model's tensors whose rows may differ (global shapes, vocabulary first);
    ``saved``: the checkpoint's tensors (shape, dtype); ``vocab_size``: the model's real
    vocabulary (None skips the check for missing rows); ``saved_vocab``: the checkpoint's own,
    where something beside it tells it; ``read(key)``: one whole saved tensor, read only when
    dropped rows must be checked for zeros; ``config_path``: where a vocabulary size would be
    read from, for the message.
    """
    for key, shape in sorted(flexible.items()):
        if key not in saved or saved[key][0] == shape:
            continue  # a missing tensor is dist-checkpointing's own error
        rows, *width = saved[key][0]
        if tuple(width) != shape[1:]:
            # Another hidden size: every other tensor differs too, and dist-checkpointing's
            # shape check refuses the load naming one of them.
            continue
        if vocab_size is not None and rows < vocab_size:
            return (
                f"{key} in {directory} has {rows} rows, fewer than the model's vocab_size "
                f"({vocab_size}): rows {rows}..{vocab_size - 1} would load as zeros. Set "
                f"vocab_size to the checkpoint's vocabulary ({rows} or its tokenizer's size), or "
                "load a checkpoint of this vocabulary"
            )
        if rows <= shape[0]:
            continue
        kept = shape[0]
        if saved_vocab is not None:
            if saved_vocab <= kept:
                continue
            return (
                f"{key} in {directory} has {rows} rows and its vocabulary is {saved_vocab} "
                f"tokens (written beside it), but the model has {kept} rows: tokens "
                f"{kept}..{saved_vocab - 1} would be dropped. Set vocab_size to {saved_vocab} "
                "(the checkpoint's vocabulary)"
            )
        tail = read(key)[kept:]
        nonzero = tail.reshape(len(tail), -1).ne(0).any(dim=1).nonzero().flatten() + kept
        if len(nonzero):
            first, last = int(nonzero[0]), int(nonzero[-1])
            return (
                f"{key} in {directory} has {rows} rows; the model has {kept}, and rows "
                f"{first}..{last} ({len(nonzero)} of those it would drop) are not zero, so they "
                "may be tokens. Nothing beside the checkpoint tells its vocabulary size. If they "
                f"are padding (its vocabulary has at most {kept} tokens), write its model config "
                f"to {config_path} (its vocab_size is what is read); if its vocabulary is "
                "larger, set vocab_size to it"
            )
    return ""
