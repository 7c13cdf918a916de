"""Forward-only statistics of vocab-parallel distributions: greedy and sampled token ids, and
the full-vocabulary KL divergence between two models.

Companion of :mod:`megatron_gndpo.parallel.logprobs` (same shape legend; the same vocabulary
split, chunking and per-shard helpers, from :mod:`megatron_gndpo.parallel.vocab_shard`): every
function here works ``chunk_tokens`` tokens at a time, so at most a few ``[C, V]`` float32
buffers exist at once (``[C, V/tp]`` per rank), never ``[T, V]``; padding rows (ids ≥
``vocab_size``) are −inf logits: no probability mass, never chosen. Nothing here is
differentiable (these feed stop-gradient quantities: guidance tokens, vOPD's KL advantage term).

The math, per token t, with ``z_t = hidden_t · W_fullᵀ / τ`` (padding at −inf)::

    argmax_t   = argmax_v z_tv                            (τ does not change it)
    sample_t   = argmax_v (z_tv + g_tv),  g_tv ~ Gumbel(0, 1) i.i.d.
                 (the Gumbel-max trick: a draw from softmax(z_t))
    KL_t(p‖q)  = Σ_v p_tv (log p_tv − log q_tv)
               = Σ_v e_tv·(a_tv − b_tv) / S^p_t − log S^p_t + log S^q_t
                 with a = z^p − m^p, b = z^q − m^q, e = exp(a), S^p = Σ_v e, S^q = Σ_v exp(b)

Collectives, per chunk, all over the tensor-parallel group (its ranks hold the same tokens and
different vocabulary slices, so a vocabulary max/sum is a max/sum over that group):

    argmax, sample   one all_gather of each rank's best (value, global id), [2, C, 1] float64
    KL               all_reduce(MAX) of [m^p, m^q] [2, C],
                     all_reduce(SUM) of [S^p, S^q, Σ e·(a − b)] [3, C]
"""

from __future__ import annotations

from typing import Unpack

import torch
import torch.distributed as dist

from megatron_gndpo.parallel.vocab_shard import (
    ChunkOptions,
    ShardMath,
    TemperatureOptions,
    VocabOptions,
    VocabShard,
    check_linear_shapes,
    linear_chunks,
    linear_shard,
    logits_shard,
    token_chunks,
    tp_all_gather,
    tp_all_reduce,
    vocab_shard,
)

# Gumbel noise is drawn in blocks of this many vocabulary ids, the same blocks at every TP size
# (so the same draws land on the same ids and the sample does not depend on TP); a fixed width
# bounds the noise buffer to [C, this] float64 whatever the vocabulary.
_NOISE_BLOCK_IDS = 4096


class _StatsMath:
    """Per-shard arithmetic of one chunk: no collectives."""

    @staticmethod
    def add_gumbel_(logits_CV: torch.Tensor, shard: VocabShard, generator: torch.Generator) -> None:
        """Add Gumbel(0, 1) noise to this shard's real columns, in place.

        Every rank draws the noise of the WHOLE real vocabulary ``[C, vocab_size]``, block by
        block, and keeps the columns it owns: the generator advances identically on every rank
        and at every TP size, so token (t, v) gets the same noise whatever the TP layout. The
        price is ``C × vocab_size`` uniform draws per rank instead of ``C × V/tp`` (cheap next to
        the chunk's ``C × V/tp × H`` matmul). Uniforms are float64 so the noise's tail is not cut
        at float32's ``−log(−log(1 − 2⁻²⁴)) ≈ 16.6``.
        """
        num_rows = logits_CV.shape[0]
        own_lo, own_hi = shard.start, shard.start + shard.real_rows
        for lo in range(0, shard.vocab_size, _NOISE_BLOCK_IDS):
            hi = min(lo + _NOISE_BLOCK_IDS, shard.vocab_size)
            uniform_CB = torch.rand(
                (num_rows, hi - lo),
                generator=generator,
                dtype=torch.float64,
                device=logits_CV.device,
            )
            keep_lo, keep_hi = max(lo, own_lo), min(hi, own_hi)
            if keep_lo < keep_hi:
                # g = −log(−log u); u = 0 gives −inf, which never wins.
                gumbel_CB = uniform_CB[:, keep_lo - lo : keep_hi - lo].log().neg_().log_().neg_()
                logits_CV[:, keep_lo - shard.start : keep_hi - shard.start] += gumbel_CB
            del uniform_CB

    @staticmethod
    def kl_partials(
        logits_p_CV: torch.Tensor,
        logits_q_CV: torch.Tensor,
        max_2C: torch.Tensor,
        shard: VocabShard,
    ) -> torch.Tensor:
        """This shard's ``[S^p, S^q, Σ e·(a − b)]`` partial sums ``[3, C]``; overwrites both
        logits buffers. ``max_2C`` holds the global maxima ``m^p, m^q``."""
        shifted_p_CV = logits_p_CV.sub_(max_2C[0].unsqueeze(-1))  # a
        shifted_q_CV = logits_q_CV.sub_(max_2C[1].unsqueeze(-1))  # b
        # Real columns only: on padding a − b = −inf − (−inf) = NaN, and p = 0 there anyway.
        real = shard.real_rows
        diff_CR = shifted_p_CV[:, :real] - shifted_q_CV[:, :real]
        if shard.excluded:  # −inf in both models, like padding
            diff_CR[:, list(shard.excluded)] = 0.0
        exp_p_CV = shifted_p_CV.exp_()
        weighted_C = diff_CR.mul_(exp_p_CV[:, :real]).sum(dim=-1)
        del diff_CR
        return torch.stack([exp_p_CV.sum(dim=-1), shifted_q_CV.exp_().sum(dim=-1), weighted_C])

    @staticmethod
    def kl(sums_3C: torch.Tensor) -> torch.Tensor:
        """``KL = Σ e·(a − b) / S^p − log S^p + log S^q`` from the summed partials."""
        sum_p_C, sum_q_C, weighted_C = sums_3C
        return weighted_C / sum_p_C - sum_p_C.log() + sum_q_C.log()


