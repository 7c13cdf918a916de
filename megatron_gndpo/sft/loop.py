"""The SFT loop, one for every model family: build, batch, step, the seeded data stream.

Used by the demo to make its teachers and students start, and by the sequence-level KD
benchmark. The machinery is the student's (megatron-core DDP and optimizer,
``get_forward_backward_func``), at any TP/PP/DP. The model's output processor is the fused
log-prob head, so no ``[tokens, vocab]`` logits exist; the loss function returns megatron's
``(Σ -log p, token count, report)`` with ``calculate_per_token_loss``, so megatron divides the
summed gradients by the global number of response tokens of the step, once.

What differs between model families is an :class:`SFTFamily`: how the model is built (a
language model, or a VLM with its pretrained encoder), how a micro-batch's sequences become
tensors (a VLM's also carry their image tiles) and how the model is called on one.

Data order: step ``k`` takes the next ``batch_size`` sequences of a seeded endless stream of
epochs (:class:`~megatron_gndpo.data.PromptSampler`); data-parallel rank ``r`` takes its
contiguous share. The stream depends only on the seed, so any DP size sees the same batches.

Legend: b/L = a micro-batch's rows/positions. The head at position ``t`` gives the log-prob of
``targets[:, t] = tokens[:, t + 1]``, so the loss mask marks positions whose *next* token is part
of the response.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms import aggregate_loss
from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_gndpo.data.sampler import PromptSampler
from megatron_gndpo.engine.optimizer import (
    build_optimizer,
    build_scheduler,
    step_optimizer,
    wrap_ddp,
)
from megatron_gndpo.engine.scoring import sequence_multiple
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.sft.text import TEXT, SFTSequence

# Turns one micro-batch's sequences into tensors: tokens, targets, mask [b, L] (and more).
MakeBatch = Callable[[list[Any]], dict[str, torch.Tensor]]


class SFTFamily(Protocol):
    """What SFT needs to know of a model family (``sft/text.py``, ``sft/vision.py``)."""

    def build(self, model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups) -> Any:
        """This rank's shard of a fresh model (weights from the CPU generator's state), with
        any pretrained part the family loads before training."""
        ...

    def batch(
        self, sequences: Sequence[Any], pad_id: int, multiple: int
    ) -> dict[str, torch.Tensor]:
        """Right-padded ``tokens``, next-token ``targets`` and response ``mask`` ``[b, L]``
        (``L`` a multiple of ``multiple``), plus whatever :meth:`logprobs` also reads."""
        ...

    def logprobs(self, net: Any, mb: dict[str, torch.Tensor], head: TokenLogProbs) -> torch.Tensor:
        """The model's log-probs of ``mb["targets"]`` through the fused head, ``[b, L]``."""
        ...


def sft_loss(
    logprobs_bL: torch.Tensor, mask_bL: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """megatron's loss contract for ``-mean log p(target)`` over the masked positions.

    Returns ``(Σ m·(-log p), Σ m, {"loss": [sum, count]})``; megatron divides by the count summed
    over micro-batches and data-parallel ranks (``calculate_per_token_loss``).
    """
    numerator, count = aggregate_loss(-logprobs_bL, mask_bL, "token-mean")
    return numerator, count, {"loss": torch.stack([numerator.detach(), count.float()])}


@dataclasses.dataclass
class SFTModel:
    """A model shard with its DDP wrapper, optimizer and learning-rate schedule."""

    model: Any
    ddp: Any
    optimizer: Any
    scheduler: Any
    head: TokenLogProbs
    groups: ParallelGroups
    family: SFTFamily = TEXT


def build_sft_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    groups: ParallelGroups,
    optimizer_cfg: OptimizerConfig,
    *,
    vocab_size: int,
    steps: int,
    seed: int,
    init: str | Path | None = None,
    family: SFTFamily = TEXT,
) -> SFTModel:
    """A trainable model on the student's groups: random from ``seed``, or loaded from ``init``.

    ``vocab_size`` is the number of real token ids (the tokenizer's); ``steps`` sizes the
    learning-rate schedule of ``optimizer_cfg``; ``init`` is a model-only checkpoint (any layout),
    loaded after the family's pretrained parts. Frozen parameters (``requires_grad=False``, a
    VLM's encoder) get no gradient buffer and no optimizer state.
    """
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({vocab_size}); build the model with vocab_size >= {vocab_size}"
        )
    torch.manual_seed(seed)  # weights are initialised on the CPU generator
    model = family.build(model_cfg, parallel_cfg, groups)
    if init is not None:
        load_checkpoint(init, model)
    ddp = wrap_ddp(model, use_distributed_optimizer=optimizer_cfg.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, optimizer_cfg)
    scheduler = build_scheduler(
        optimizer, optimizer_cfg, total_steps=steps, warmup_steps=optimizer_cfg.warmup_steps
    )
    return SFTModel(
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        head=TokenLogProbs(vocab_size=vocab_size),
        groups=groups,
        family=family,
    )


