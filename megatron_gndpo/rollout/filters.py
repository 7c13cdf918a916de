"""Dynamic sampling: rollout rows dropped before the teacher and the student score them.

``algorithm.filter`` (docs/methods/filter.md). Each filter names the rows it drops
(:func:`drop_reasons`); a row any filter drops is *hollowed* (:func:`hollow`), not deleted: it
becomes a one-token stub with no response token. The row count and order stay, so the rows'
exchange between the student's and the teacher's data-parallel layouts, the prompt groups
(GRPO: rows of one prompt adjacent) and every seed are as without a filter; a stub costs each
scoring pass one token; with no response token it adds nothing to the loss, to the global token
count or to seq-mean-token-mean's row count, and its advantage is 0 whatever the estimator.

A dropped row keeps its reward: group statistics (GRPO's mean and std) are those of the whole
sampled group, before filtering, as DAPO's overlong filtering masks a truncated sample's loss
but keeps it in its group. Token statistics (GNDPO's and REINFORCE++'s whitening) are over the
kept rows' tokens, the only ones left.

Legend: N = this rank's rows, S = padded positions, L = MoE layers, k = experts per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_gndpo.algorithms.stats import global_sum
from megatron_gndpo.rollout.base import Rollout

# Why a row is dropped, in the order the metrics list them (filter/rows_dropped_frac/<reason>).
REASONS = ("truncated", "short", "zero_variance")

# The fewest response tokens a step can train on: the whitening of GNDPO and REINFORCE++ needs
# two. A step whose kept rows have fewer over all ranks is skipped (skipped/filtered_all).
MIN_STEP_TOKENS = 2


def drop_reasons(
    rollout: Rollout,
    rewards_N: torch.Tensor | None,
    group_size: int,
    *,
    drop_truncated: bool,
    min_response_tokens: int,
    drop_zero_variance_groups: bool,
) -> dict[str, torch.Tensor]:
    """The rows each enabled filter drops, ``[N]`` bool by reason (only the enabled ones):

    - ``truncated``: ``~finished``, the response hit the length limit without a stop token;
    - ``short``: ``lengths − prompt_lengths − finished < min_response_tokens`` (response
      tokens, the stop token not counted);
    - ``zero_variance``: every reward of the row's prompt group equal, ``std_g r = 0``, so its
      GRPO advantage ``(r − mean_g r) / (std_g r + eps)`` is 0 (DAPO's dynamic sampling). Rows
      ``[g·group_size, (g+1)·group_size)`` are group ``g``, as the rollout lays them out.

    Pure: no collective. Source: DAPO (arXiv 2503.14476), overlong filtering and dynamic
    sampling; verl ``algorithm.filter_groups``.
    """
    rows = rollout.tokens.shape[0]
    out: dict[str, torch.Tensor] = {}
    if drop_truncated:
        out["truncated"] = ~rollout.finished.bool()
    if min_response_tokens > 0:
        content = rollout.response_lengths - rollout.finished.long()  # the stop token is no text
        out["short"] = content < min_response_tokens
    if drop_zero_variance_groups:
        if rewards_N is None:
            raise ValueError(
                "algorithm.filter.drop_zero_variance_groups compares the verifiable rewards of a "
                "prompt's samples, but the prompts have no answers: give the data an answer "
                "column (data.answer_key), or turn the filter off"
            )
        if group_size < 2 or rows % group_size or rewards_N.shape != (rows,):
            raise ValueError(
                f"zero-variance groups need whole groups of group_size >= 2 samples and one "
                f"reward per row: {rows} rows, group_size {group_size}, rewards of shape "
                f"{tuple(rewards_N.shape)}; set rollout.samples_per_prompt >= 2"
            )
        r_GK = rewards_N.reshape(-1, group_size)
        uniform_G = (r_GK == r_GK[:, :1]).all(-1)
        out["zero_variance"] = uniform_G.repeat_interleave(group_size).to(rollout.finished.device)
    return out


def keep_rows(reasons: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """``[N]`` bool: the rows no filter drops (all of them without a filter)."""
    keep = torch.ones(rows, dtype=torch.bool)
    for dropped in reasons.values():
        keep = keep & ~dropped.cpu()
    return keep


def hollow(rollout: Rollout, keep_N: torch.Tensor, *, pad_id: int) -> Rollout:
    """``rollout`` with every row outside ``keep_N`` made a one-token stub, rows in place.

    A stub: ``tokens`` all ``pad_id`` (no image placeholder, so no ``images`` either),
    ``prompt_lengths = lengths = 1`` (no response token), ``sampler_logprobs`` 0, not
    ``finished``, no ``teacher_written`` token, ``routing`` experts ``0..k-1`` (what nothing
    routed gets; the stub's one position is never compared). ``prompt_index`` stays: the row
    remains in its prompt's group. Kept rows are unchanged; the width ``S`` stays. A new
    Rollout; ``rollout`` is not modified.
    """
    keep = keep_N.bool().to(rollout.tokens.device)
    if bool(keep.all()):
        return rollout
    drop = ~keep
    one = torch.ones_like(rollout.lengths)
    routing = rollout.routing
    if routing is not None:  # [N, S, L, k]
        experts = torch.arange(routing.shape[-1], dtype=routing.dtype, device=routing.device)
        routing = torch.where(drop.to(routing.device)[:, None, None, None], experts, routing)
    written = rollout.teacher_written
    images = rollout.images
    if images is not None:
        images = [
            tiles if kept else None for tiles, kept in zip(images, keep.tolist(), strict=True)
        ]
    return dataclasses.replace(
        rollout,
        tokens=torch.where(drop[:, None], pad_id, rollout.tokens),
        prompt_lengths=torch.where(drop, one, rollout.prompt_lengths),
        lengths=torch.where(drop, one, rollout.lengths),
        sampler_logprobs=torch.where(drop[:, None], 0.0, rollout.sampler_logprobs),
        finished=rollout.finished & keep,
        teacher_written=None if written is None else written & keep[:, None],
        images=images,
        routing=routing,
    )


def filter_metrics(
    rollout: Rollout, reasons: dict[str, torch.Tensor], keep_N: torch.Tensor, group: Any
) -> dict[str, float]:
    """The filter's global metrics (one float64 all-reduce over ``group``, every rank calls it):

    - ``filter/rows_dropped_frac``: share of the step's rows dropped, for any reason, and
      ``filter/rows_dropped_frac/<reason>`` for each enabled one (a row may have several);
    - ``filter/teacher_tokens_saved``: positions the teacher no longer scores, ``lengths − 1``
      summed over the dropped rows (the student's old-log-prob pass saves as many);
    - ``filter/tokens_kept``: response tokens of the kept rows, the step's training tokens.

    ``rollout`` is the unfiltered one; ``group`` the student's data-parallel group (each row
    counted once: the tensor, pipeline and context-parallel ranks of a replica hold the same
    rows); None: this process's rows alone.
    """
    keep = keep_N.bool().cpu()
    drop = ~keep
    lengths = rollout.lengths.cpu().double()
    local = torch.tensor(
        [float(len(keep)), float(drop.sum()), float(((lengths - 1.0) * drop).sum()),
         float((rollout.response_lengths.cpu().double() * keep).sum()),
         *(float(reasons[r].cpu().sum()) for r in REASONS if r in reasons)],
        dtype=torch.float64,
    )  # fmt: skip
    rows, dropped, saved, kept, *by_reason = global_sum(local, group).tolist()
    out = {
        "filter/rows_dropped_frac": dropped / max(rows, 1.0),
        "filter/teacher_tokens_saved": saved,
        "filter/tokens_kept": kept,
    }
    for reason, count in zip((r for r in REASONS if r in reasons), by_reason, strict=True):
        out[f"filter/rows_dropped_frac/{reason}"] = count / max(rows, 1.0)
    return out


def emptied_reasons(metrics: dict[str, float]) -> str:
    """Why the filter emptied a step, from its metrics: each reason's share of the rows."""
    prefix = "filter/rows_dropped_frac/"
    shares = [
        f"{k[len(prefix) :]} {v:.0%}" for k, v in sorted(metrics.items()) if k.startswith(prefix)
    ]
    return ", ".join(shares) or "no tokens left"