def _best_ids_chunk(logits_CV: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Global id ``[C]`` of each row's largest logit over the whole vocabulary."""
    # Each rank's best (value, id), one all-gather, the best of those: top-k with k = 1.
    candidates = ShardMath.topk_candidates(logits_CV, 1, shard)
    _, ids_C1 = ShardMath.global_topk(tp_all_gather(candidates, shard.group), 1)
    return ids_C1.squeeze(-1)


@torch.no_grad()
def vocab_parallel_argmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    **options: Unpack[ChunkOptions],
) -> torch.Tensor:
    """Greedy token ``argmax_{v < vocab_size} hidden_t · W_fullᵀ`` per token: int64 ``[T]``
    global ids, the same on every rank of ``tp_group``.

    E.g. TGPO's teacher guidance token. Arguments as in
    :func:`~megatron_gndpo.parallel.logprobs.vocab_parallel_logprobs` (a temperature would not
    change the argmax). Exact ties between ids are broken arbitrarily.
    :func:`~megatron_gndpo.parallel.logprobs.vocab_parallel_token_stats` with ``top_k=1``
    gives the same id with its log-prob, in a pass that also scores given targets.
    """
    shard = linear_shard(hidden, weight, **options)  # temperature 1: it keeps the argmax
    ids_T = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    for rows, logits_CV in linear_chunks(hidden, weight, shard):
        ids_T[rows] = _best_ids_chunk(logits_CV, shard)
        del logits_CV  # free this chunk before the next one is allocated
    return ids_T


@torch.no_grad()
def vocab_parallel_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    generator: torch.Generator,
    **options: Unpack[VocabOptions],
) -> torch.Tensor:
    """One token per position drawn from ``softmax(hidden · W_fullᵀ / τ)`` over the real
    vocabulary: int64 ``[T]`` global ids, the same on every rank of ``tp_group``.

    Gumbel-max: ``argmax_v (z_tv + g_tv)`` with i.i.d. Gumbel noise from ``generator`` (on
    ``hidden``'s device). Every rank of ``tp_group`` must pass a generator in the same state
    (e.g. seeded alike); each draws the noise of the whole real vocabulary and keeps its own
    columns (see ``_StatsMath.add_gumbel_``), so the draw is deterministic given the generator
    state and the same at every TP size; it does depend on ``chunk_tokens`` and
    ``vocab_size`` (the shape of each draw) and on the device type. The generator advances by
    ``T × vocab_size`` float64 uniforms. Other arguments as in
    :func:`~megatron_gndpo.parallel.logprobs.vocab_parallel_logprobs`.
    """
    check_linear_shapes(hidden, weight, None)
    if generator.device.type != hidden.device.type:
        raise ValueError(
            f"generator is on {generator.device} but hidden is on {hidden.device}; pass a "
            "generator of hidden's device (torch.Generator(device=hidden.device))"
        )
    shard = vocab_shard(weight.shape[0], **options)
    ids_T = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    for rows, logits_CV in linear_chunks(hidden, weight, shard):
        _StatsMath.add_gumbel_(logits_CV, shard, generator)
        ids_T[rows] = _best_ids_chunk(logits_CV, shard)
        del logits_CV  # free this chunk before the next one is allocated
    return ids_T


