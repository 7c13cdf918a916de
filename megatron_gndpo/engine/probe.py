"""The trainer's side of the weight-sync check: the student's log-probs of the probe sequence.

``weight_sync/check.py`` holds the probe, its tolerance and the verdict; the trainer's own
log-probs of the probe are a scoring pass (collective over the model's groups), so they are
computed here, beside the scoring they use. Every rank of the job calls :func:`check_engine`;
ranks without an engine pass None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_gndpo.engine.scoring import broadcast_from_last_stage, score_batch
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.weight_sync.check import ProbedEngine, agree, probe_difference, probe_tokens


def model_probe(
    model: Any,
    groups: ParallelGroups,
    *,
    vocab_size: int,
    excluded_ids: Sequence[int] = (),
    vision_language: bool = False,
) -> torch.Tensor:
    """``model``'s log-probs ``[PROBE_LENGTH - 1]`` (fp32, CPU) of the probe's tokens after the
    first, on every rank of its groups (a scoring pass: collective over them)."""
    tokens = probe_tokens(vocab_size, excluded_ids)
    tokens_BS = torch.tensor([tokens])
    lengths = torch.tensor([len(tokens)])
    scores = score_batch(
        model, groups, tokens_BS, lengths, head=TokenLogProbs(vocab_size),
        token_budget=len(tokens), images=[None] if vision_language else None,
    )  # fmt: skip
    ours = None if scores is None else scores.logprobs
    return broadcast_from_last_stage(ours, tokens_BS.shape, groups)[0, 1:].float().cpu()


def check_engine(
    engine: ProbedEngine | None,
    model: Any,
    groups: ParallelGroups,
    *,
    vocab_size: int,
    tolerance: float,
    excluded_ids: Sequence[int] = (),
    vision_language: bool = False,
) -> dict[str, float]:
    """Compare ``engine``'s probe log-probs with ``model``'s; raise :class:`WeightSyncError`
    on every rank when any engine differs by more than ``tolerance`` (mean per token) or is not
    finite. Returns ``weight_sync/check_logprob_diff`` (the largest difference of any engine).

    ``vocab_size``: the model's vocabulary as the engine sees it (the HF config's
    ``vocab_size``: the engine normalises over all of it, so the trainer does too).
    ``vision_language``: ``model`` is a VLM (the probe is text: its language model alone);
    ``excluded_ids`` never appear in the probe (a VLM's image placeholder needs an image).
    """
    ours = model_probe(
        model, groups, vocab_size=vocab_size, excluded_ids=excluded_ids,
        vision_language=vision_language,
    )  # fmt: skip
    diff = 0.0
    if engine is not None:
        tokens = probe_tokens(vocab_size, excluded_ids)
        diff = probe_difference(engine.prompt_logprobs(tokens), ours)
    return agree(diff, tolerance)
