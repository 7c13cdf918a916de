"""Token log-probs and entropy over a vocab-parallel output layer: chunked, fused, with recompute.

Shape legend (suffixes on tensor names):
    T   tokens in the call (batch × sequence, flattened); the same tokens on every TP rank
    C   tokens in one chunk (at most ``chunk_tokens``)
    H   hidden size
    V   vocabulary rows held by this TP rank (the whole padded vocabulary without TP)
    K   target ids per token (multi-target calls), or top-k candidates
    P   ranks in the tensor-parallel group

The math, per token t with target id y_t and temperature τ (the full vocabulary is the
concatenation of the TP shards in rank order, Megatron's contiguous split
``VocabUtility.vocab_range_from_per_partition_vocab_size``: rank r holds ids [r·V, (r+1)·V))::

    z_t    = hidden_t · W^T / τ,   z_tv = −inf for v ≥ vocab_size (padding: no probability mass)
    lse_t  = m_t + log Σ_v exp(z_tv − m_t),           m_t = max_v z_tv
    logp_t = z_t,y_t − lse_t
    H_t    = −Σ_v p_tv log p_tv = lse_t − Σ_v p_tv z_tv,        p_t = softmax(z_t)
    ∂logp_t/∂z_t = onehot(y_t) − p_t
    ∂H_t/∂z_tv   = −p_tv · (log p_tv + H_t)

With targets ``[T, K]`` (K ids per token: a teacher's top-k, a guidance token) ``logp_tk`` is
the log-prob of ``y_tk`` and an upstream gradient ``g_tk`` gives ``Σ_k g_tk·(onehot(y_tk) − p_t)``.

Per chunk of tokens, each rank does the arithmetic on its own shard and the autograd function
only orders it around the collectives (as Megatron's ``tensor_parallel/cross_entropy.py`` does):

    forward    local max ─ all_reduce(MAX) ─ local [Σ exp(z − m), z_y − m (× K),
               (Σ exp(z − m)·(z − m) for the entropy)] ─ all_reduce(SUM)
    backward   recompute z ─ local grad_z ─ grad_hidden_C = grad_z · W, grad_W += grad_zᵀ · hidden_C
               ─ after the last chunk, ONE all_reduce(SUM) of grad_hidden

Every collective runs over the tensor-parallel group and nothing else: its ranks hold the same
tokens and different slices of the vocabulary, so a vocabulary sum (or max) is a sum (or max)
over that group. Data- and context-parallel ranks hold other tokens and are never involved.
With ``tp_group=None`` there is no collective at all and torch.distributed need not be
initialised.

Memory: only ``[C, V]`` logits exist at a time (a few such buffers inside one chunk), never
``[T, V]``. The forward saves hidden, weight, targets and the float32 ``lse [T]`` (and ``H [T]``
when the entropy is asked for); the backward
recomputes each chunk's logits (one extra matmul per chunk, the usual recompute trade) and keeps a
float32 weight-gradient accumulator of the weight's size.

Forward-only argmax, sampling and the full-vocabulary KL between two models live in the sibling
:mod:`megatron_gndpo.parallel.vocab_stats`; both are built on the per-shard helpers of
:mod:`megatron_gndpo.parallel.vocab_shard` (``VocabShard``, ``ShardMath``, the chunking and
collective wrappers).

Precision: the chunk matmul runs in the inputs' dtype (on GPUs a bf16 GEMM accumulates in
float32 and rounds its output to bf16), then the logits are cast to float32 and everything after
that is float32, the same numerics as Megatron's ``GPTModel`` output layer followed by
``vocab_parallel_cross_entropy``. The weight gradient is summed over chunks in float32 and cast to
the weight's dtype once; the hidden gradient is reduced over TP in the hidden's dtype, as
Megatron's column-parallel output layer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Unpack, cast

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_gndpo.parallel.vocab_shard import (
    ShardMath,
    TemperatureOptions,
    VocabOptions,
    VocabShard,
    linear_chunks,
    linear_shard,
    logits_shard,
    token_chunks,
    tp_all_gather,
    tp_all_reduce,
)


@dataclasses.dataclass
class TokenStats:
    """Per-token diagnostics from :func:`vocab_parallel_token_stats` (all over the full vocab).

    ``logprobs`` float32 log-probs of the targets, shaped like them (``[T]`` or ``[T, K]``);
    ``entropy [T]`` float32 entropy of the (temperature-scaled) distribution;
    ``topk_logprobs [T, k]`` float32, descending, and ``topk_ids [T, k]`` int64 global token ids
    of the k most likely tokens.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None


