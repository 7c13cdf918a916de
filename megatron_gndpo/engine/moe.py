"""The router losses of a mixture-of-experts student, reported once per optimizer step.

The losses themselves are megatron-core's: the router computes the load-balancing (Switch) loss
and the z-loss during the student's training forward, attaches their gradients to its
activations through ``MoEAuxLossAutoScaler`` (the schedule sets that scaler's loss scale, as in
megatron's training loop, so their weight per micro-batch does not depend on the number of
micro-batches or data-parallel ranks) and records their values in megatron's MoE metrics tracker.
Nothing here changes a gradient: this module reads the tracker after the forward/backward
schedule, as megatron's own training loop does, and clears it.

The teacher adds no router loss: it scores in eval mode under ``torch.no_grad``, where the router
neither attaches nor records them (the student's no-grad scoring passes neither).
"""

from __future__ import annotations

from typing import Any

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
