"""The clipped policy update on megatron-core's forward/backward schedules.

One rollout batch (this data-parallel rank's rows) is split into ``optimizer_steps`` mini-batches
of whole micro-batches. Each mini-batch runs megatron's forward/backward schedule at any PP size:
the loss function returns megatron's ``(Σ m·L, count, report)`` (``calculate_per_token_loss``),
so megatron divides the summed gradients by the token (or sequence) count summed over
micro-batches and data-parallel ranks, once. Then the optimizer steps unless the global gradient
norm is not finite, in which case every rank skips it alike (the norm is all-reduced).

Legend: n = rows of this rank, S = sequence positions, b/L = a micro-batch's rows/positions.
Per-position tensors come in the scoring convention (``x[:, t]`` belongs to token ``t``); the
model's head at position ``t`` predicts token ``t + 1``, so they are shifted by one here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_gndpo.algorithms import aggregate_loss
from megatron_gndpo.algorithms.losses import (
    gspo_token_loss,
    importance_sampled_pg_loss,
    ppo_clip_loss,
)
from megatron_gndpo.config.schema import AlgorithmConfig
from megatron_gndpo.engine.optimizer import step_optimizer
from megatron_gndpo.models.logprob_head import TokenLogProbs


@dataclasses.dataclass
class UpdateBatch:
    """This rank's rows for the update, in the scoring convention."""

    tokens: torch.Tensor  # [n, S] int64
    old_logprobs: torch.Tensor  # [n, S] float32
    advantages: torch.Tensor  # [n, S] float32
    response_mask: torch.Tensor  # [n, S] bool


def _shift(x_nS: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = x[:, t + 1]``: align with the head's prediction at position ``t``."""
    out = torch.zeros_like(x_nS)
    out[:, :-1] = x_nS[:, 1:]
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``[b, L]`` of the configured policy loss, with its per-token info."""
    if cfg.policy_loss == "gspo":
        loss, info = gspo_token_loss(
            logprobs, old_logprobs, advantages, mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        )  # fmt: skip
    elif cfg.policy_loss == "ppo_clip":
        loss, info = ppo_clip_loss(
            logprobs, old_logprobs, advantages,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        )  # fmt: skip
    elif cfg.policy_loss == "is_pg":
        loss, info = importance_sampled_pg_loss(logprobs, old_logprobs, advantages)
    else:
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r}")
    return loss, dict(info)


def _micro_batches(batch: UpdateBatch, rows: list[int], size: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for start in range(0, len(rows), size):
        idx = torch.tensor(rows[start : start + size])
        mask = batch.response_mask[idx]
        width = int(mask.nonzero()[:, 1].max()) + 1 if bool(mask.any()) else 1
        tokens = batch.tokens[idx, :width]
        out.append(
            {
                "tokens": tokens,
                "targets": _shift(tokens),
                "old": _shift(batch.old_logprobs[idx, :width]),
                "adv": _shift(batch.advantages[idx, :width]),
                "mask": _shift(mask[:, :width]),
            }
        )
    return out


def run_update(
    ddp_model: Any,
    optimizer: Any,
    scheduler: Any,
    batch: UpdateBatch,
    *,
    head: TokenLogProbs,
    algorithm: AlgorithmConfig,
    micro_batch_size: int,
    optimizer_steps: int,
    dp_group: Any,
) -> list[dict[str, float]]:
    """Run ``optimizer_steps`` optimizer steps over ``batch``; one metrics dict per step.

    ``dp_group`` is the data-parallel x context-parallel group the loss is averaged over.
    Metrics: ``loss`` (the global aggregated loss of the step, last stage only), ``grad_norm``
    (pre-clip, global), ``skipped`` (1.0 when a non-finite norm skipped the step), ``lr``, and
    policy statistics (``ratio/mean``, ``clip/frac``) averaged over this rank's micro-batches.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = list(range(batch.tokens.shape[0]))
    per_step = len(rows) // optimizer_steps
    device = next(ddp_model.parameters()).device
    results = []
    for k in range(optimizer_steps):
        micro = _micro_batches(batch, rows[k * per_step : (k + 1) * per_step], micro_batch_size)

        def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
            mb = {key: value.to(device) for key, value in next(data_iterator).items()}
            positions = torch.arange(mb["tokens"].shape[1], device=device).expand_as(mb["tokens"])
            logprobs = net(
                mb["tokens"], positions, None,
                output_processor=head, output_processor_context=mb["targets"],
            )  # fmt: skip

            def loss_func(logprobs_bL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                mask = mb["mask"]
                loss_bL, info = policy_loss(logprobs_bL, mb["old"], mb["adv"], mask, algorithm)
                numerator, count = aggregate_loss(loss_bL, mask, algorithm.aggregation)
                tokens = mask.sum().clamp(min=1)
                report = {
                    # [sum, count]: megatron sums reports over micro-batches; we divide later
                    "loss": torch.stack([numerator.detach(), count.float()]),
                    "ratio": torch.stack([(info["ratio"] * mask).sum().detach(), tokens]),
                    "clipped": torch.stack([(info["clipped"] * mask).sum().detach(), tokens]),
                }
                return numerator, count, report

            return logprobs, loss_func

        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[ddp_model],
            num_microbatches=len(micro),
            seq_length=max(m["tokens"].shape[1] for m in micro),
            micro_batch_size=max(m["tokens"].shape[0] for m in micro),
            forward_only=False,
        )
        results.append(step_optimizer(optimizer, scheduler) | _summarise(reports, dp_group))
    return results


def _summarise(reports: list[dict[str, torch.Tensor]], dp_group: Any) -> dict[str, float]:
    """Global means from the per-micro-batch ``[sum, count]`` reports (last stage only).

    Only last-stage ranks have reports, and a last-stage rank's DP x CP group holds only
    last-stage ranks, so the all-reduce below is called by every member or by none.
    """
    if not reports:
        return {}
    keys = sorted(reports[0])
    totals = torch.stack([torch.stack([r[k] for r in reports]).sum(0) for k in keys]).double()
    torch.distributed.all_reduce(totals, group=dp_group)
    means = {k: float(t[0] / t[1].clamp(min=1.0)) for k, t in zip(keys, totals, strict=True)}
    return {"loss": means["loss"], "ratio/mean": means["ratio"], "clip/frac": means["clipped"]}