def _as_TK(tensor: torch.Tensor) -> torch.Tensor:
    """``[T]`` as ``[T, 1]`` (a view); ``[T, K]`` unchanged."""
    return tensor.unsqueeze(-1) if tensor.dim() == 1 else tensor


def _reduce_chunk(
    logits_CV: torch.Tensor, targets_CK: torch.Tensor, shard: VocabShard, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global max ``[C]`` and summed partials ``[1 + K (+1), C]`` of one chunk; overwrites
    logits.

    Every rank of the TP group must call this for every chunk (the chunking depends only on T,
    which all TP ranks share).
    """
    max_C = logits_CV.max(dim=-1).values
    # The shift must be the same on every shard for the partial sums to add up.
    tp_all_reduce(max_C, dist.ReduceOp.MAX, shard.group)
    sums = ShardMath.shifted_exp_sums(logits_CV, max_C, targets_CK, shard, entropy=entropy)
    # One reduction for all partials: a target term is nonzero on the one rank that owns y.
    tp_all_reduce(sums, dist.ReduceOp.SUM, shard.group)
    return max_C, sums


class _LinearLogprobs(torch.autograd.Function):
    """``logp`` (shaped like the targets, ``[T]`` or ``[T, K]``) and, with ``with_entropy``,
    also ``H [T]``, from hidden ``[T, H]`` and this rank's output-layer shard ``[V, H]``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_TH: torch.Tensor,
        weight_VH: torch.Tensor,
        targets: torch.Tensor,
        shard: VocabShard,
        with_entropy: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden_TH.shape[0]
        targets_TK = _as_TK(targets)  # [T] -> [T, 1]: one code path for both
        logp = hidden_TH.new_empty(targets.shape, dtype=torch.float32)
        logp_TK = _as_TK(logp)
        lse_T = hidden_TH.new_empty(num_tokens, dtype=torch.float32)
        entropy_T = torch.empty_like(lse_T) if with_entropy else None
        for rows, logits_CV in linear_chunks(hidden_TH, weight_VH, shard):
            max_C, sums = _reduce_chunk(logits_CV, targets_TK[rows], shard, entropy=with_entropy)
            logp_TK[rows], lse_T[rows] = ShardMath.logprob_and_lse(max_C, sums, targets_TK.shape[1])
            if entropy_T is not None:
                entropy_T[rows] = ShardMath.entropy(sums)
            del logits_CV  # free this chunk before the next one is allocated
        if entropy_T is None:
            ctx.save_for_backward(hidden_TH, weight_VH, targets, lse_T)
            ctx.shard = shard
            return logp
        ctx.save_for_backward(hidden_TH, weight_VH, targets, lse_T, entropy_T)
        ctx.shard = shard
        # An unused output's gradient stays None instead of a zero tensor (see backward).
        ctx.set_materialize_grads(False)
        return logp, entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden_TH, weight_VH, targets, lse_T, *saved_entropy = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        targets_TK = _as_TK(targets)
        grad_TK = None if grads[0] is None else _as_TK(grads[0])
        grad_entropy_T = grads[1] if saved_entropy else None
        entropy_T = saved_entropy[0] if grad_entropy_T is not None else None
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden_TH = (
            torch.empty_like(hidden_TH, memory_format=torch.contiguous_format)
            if want_hidden
            else None
        )
        # Summed over chunks in float32, cast to the weight's dtype once at the end.
        accumulate_dtype = torch.promote_types(weight_VH.dtype, torch.float32)
        grad_weight_VH = (
            torch.zeros_like(weight_VH, dtype=accumulate_dtype) if want_weight else None
        )
        for rows, logits_CV in linear_chunks(hidden_TH, weight_VH, shard):
            entropy = (
                None
                if entropy_T is None or grad_entropy_T is None
                else (entropy_T[rows], grad_entropy_T[rows])
            )
            grad_CV = ShardMath.grad_logits_(
                logits_CV,
                lse_T[rows],
                None if grad_TK is None else grad_TK[rows],
                targets_TK[rows],
                shard,
                entropy,
            ).to(weight_VH.dtype)
            if grad_hidden_TH is not None:
                torch.mm(grad_CV, weight_VH, out=grad_hidden_TH[rows])
            if grad_weight_VH is not None:
                if grad_weight_VH.dtype == grad_CV.dtype:
                    grad_weight_VH.addmm_(grad_CV.t(), hidden_TH[rows])
                else:
                    grad_weight_VH.add_(grad_CV.t() @ hidden_TH[rows])
            del logits_CV, grad_CV  # free this chunk before the next one is allocated
        if grad_hidden_TH is not None:
            # hidden is replicated over TP and each rank's product covers only its vocab rows:
            # the full gradient is the sum over the TP group. The weight gradient needs no
            # collective: each rank owns its rows.
            tp_all_reduce(grad_hidden_TH, dist.ReduceOp.SUM, shard.group)
        return (
            grad_hidden_TH,
            grad_weight_VH.to(weight_VH.dtype) if grad_weight_VH is not None else None,
            None,
            None,
            None,
        )


class _LogitsLogprobs(torch.autograd.Function):
    """``logp`` (shaped like the targets, ``[T]`` or ``[T, K]``) from already computed
    vocab-parallel logits ``[T, V]``; never writes them."""

    @staticmethod
    def forward(
        ctx: Any, logits_TV: torch.Tensor, targets: torch.Tensor, shard: VocabShard
    ) -> torch.Tensor:
        num_tokens = logits_TV.shape[0]
        targets_TK = _as_TK(targets)
        logp = logits_TV.new_empty(targets.shape, dtype=torch.float32)
        logp_TK = _as_TK(logp)
        lse_T = logits_TV.new_empty(num_tokens, dtype=torch.float32)
        for rows in token_chunks(num_tokens, shard.chunk_tokens):
            scaled_CV = ShardMath.scaled_logits(logits_TV[rows], shard, owned=False)
            max_C, sums = _reduce_chunk(scaled_CV, targets_TK[rows], shard)
            logp_TK[rows], lse_T[rows] = ShardMath.logprob_and_lse(max_C, sums, targets_TK.shape[1])
            del scaled_CV  # free this chunk before the next one is allocated
        ctx.save_for_backward(logits_TV, targets, lse_T)
        ctx.shard = shard
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_TV, targets, lse_T = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        num_tokens = logits_TV.shape[0]
        targets_TK, grad_TK = _as_TK(targets), _as_TK(grad)
        grad_logits_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
        for rows in token_chunks(num_tokens, shard.chunk_tokens):
            scaled_CV = ShardMath.scaled_logits(logits_TV[rows], shard, owned=False)
            grad_logits_TV[rows] = ShardMath.grad_logits_(
                scaled_CV, lse_T[rows], grad_TK[rows], targets_TK[rows], shard
            )
            del scaled_CV  # free this chunk before the next one is allocated
        # No collective: each rank's logits are its own shard.
        return grad_logits_TV, None, None


def _checked_targets(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``targets`` as int64 after checking every id is a real token (one host sync)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    targets = targets.long()
    bad = (targets < 0) | (targets >= vocab_size)
    if targets.numel() and bool(bad.any()):
        raise ValueError(
            f"target ids must lie in [0, vocab_size={vocab_size}); got "
            f"{targets[bad].unique()[:8].tolist()}. Ids at or above vocab_size are padding rows "
            "of the output layer, which take no probability mass; mask ignored positions "
            "(e.g. -100 labels) out with a valid id before the call"
        )
    return targets


def _linear_setup(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    options: VocabOptions,
) -> tuple[VocabShard, torch.Tensor]:
    """Checked shard and int64 targets; ``targets=None`` gives ``[T, 0]`` (no target ids)."""
    shard = linear_shard(hidden, weight, targets, **options)
    if targets is None:
        return shard, torch.zeros((hidden.shape[0], 0), dtype=torch.int64, device=hidden.device)
    return shard, _checked_targets(targets, shard.vocab_size)


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    **options: Unpack[VocabOptions],
) -> torch.Tensor:
    """Log-prob of target tokens under ``softmax(hidden · W_fullᵀ / τ)``, float32, shaped like
    ``targets``: ``[T]`` for one id per token, ``[T, K]`` for K ids per token.

    ``logp_tk = z_t,y_tk − log Σ_{v < vocab_size} exp(z_tv)`` with
    ``z_t = hidden_t · W_fullᵀ / τ``: the output layer and the log-softmax fused, computed
    ``chunk_tokens`` tokens at a time so that at most ``[chunk_tokens, V/tp]`` logits exist at
    once, with the chunk logits recomputed in the backward (see the module docstring for the
    collectives and numerics). ``[T, K]`` targets score K arbitrary ids per token in the same
    pass (the teacher's or student's top-k ids, a guidance token next to the sampled one); the
    K target terms ride in the same all-reduce, and ids may repeat.

    Args:
        hidden: ``[T, H]``, any float dtype; the same tokens on every rank of ``tp_group``.
        weight: ``[V/tp, H]``, this TP rank's rows of the output layer (Megatron's contiguous
            split: rank r holds global ids [r·V/tp, (r+1)·V/tp)); same dtype as ``hidden``.
        targets: ``[T]`` or ``[T, K]`` (K ≥ 1) integer global token ids, each in
            ``[0, vocab_size)``.
        options: ``tp_group``, ``vocab_size``, ``chunk_tokens``, ``temperature``,
            ``excluded_ids`` (:class:`~megatron_gndpo.parallel.vocab_shard.VocabOptions`).

    Differentiable w.r.t. ``hidden`` and ``weight`` (gradients in their dtypes; the hidden
    gradient is all-reduced over ``tp_group``, the weight gradient is this rank's shard).
    Every rank of ``tp_group`` must call it with the same ``hidden``, ``targets`` and settings.

    This replaces Megatron's output layer: pass the final norm's output itself, not through
    ``copy_to_tensor_model_parallel_region`` (whose backward would all-reduce the hidden
    gradient a second time). With sequence parallelism, gather the sequence with a gather whose
    backward splits (``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=
    False)``), not one whose backward reduce-scatters.
    """
    shard, targets = _linear_setup(hidden, weight, targets, options)
    return cast(torch.Tensor, _LinearLogprobs.apply(hidden, weight, targets, shard, False))


def vocab_parallel_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    **options: Unpack[VocabOptions],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs and the entropy from ONE fused pass: ``(logp, entropy)``, both float32
    and both differentiable (a policy loss with an entropy bonus needs both from one forward).

    ``logp`` is :func:`vocab_parallel_logprobs` (shaped like ``targets``, ``[T]`` or
    ``[T, K]``); ``entropy [T]`` is ``H_t = −Σ_{v < vocab_size} p_tv log p_tv`` of the
    temperature-scaled distribution ``p_t = softmax(z_t)``, one more partial sum in the same
    all-reduce. Backward: ``∂H_t/∂z_tv = −p_tv·(log p_tv + H_t)`` (then ``/τ`` to the raw
    logits), added to the log-prob gradient in the same recomputed chunk; a second ``[C, V]``
    buffer holds ``p`` meanwhile. Either output may go unused. Arguments as in
    :func:`vocab_parallel_logprobs`.
    """
    shard, targets = _linear_setup(hidden, weight, targets, options)
    logp, entropy_T = _LinearLogprobs.apply(hidden, weight, targets, shard, True)
    return logp, entropy_T


def vocab_parallel_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    **options: Unpack[VocabOptions],
) -> torch.Tensor:
    """Entropy ``H_t = −Σ_{v < vocab_size} p_tv log p_tv`` of ``softmax(hidden · W_fullᵀ / τ)``,
    float32 ``[T]``, differentiable w.r.t. ``hidden`` and ``weight``.

    :func:`vocab_parallel_logprobs_and_entropy` without targets; prefer that one when the
    target log-probs are needed too (one pass instead of two). Arguments as in
    :func:`vocab_parallel_logprobs`.
    """
    shard, no_targets_T0 = _linear_setup(hidden, weight, None, options)
    _, entropy_T = _LinearLogprobs.apply(hidden, weight, no_targets_T0, shard, True)
    return cast(torch.Tensor, entropy_T)


def vocab_parallel_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    **options: Unpack[TemperatureOptions],
) -> torch.Tensor:
    """Log-prob of targets from vocab-parallel logits ``[..., V/tp]``: float32 ``[...]`` for
    targets ``[...]``, or ``[..., K]`` for targets ``[..., K]`` (K ids per position).

    ``logp = z_y − log Σ_{v < vocab_size} exp(z_v)`` with ``z = logits / τ``, the same math and
    collectives as :func:`vocab_parallel_logprobs` for logits that already exist (e.g. a model
    that returns them). Unlike Megatron's ``vocab_parallel_cross_entropy`` it never modifies
    ``logits`` in place; its float32 working copies cover a bounded number of rows at a time.
    Differentiable w.r.t. ``logits`` (no collective in the backward).
    """
    lead = logits.shape[:-1]
    multi = targets.dim() == logits.dim() >= 2 and targets.shape[:-1] == lead
    if logits.dim() < 1 or not (multi or targets.shape == lead):
        raise ValueError(
            "expected logits [..., V/tp] and targets [...] (or [..., K]) with the same leading "
            f"dims, got logits {tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    if multi and targets.shape[-1] == 0:
        raise ValueError("targets [..., K] needs K >= 1 ids per position, got K = 0")
    shard = logits_shard(logits, **options)
    targets = _checked_targets(targets, shard.vocab_size)
    logits_TV = logits.reshape(-1, logits.shape[-1])
    targets_T = targets.reshape(logits_TV.shape[0], -1) if multi else targets.reshape(-1)
    logp = cast(torch.Tensor, _LogitsLogprobs.apply(logits_TV, targets_T, shard))
    return logp.view(targets.shape)


@torch.no_grad()
def vocab_parallel_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    entropy: bool = False,
    top_k: int = 0,
    **options: Unpack[VocabOptions],
) -> TokenStats:
    """Target log-probs plus optional entropy and top-k, forward only (no gradient).

    Arguments as in :func:`vocab_parallel_logprobs` (``targets`` ``[T]`` or ``[T, K]``; the
    log-probs are shaped like them). Over the full (unpadded) vocabulary:

    - ``entropy``: ``H_t = lse_t − Σ_v p_tv · z_tv`` of the temperature-scaled distribution,
      from one more partial sum in the same all-reduce;
    - ``top_k``: each rank takes its best ``min(k, V/tp)`` logits (padding is −inf and never
      wins), one all-gather over ``tp_group`` brings every rank the ``P·k`` candidates, and the
      best ``k`` of those are the global top-k: log-probs descending, global token ids.
      Requires ``0 <= top_k <= vocab_size``. ``top_k=1`` is the greedy (argmax) token and its
      log-prob, e.g. TGPO's teacher guidance token from the teacher's scoring pass.

    Used for vOPD diagnostics and logging (e.g. teacher entropy, student top-k overlap).
    """
    shard, targets = _linear_setup(hidden, weight, targets, options)
    if not 0 <= top_k <= shard.allowed:
        raise ValueError(
            f"top_k must lie in [0, {shard.allowed}] (vocab_size={shard.vocab_size} less "
            f"{shard.vocab_size - shard.allowed} excluded ids), got {top_k}"
        )
    num_tokens = hidden.shape[0]
    out = TokenStats(logprobs=hidden.new_empty(targets.shape, dtype=torch.float32))
    logp_TK, targets_TK = _as_TK(out.logprobs), _as_TK(targets)
    if entropy:
        out.entropy = hidden.new_empty(num_tokens, dtype=torch.float32)
    if top_k:
        out.topk_logprobs = hidden.new_empty((num_tokens, top_k), dtype=torch.float32)
        out.topk_ids = hidden.new_empty((num_tokens, top_k), dtype=torch.int64)
    for rows, logits_CV in linear_chunks(hidden, weight, shard):
        # Before _reduce_chunk, which overwrites the logits.
        candidates = ShardMath.topk_candidates(logits_CV, top_k, shard) if top_k else None
        max_C, sums = _reduce_chunk(logits_CV, targets_TK[rows], shard, entropy=entropy)
        logp_TK[rows], lse_C = ShardMath.logprob_and_lse(max_C, sums, targets_TK.shape[1])
        if out.entropy is not None:
            out.entropy[rows] = ShardMath.entropy(sums)
        if candidates is not None and out.topk_logprobs is not None and out.topk_ids is not None:
            # The top-k of the union of every rank's top-k is the global top-k.
            top_logits_CK, out.topk_ids[rows] = ShardMath.global_topk(
                tp_all_gather(candidates, shard.group), top_k
            )
            out.topk_logprobs[rows] = top_logits_CK - lse_C.unsqueeze(-1)
        del logits_CV  # free this chunk before the next one is allocated
    return out