def sft_step(m: SFTModel, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches (``m.family`` runs the model).

    Returns ``loss`` (mean ``-log p`` over the step's response tokens on all data-parallel
    ranks, on every pipeline stage), ``grad_norm`` (pre-clip, global), ``lr``, ``skipped``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(m.ddp.parameters()).device

    def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
        mb = {key: value.to(device) for key, value in next(data_iterator).items()}
        logprobs_bL = m.family.logprobs(net, mb, m.head)
        return logprobs_bL, lambda logprobs: sft_loss(logprobs, mb["mask"])

    m.ddp.train()
    m.ddp.zero_grad_buffer()
    m.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[m.ddp],
        num_microbatches=len(micro_batches),
        seq_length=max(mb["tokens"].shape[1] for mb in micro_batches),
        micro_batch_size=max(mb["tokens"].shape[0] for mb in micro_batches),
        forward_only=False,
    )
    out = step_optimizer(m.optimizer, m.scheduler)
    out["loss"] = _global_loss(reports, m.groups)
    return out


def _global_loss(reports: list[dict[str, torch.Tensor]], groups: ParallelGroups) -> float:
    """The step's mean loss: summed over micro-batches and DP x CP, shared with every stage."""
    total = torch.zeros(2, dtype=torch.float64)
    if reports:  # the last pipeline stage; its DP x CP group holds only last-stage ranks
        total = torch.stack([r["loss"] for r in reports]).sum(0).double()
        dist.all_reduce(total, group=groups.dp_cp)
    if groups.layout.pp > 1:
        last = dist.get_process_group_ranks(groups.pp)[-1]
        dist.broadcast(total, src=last, group=groups.pp)
    return float(total[0] / total[1].clamp(min=1.0))


def sft_train(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    groups: ParallelGroups,
    sequences: Sequence[SFTSequence],
    *,
    optimizer: OptimizerConfig,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    seed: int,
    vocab_size: int,
    pad_id: int,
    init: str | Path | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    family: SFTFamily = TEXT,
) -> tuple[SFTModel, list[dict[str, float]]]:
    """Build a model of ``family`` (from ``seed``, or loaded from ``init``) and fine-tune it
    ``steps`` steps on ``sequences`` (encoded by the family's module).

    ``batch_size`` sequences per step over all data-parallel ranks (a multiple of the DP size
    whose per-rank share is split into micro-batches of ``micro_batch_size``). ``on_step(step,
    metrics)`` is called after each step (progress bars). Returns the model and the per-step
    metrics (see :func:`sft_step`).
    """
    check_batching(groups, steps, batch_size, micro_batch_size)
    m = build_sft_model(
        model_cfg, parallel_cfg, groups, optimizer,
        vocab_size=vocab_size, steps=steps, seed=seed, init=init, family=family,
    )  # fmt: skip
    multiple = sequence_multiple(m.model)
    history = run_sft(
        m, sequences, lambda rows: family.batch(rows, pad_id, multiple),
        steps=steps, batch_size=batch_size, micro_batch_size=micro_batch_size, seed=seed,
        on_step=on_step,
    )  # fmt: skip
    return m, history


def check_batching(
    groups: ParallelGroups, steps: int, batch_size: int, micro_batch_size: int
) -> None:
    """Fail unless the step count and batch sizes fit the data-parallel size."""
    dp = groups.layout.dp
    if steps < 1 or batch_size < 1 or micro_batch_size < 1 or batch_size % dp:
        raise ValueError(
            f"need steps >= 1, micro_batch_size >= 1 and a batch_size divisible by the "
            f"data-parallel size {dp}; got steps={steps}, batch_size={batch_size}, "
            f"micro_batch_size={micro_batch_size}"
        )


def _sampler(n: int, batch_size: int, dp_rank: int, dp_size: int, seed: int) -> PromptSampler:
    return PromptSampler(
        n, prompts_per_step=batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )


def drawn_rows(n: int, *, steps: int, batch_size: int, seed: int) -> list[int]:
    """The rows of ``n`` sequences that :func:`run_sft` reads in ``steps`` steps of
    ``batch_size`` from ``seed`` (every data-parallel rank's), in order of index: the sequences
    a caller must make (e.g. a teacher's answers) when it makes them for a short run only."""
    sampler = _sampler(n, batch_size, 0, 1, seed)
    return sorted({i for _ in range(steps) for i in sampler.next_step()})


def run_sft[S: SFTSequence](
    m: SFTModel,
    sequences: Sequence[S],
    make_batch: Callable[[list[S]], dict[str, torch.Tensor]],
    *,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    seed: int,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of ``m`` on the seeded stream of ``sequences`` (module doc).

    ``make_batch`` pads a micro-batch's sequences into tensors (``m.family.batch``: ``tokens``,
    ``targets``, ``mask``, and whatever the family's model call also reads). Returns the
    per-step metrics.
    """
    sampler = _sampler(len(sequences), batch_size, m.groups.coords["dp"], m.groups.layout.dp, seed)
    history = []
    for step in range(1, steps + 1):
        mine = [sequences[i] for i in sampler.next_step()]
        micro = [
            make_batch(mine[k : k + micro_batch_size])
            for k in range(0, len(mine), micro_batch_size)
        ]
        metrics = sft_step(m, micro)
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history
