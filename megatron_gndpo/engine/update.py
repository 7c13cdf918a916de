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
import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from megatron_gndpo.algorithms import aggregate_loss
from megatron_gndpo.algorithms.divergences import Divergence, topk_divergence
from megatron_gndpo.algorithms.losses import (
    gspo_token_loss,
    importance_sampled_pg_loss,
    ppo_clip_loss,
)
from megatron_gndpo.config.schema import AlgorithmConfig
from megatron_gndpo.engine.moe import router_loss_metrics, router_loss_scale
from megatron_gndpo.engine.optimizer import step_optimizer
from megatron_gndpo.engine.scoring import (
    padded_positions,
    required,
    row_images,
    sequence_multiple,
)
from megatron_gndpo.models import routing
from megatron_gndpo.models.inputs import forward_args
from megatron_gndpo.models.logprob_head import ScoreContext, Scores, TokenLogProbs


@dataclasses.dataclass
class Targets:
    """A method's per-token inputs of the update beyond the tokens and the old log-probs
    (``methods/``: each method's ``targets``), in the scoring convention.

    The update forms ``g·PG(A) + λ·d·D(q, π_θ) − β·H`` per token (``algorithms/guidance.py``),
    ``D`` the divergence ``aux_divergence`` between the target ``q`` and the student on the
    ``K`` ids (``algorithms/divergences.py``); by default ``Σ_k q (log q − log π_θ)``.
    """

    advantages: torch.Tensor  # [n, S] float32: A
    pg_mask: torch.Tensor | None = None  # [n, S]: g, tokens in the policy gradient (None: all)
    aux_ids: torch.Tensor | None = None  # [n, S, K] int64: ids of the distillation target q
    aux_logq: torch.Tensor | None = None  # [n, S, K] float32: log q on those ids
    aux_mask: torch.Tensor | None = None  # [n, S]: d, tokens with the distillation term
    aux_coef: float = 0.0  # λ
    entropy_coef: float = 0.0  # β
    # D: by default the forward KL to q on the K ids as given (TGPO, TrOPD)
    aux_divergence: Divergence = dataclasses.field(default_factory=Divergence)


@dataclasses.dataclass
class UpdateBatch:
    """This rank's rows for the update, in the scoring convention: the sampled ``tokens``, the
    student's log-probs at the rollout weights, the method's :class:`Targets`, and
    ``is_weights`` w, the off-policy correction's importance weights (``algorithms/offpolicy.py``;
    None: 1), which scale only the policy-gradient term, never the token count the loss is
    divided by.
    """

    tokens: torch.Tensor  # [n, S] int64
    old_logprobs: torch.Tensor  # [n, S] float32
    targets: Targets
    response_mask: torch.Tensor  # [n, S] bool
    is_weights: torch.Tensor | None = None  # [n, S] float32
    images: list[torch.Tensor | None] | None = None  # per row: its image tiles (a VLM)
    # [n, S, L, k]: an MoE student's routers replay these experts (rollout routing replay)
    routing: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Only the policy gradient: the head computes the sampled tokens' log-probs alone."""
        t = self.targets
        return t.pg_mask is None and t.aux_ids is None and t.entropy_coef == 0.0


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


def _columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x[:, :width]``, zero-padded on the right where ``x`` is narrower."""
    if x.shape[1] >= width:
        return x[:, :width]
    out = x.new_zeros((x.shape[0], width, *x.shape[2:]))
    out[:, : x.shape[1]] = x
    return out


def _micro_batches(
    batch: UpdateBatch, rows: list[int], size: int, multiple: int = 1
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ``size`` rows, each cut after its last response token and padded to a
    multiple of ``multiple`` positions (the TP size under sequence parallelism)."""
    t = batch.targets
    optional = {
        "pg_mask": t.pg_mask, "is_weights": batch.is_weights, "aux_ids": t.aux_ids,
        "aux_logq": t.aux_logq, "aux_mask": t.aux_mask,
    }  # fmt: skip
    out = []
    for start in range(0, len(rows), size):
        idx = torch.tensor(rows[start : start + size])
        mask = batch.response_mask[idx]
        positions = padded_positions(
            int(mask.nonzero()[:, 1].max()) + 1 if bool(mask.any()) else 1, multiple
        )
        width = positions.shape[0]
        tokens = _columns(batch.tokens[idx], width)
        mb = {
            "tokens": tokens,
            "positions": positions.expand_as(tokens),
            "targets": _shift(tokens),
            "old": _shift(_columns(batch.old_logprobs[idx], width)),
            "adv": _shift(_columns(t.advantages[idx], width)),
            "mask": _shift(_columns(mask, width)),
        }
        mb |= {k: _shift(_columns(v[idx], width)) for k, v in optional.items() if v is not None}
        if batch.routing is not None:  # per position, not per prediction: not shifted
            mb["routing"] = _columns(batch.routing[idx], width)
        if batch.images is not None:
            tiles = row_images(batch.images, idx.tolist())
            if tiles is not None:
                mb["images"] = tiles
        out.append(mb)
    return out


