"""The router losses of a mixture-of-experts student, reported once per optimizer step.

The losses themselves are megatron-core's: the router computes the load-balancing (Switch) loss
and the z-loss during the student's training forward, attaches their gradients to its
activations through ``MoEAuxLossAutoScaler`` (the schedule sets that scaler's loss scale, as in
megatron's training loop, so their weight per micro-batch does not depend on the number of
micro-batches or data-parallel ranks) and records their values in megatron's MoE metrics tracker.
This module reads the tracker after the forward/backward schedule, as megatron's own training
loop does, and clears it; and :func:`router_loss_scale` corrects the losses' weight for a loss
that does not count every token the router sees (its docstring).

The teacher adds no router loss: it scores in eval mode under ``torch.no_grad``, where the router
neither attaches nor records them (the student's no-grad scoring passes neither).
"""

from __future__ import annotations

from typing import Any

import torch

# megatron's tracker name -> our metric name
_LOSSES = {"load_balancing_loss": "moe/load_balancing_loss", "z_loss": "moe/z_loss"}


def router_loss_metrics(
    config: Any, num_microbatches: int, pg_collection: Any = None
) -> dict[str, float]:
    """``moe/load_balancing_loss`` and ``moe/z_loss`` of the last forward/backward (means over
    MoE layers and micro-batches, averaged over data-parallel ranks), for the losses that are on.

    Collective over the student's ranks (pipeline, TP x CP and DP groups): every rank calls it
    after the schedule, also a pipeline stage without MoE layers. ``config``: the student's
    TransformerConfig; a dense model gives ``{}`` without communicating.
    """
    if not getattr(config, "num_moe_experts", None):
        return {}
    coeffs = {"load_balancing_loss": config.moe_aux_loss_coeff, "z_loss": config.moe_z_loss_coeff}
    names = [name for name, coeff in coeffs.items() if coeff]
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    total: dict[str, float] = {}
    tracker.report(
        loss_scale=1.0 / num_microbatches,
        iteration=0,
        track_names=names,
        force_initialize=True,  # a stage without MoE layers still joins the reductions
        num_layers=config.num_layers,
        moe_layer_freq=config.moe_layer_freq,
        total_loss_dict=total,
        pg_collection=pg_collection,
    )
    return {_LOSSES[name]: float(value) for name, value in total.items()}


def router_loss_scale(
    config: Any, micro_batches: list[dict[str, Any]], aggregation: str, dp_group: Any
) -> float | None:
    """The scale that gives the router losses megatron's intended weight under our loss.

    With ``calculate_per_token_loss`` megatron multiplies each micro-batch's router loss by the
    tokens its router saw (``num_local_tokens`` x TP x CP) and divides every gradient by the
    global loss count, so that the router loss ends up averaged over micro-batches and DP ranks
    *when the loss counts every token the router sees*. Our loss counts response tokens (or
    rows, seq-mean-token-mean), while the router also sees the prompt and the padding: left
    alone, the router losses would weigh (routed tokens / loss count) times too much (5x for
    48-token prompts and 12-token responses). This is count / routed tokens, over the step's
    micro-batches and the DP x CP ranks (collective over ``dp_group``), for
    ``config.moe_grad_scale_func`` (megatron's hook for this scale); None for a dense model.
    Then each micro-batch's router loss enters with weight (its routed tokens / all routed
    tokens): a token-weighted mean, times its coefficient.
    """
    if not getattr(config, "num_moe_experts", None):
        return None
    from megatron_gndpo.algorithms import aggregate_loss

    totals = torch.zeros(2, dtype=torch.float64)
    for mb in micro_batches:
        mask = mb["mask"]
        totals[0] += float(aggregate_loss(torch.zeros(mask.shape), mask, aggregation)[1])
        totals[1] += mb["tokens"].numel()  # the router sees every position, padding included
    torch.distributed.all_reduce(totals, group=dp_group)
    return float(totals[0] / totals[1].clamp(min=1.0))