def _kl_chunk(
    logits_p_CV: torch.Tensor, logits_q_CV: torch.Tensor, shard: VocabShard
) -> torch.Tensor:
    """``KL(p‖q) [C]`` of one chunk from both models' scaled logits; overwrites both."""
    max_2C = torch.stack([logits_p_CV.max(dim=-1).values, logits_q_CV.max(dim=-1).values])
    # Both shifts must be the same on every shard for the partial sums to add up.
    tp_all_reduce(max_2C, dist.ReduceOp.MAX, shard.group)
    sums_3C = _StatsMath.kl_partials(logits_p_CV, logits_q_CV, max_2C, shard)
    tp_all_reduce(sums_3C, dist.ReduceOp.SUM, shard.group)
    return _StatsMath.kl(sums_3C)


@torch.no_grad()
def vocab_parallel_kl(
    hidden_p: torch.Tensor,
    weight_p: torch.Tensor,
    hidden_q: torch.Tensor,
    weight_q: torch.Tensor,
    **options: Unpack[VocabOptions],
) -> torch.Tensor:
    """Full-vocabulary ``KL_t(p‖q) = Σ_{v < vocab_size} p_tv (log p_tv − log q_tv)``: float32
    ``[T]``, forward only.

    ``p = softmax(hidden_p · W_p,fullᵀ / τ)`` and ``q = softmax(hidden_q · W_q,fullᵀ / τ)``,
    two models whose output layers are split over the SAME ``tp_group`` with the same rows per
    rank (their hidden sizes and dtypes may differ: a student ``[T, H_s]`` and a teacher
    ``[T, H_t]``). For vOPD's advantage term ``KL_t(π_θ‖π_T)`` pass the student as ``p``.
    Up to rounding it is ≥ 0 (it may come out a few ulps below 0 where p ≈ q). Memory: two
    chunks' logits (one per model) plus one more ``[C, V]`` buffer at a time. Other arguments
    as in :func:`~megatron_gndpo.parallel.logprobs.vocab_parallel_logprobs`.
    """
    check_linear_shapes(hidden_p, weight_p, None)
    check_linear_shapes(hidden_q, weight_q, None)
    if hidden_p.shape[0] != hidden_q.shape[0] or weight_p.shape[0] != weight_q.shape[0]:
        raise ValueError(
            "p and q must cover the same tokens and the same vocabulary rows per rank, got "
            f"hidden_p {tuple(hidden_p.shape)}, weight_p {tuple(weight_p.shape)}, hidden_q "
            f"{tuple(hidden_q.shape)}, weight_q {tuple(weight_q.shape)}"
        )
    shard = vocab_shard(weight_p.shape[0], **options)
    kl_T = torch.empty(hidden_p.shape[0], dtype=torch.float32, device=hidden_p.device)
    for rows in token_chunks(hidden_p.shape[0], shard.chunk_tokens):
        logits_p_CV = ShardMath.linear_logits(hidden_p[rows], weight_p, shard)
        logits_q_CV = ShardMath.linear_logits(hidden_q[rows], weight_q, shard)
        kl_T[rows] = _kl_chunk(logits_p_CV, logits_q_CV, shard)
        del logits_p_CV, logits_q_CV  # free this chunk before the next one is allocated
    return kl_T


@torch.no_grad()
def vocab_parallel_kl_from_logits(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    **options: Unpack[TemperatureOptions],
) -> torch.Tensor:
    """:func:`vocab_parallel_kl` for vocab-parallel logits that already exist: ``logits_p`` and
    ``logits_q`` of the same shape ``[..., V/tp]`` give float32 ``KL(p‖q) [...]``. Never
    modifies its inputs; works on a bounded number of rows at a time."""
    if logits_p.dim() < 1 or logits_p.shape != logits_q.shape:
        raise ValueError(
            "expected logits_p and logits_q of the same shape [..., V/tp], got "
            f"{tuple(logits_p.shape)} and {tuple(logits_q.shape)}"
        )
    shard = logits_shard(logits_p, **options)
    logits_p_TV = logits_p.reshape(-1, logits_p.shape[-1])
    logits_q_TV = logits_q.reshape(-1, logits_q.shape[-1])
    kl_T = torch.empty(logits_p_TV.shape[0], dtype=torch.float32, device=logits_p.device)
    for rows in token_chunks(logits_p_TV.shape[0], shard.chunk_tokens):
        kl_T[rows] = _kl_chunk(
            ShardMath.scaled_logits(logits_p_TV[rows], shard, owned=False),
            ShardMath.scaled_logits(logits_q_TV[rows], shard, owned=False),
            shard,
        )
    return kl_T.view(logits_p.shape[:-1])