def token_loss(
    output: torch.Tensor | Scores,
    mb: dict[str, torch.Tensor],
    batch: UpdateBatch,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``[b, L]`` = ``w·g·PG(A) + λ·d·D(q, π_θ) − β·H`` and its info.

    ``output``: the head's log-probs ``[b, L]`` (plain batches) or its :class:`Scores` with
    ``extra_logprobs`` at ``aux_ids`` and ``entropy``.
    """
    logprobs = output if isinstance(output, torch.Tensor) else output.logprobs
    loss, info = policy_loss(logprobs, mb["old"], mb["adv"], mb["mask"], cfg)
    if "is_weights" in mb:  # the off-policy correction: the policy-gradient term only
        loss = loss * mb["is_weights"]
    if "pg_mask" in mb:
        loss = torch.where(mb["pg_mask"].bool(), loss, 0.0)
    t = batch.targets
    if isinstance(output, Scores) and "aux_ids" in mb and t.aux_coef:
        extra = required(output.extra_logprobs, "the log-probs at aux_ids")
        kl = topk_divergence(extra, mb["aux_logq"], t.aux_divergence)
        loss = loss + t.aux_coef * torch.where(mb["aux_mask"].bool(), kl, 0.0)
        info["aux"] = kl.detach()
    if isinstance(output, Scores) and t.entropy_coef:
        loss = loss - t.entropy_coef * required(output.entropy, "the entropy")
    return loss, info


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

    A mini-batch without a response token on any rank (its rows all dropped by
    ``algorithm.filter``) takes no optimizer step; its dict is ``{"empty": 1.0, "skipped": 0.0}``.

    ``dp_group`` is the data-parallel x context-parallel group the loss is averaged over.
    Metrics: ``loss`` (the global aggregated loss of the step, last stage only), ``grad_norm``
    (pre-clip, global), ``skipped`` (1.0 when a non-finite norm skipped the step), ``lr``, and
    policy statistics (``ratio/mean``, ``clip/frac``, and ``guidance/kl_mean`` when there is a
    distillation term) as global token means, and an MoE student's router losses
    (``moe/load_balancing_loss``, ``moe/z_loss``; engine/moe.py).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = list(range(batch.tokens.shape[0]))
    per_step = len(rows) // optimizer_steps
    device = next(ddp_model.parameters()).device
    multiple = sequence_multiple(ddp_model)
    results = []
    for k in range(optimizer_steps):
        mine = rows[k * per_step : (k + 1) * per_step]
        if _no_tokens(batch.response_mask[mine], dp_group):
            # every row of this mini-batch, on every rank, was dropped before scoring
            # (algorithm.filter): no gradient, and a step on none would still move the weights
            # (Adam's momentum, weight decay)
            results.append({"empty": 1.0, "skipped": 0.0})
            continue
        micro = _micro_batches(batch, mine, micro_batch_size, multiple)

        def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
            mb = {key: value.to(device) for key, value in next(data_iterator).items()}
            context: Any = mb["targets"]
            if not batch.plain:
                context = ScoreContext(
                    mb["targets"], extra_ids=mb.get("aux_ids"), entropy=_wants_entropy(batch)
                )
            inputs = forward_args(
                mb["tokens"], mb["positions"], None, vision=batch.images is not None,
                images=mb.get("images"),
            )  # fmt: skip
            if "routing" in mb:
                routing.set_targets(replays, mb["routing"], device)
            output = net(*inputs, output_processor=head, output_processor_context=context)

            def loss_func(output: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
                mask = mb["mask"]
                loss_bL, info = token_loss(output, mb, batch, algorithm)
                numerator, count = aggregate_loss(loss_bL, mask, algorithm.aggregation)
                tokens = mask.sum().clamp(min=1)
                report = {
                    # [sum, count]: megatron sums reports over micro-batches; we divide later
                    key: torch.stack([(info[name] * mask).sum().detach(), tokens])
                    for key, name in _REPORTED.items()
                    if name in info
                }
                report["loss"] = torch.stack([numerator.detach(), count.float()])
                return numerator, count, report

            return output, loss_func

        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        aux_scale = router_loss_scale(ddp_model.config, micro, algorithm.aggregation, dp_group)
        if aux_scale is not None:  # MoE: the router losses' weight (engine/moe.py); [1] as
            # megatron's default scale is, which it copies into the one it kept
            scale = torch.tensor([aux_scale], device=device)
            ddp_model.config.moe_grad_scale_func = functools.partial(torch.clone, scale)
        replay: AbstractContextManager[list[Any]] = (
            routing.replaying(ddp_model) if batch.routing is not None else nullcontext([])
        )
        with replay as replays:
            reports = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[ddp_model],
                num_microbatches=len(micro),
                seq_length=max(m["tokens"].shape[1] for m in micro),
                micro_batch_size=max(m["tokens"].shape[0] for m in micro),
                forward_only=False,
            )
        if aux_scale is not None:
            ddp_model.config.moe_grad_scale_func = None
        # an MoE student's router losses (megatron's tracker; all ranks, every stage)
        moe = router_loss_metrics(ddp_model.config, len(micro))
        results.append(step_optimizer(optimizer, scheduler) | _summarise(reports, dp_group) | moe)
    return results


def _no_tokens(mask_nS: torch.Tensor, dp_group: Any) -> bool:
    """Whether no rank of ``dp_group`` has a response token in its rows of a mini-batch (one
    all-reduce; the pipeline stages and tensor-parallel ranks of a replica hold the same rows,
    so every rank decides alike)."""
    count = mask_nS.sum().reshape(1).double().cpu()
    torch.distributed.all_reduce(count, group=dp_group)
    return bool(count.item() == 0)


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
    return {k: float(t[0] / t[1].clamp(min=1.0)) for k, t in zip(keys, totals, strict=True)}


# Per-token loss info reported as global token means: metric name -> info key.
_REPORTED = {"ratio/mean": "ratio", "clip/frac": "clipped", "guidance/kl_mean": "aux"}


def _wants_entropy(batch: UpdateBatch) -> bool:
    return batch.targets.entropy_coef != 0.0
