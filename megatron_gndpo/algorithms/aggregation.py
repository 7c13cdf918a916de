"""Loss aggregation in Megatron's per-token contract: a sum and a count, never a local mean.

Shape legend: ``B`` = sequences in this micro-batch, ``T`` = response length (right-padded).
``loss_BT`` = per-token loss L, ``response_mask_BT`` = m.

With ``calculate_per_token_loss=True`` a megatron-core loss function returns
``(loss_sum, count, report)``; megatron-core adds the counts over micro-batches, all-reduces
them once over the DP × CP group and divides the summed gradients by that total. So
:func:`aggregate_loss` returns ``(numerator, count)`` such that

    Σ_{ranks, micro-batches} numerator / Σ_{ranks, micro-batches} count

is exactly the global aggregate, whatever the split across ranks and micro-batches:

- ``token-mean``: numerator Σ m·L, count Σ m (the global token mean);
- ``seq-mean-token-mean``: numerator Σ_i [Σ_t m·L / Σ_t m] over rows with at least one token,
  count = number of such rows (the global mean over sequences of each one's token mean).

Difference from the GNDPO release: it hard-codes seq-mean-token-mean inside its GSPO loss and
weights micro-batches by the number of keys of a Python dict (fixed upstream in verl PR 2524).
Here the mode is a separate choice and micro-batches are weighted by their true counts.
seq-mean-token-mean needs each row whole on one rank (no context-parallel split of a row).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.stats import check_same_shape, masked_values

# Names the config layer validates ``algorithm.loss_aggregation`` against.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")

# megatron-core accumulates counts into an int32 tensor (``total_num_tokens`` in
# pipeline_parallel/schedules.py) in place, so a float count would fail there.
_COUNT_DTYPE = torch.int32


def aggregate_loss(
    loss_BT: torch.Tensor, response_mask: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(numerator, count)`` of ``mode`` for one micro-batch: float32 0-d and int32 0-d.

    token-mean:           (Σ_{i,t} m·L,  Σ_{i,t} m)
    seq-mean-token-mean:  (Σ_i [Σ_t m·L / max(1, Σ_t m)],  #{i : Σ_t m ≥ 1})

    loss_BT, response_mask: ``[B, T]`` (``B`` may be 0). Masked positions contribute exactly 0
    (value and gradient), even if they hold inf or NaN. Divide the global sum of numerators by
    the global sum of counts (megatron-core does this with ``calculate_per_token_loss=True``).
    Source: ALGORITHMS.md §4; verl ``agg_loss`` after PR 2524.
    """
    check_same_shape(loss=loss_BT, response_mask=response_mask)
    if mode not in AGGREGATIONS:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}"
        )
    masked_loss_BT = masked_values(loss_BT.float(), response_mask)
    tokens_B = response_mask.to(_COUNT_DTYPE).sum(-1)
    if mode == "token-mean":
        return masked_loss_BT.sum(), tokens_B.sum().to(_COUNT_DTYPE)
    row_mean_B = masked_loss_BT.sum(-1) / tokens_B.clamp(min=1)
    return row_mean_B.sum(), (tokens_B > 0).sum().to(_COUNT_DTYPE)


def global_count(count: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``count`` summed over ``group`` (the DP × CP group), same dtype; ``None``: a copy.

    Use it where megatron-core does not do the reduction for you (e.g. for reports); every rank
    of the group must call it.
    """
    total = count.detach().clone()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
