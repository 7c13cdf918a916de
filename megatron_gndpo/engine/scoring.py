"""Forward-only scoring of a rollout batch at any TP/PP: per-token log-probs, never logits.

Used for the teacher's log-probs and the student's "old" log-probs. The batch is split into
micro-batches by a token budget and run through megatron-core's forward-only pipeline schedule
on the model's own process groups (the teacher's layout may differ from the student's); the last
pipeline stage returns the log-probs (see :func:`broadcast_from_last_stage` for other stages).

Two ways to fill a micro-batch, with the same numbers (tests check it):

- padded: rows of similar length together, right-padded to the longest row of the micro-batch;
- packed: several rows concatenated into one, with a block-diagonal causal attention mask. RoPE
  depends only on relative positions, which the packing preserves inside each segment; learned
  absolute positions get per-segment position ids.

Legend: B = rows, S = padded row length, L = micro-batch row length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups


def plan_padded(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``token_budget`` padded tokens.

    Rows are taken longest first, so rows of similar length share a micro-batch and little is
    padding; a row longer than the budget forms a micro-batch alone.
    """
    _check_budget(token_budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for row in order:
        if batches:
            current = batches[-1]
            longest = lengths[current[0]]  # rows arrive longest first
            if (len(current) + 1) * longest <= token_budget:
                current.append(row)
                continue
        batches.append([row])
    return batches


def plan_packed(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows packed (first fit, longest first) into bins of at most ``token_budget`` tokens."""
    _check_budget(token_budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for row in order:
        for k, free in enumerate(room):
            if lengths[row] <= free:
                bins[k].append(row)
                room[k] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(token_budget - lengths[row])
    return bins


def _check_budget(token_budget: int) -> None:
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")


@dataclasses.dataclass
class _MicroBatch:
    rows: list[int]
    tokens: torch.Tensor  # [b, L]
    positions: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, L]: the next token at each position (0 where none)
    attention_mask: torch.Tensor | None  # [b, 1, L, L], True = masked; None = plain causal
    segments: list[tuple[int, int, int]]  # (row, batch index, start) of each original row


def _padded_micro_batch(
    tokens_BS: torch.Tensor, lengths: list[int], rows: list[int]
) -> _MicroBatch:
    width = max(lengths[r] for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : lengths[r]] = tokens_BS[r, : lengths[r]]
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    positions = torch.arange(width).unsqueeze(0).expand(len(rows), -1)
    segments = [(r, i, 0) for i, r in enumerate(rows)]
    return _MicroBatch(rows, tokens, positions, targets, None, segments)


def _packed_micro_batch(
    tokens_BS: torch.Tensor, lengths: list[int], rows: list[int]
) -> _MicroBatch:
    total = sum(lengths[r] for r in rows)
    tokens = torch.zeros(1, total, dtype=torch.long)
    targets = torch.zeros_like(tokens)
    positions = torch.zeros_like(tokens)
    segment_id = torch.empty(total, dtype=torch.long)
    segments, start = [], 0
    for k, r in enumerate(rows):
        n = lengths[r]
        tokens[0, start : start + n] = tokens_BS[r, :n]
        targets[0, start : start + n - 1] = tokens_BS[r, 1:n]
        positions[0, start : start + n] = torch.arange(n)
        segment_id[start : start + n] = k
        segments.append((r, 0, start))
        start += n
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    same_segment = segment_id.unsqueeze(0) == segment_id.unsqueeze(1)
    mask = ~(causal & same_segment)  # megatron convention: True = masked out
    return _MicroBatch(rows, tokens, positions, targets, mask.view(1, 1, total, total), segments)


def schedule_groups(groups: ParallelGroups, model_config: Any) -> dict[str, Any]:
    """The process-group arguments of megatron's schedules for a model on ``groups``.

    The model's own pipeline group, not megatron's global one: the teacher has its own layout.
    Build it once per model and reuse it (it creates a P2P communicator).
    """
    kwargs: dict[str, Any] = {"pg_collection": groups.pg_collection()}
    if groups.layout.pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        kwargs["p2p_communicator"] = P2PCommunicator(groups.pp, model_config)
    return kwargs


def score_tokens(
    model: Any,
    groups: ParallelGroups,
    tokens_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    head: TokenLogProbs,
    token_budget: int,
    pack: bool = False,
) -> torch.Tensor | None:
    """Log-probs of every token given its prefix, float32 ``[B, S]``, on the last stage.

    ``out[b, t] = log p(tokens[b, t] | tokens[b, :t])`` for ``1 <= t < lengths[b]``; 0 at t = 0
    and at padding. Every rank of the model's layout calls it with the same rows of its data
    shard (TP ranks of one pipeline hold the same rows); ranks off the last stage get None.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if tokens_BS.dim() != 2 or lengths_B.shape != tokens_BS.shape[:1]:
        raise ValueError(
            f"expected tokens [B, S] and lengths [B], got {tuple(tokens_BS.shape)} and "
            f"{tuple(lengths_B.shape)}"
        )
    lengths = [int(n) for n in lengths_B.tolist()]
    if any(n < 1 or n > tokens_BS.shape[1] for n in lengths):
        raise ValueError(f"every length must be in [1, {tokens_BS.shape[1]}], got {lengths}")
    plan = plan_packed if pack else plan_padded
    make = _packed_micro_batch if pack else _padded_micro_batch
    micro_batches = [make(tokens_BS.cpu(), lengths, rows) for rows in plan(lengths, token_budget)]
    device = next(model.parameters()).device

    def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        logprobs_bL = net(
            mb.tokens.to(device),
            mb.positions.to(device),
            None if mb.attention_mask is None else mb.attention_mask.to(device),
            output_processor=head,
            output_processor_context=mb.targets.to(device),
        )
        return logprobs_bL, lambda output, non_loss_data=True: output.detach().float()

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func(pp_size=groups.layout.pp)(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
                micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
                forward_only=True,
                collect_non_loss_data=True,
                **schedule_groups(groups, model.config),
            )
    finally:
        model.train(was_training)
    if not groups.is_last_stage:
        return None
    out_BS = torch.zeros(tokens_BS.shape, dtype=torch.float32)
    for mb, logprobs_bL in zip(micro_batches, outputs, strict=True):
        for row, index, start in mb.segments:
            n = lengths[row]
            # the log-prob predicted at position t is that of token t + 1
            out_BS[row, 1:n] = logprobs_bL[index, start : start + n - 1].cpu()
    return out_BS.to(tokens_BS.device)


def broadcast_from_last_stage(
    value: torch.Tensor | None,
    shape: Sequence[int],
    groups: ParallelGroups,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Give every pipeline stage the last stage's tensor (float32, ``shape``) on ``device``.

    Pass the model's device on GPUs so the broadcast goes through NCCL, not gloo.
    """
    if value is not None:
        value = value.to(device)
    if groups.layout.pp == 1:
        assert value is not None
        return value
    buffer = (
        value
        if value is not None
        else torch.empty(tuple(shape), dtype=torch.float32, device=device)
    )
    last = dist.get_process_group_ranks(groups.pp)[-1]
    dist.broadcast(buffer, src=last, group=groups.pp)
    return buffer
