"""This rank's slice of the vocabulary and the per-shard arithmetic of one chunk of tokens.

Shared by :mod:`megatron_gndpo.parallel.logprobs` (log-probs, entropy and top-k, with autograd)
and :mod:`megatron_gndpo.parallel.vocab_stats` (argmax, samples, the full-vocabulary KL): the
vocabulary split, the per-call checks, the chunking, and :class:`ShardMath`, the local arithmetic
that those modules order around their collectives. The only collectives here are the two thin
wrappers over the tensor-parallel group (no-ops without one). Shape legend as in
:mod:`megatron_gndpo.parallel.logprobs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any, TypedDict, Unpack

import torch
import torch.distributed as dist

# The *_from_logits functions receive logits that already exist; their float32 working copies
# are bounded by this many rows at a time (the same default as the fused path).
FROM_LOGITS_CHUNK_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary and the per-call constants; fixed for one call."""

    group: dist.ProcessGroup | None  # None: this rank holds the whole vocabulary, no collectives
    start: int  # global id of this shard's first row
    rows: int  # V: rows of this shard, padding included
    real_rows: int  # rows of this shard below vocab_size; the rest are padding
    vocab_size: int  # real (unpadded) size of the full vocabulary
    temperature: float
    chunk_tokens: int
    allowed: int  # ids of the full vocabulary that may take probability mass
    # columns of this shard (local indices, below real_rows) that take no probability mass:
    # ids the policy never samples (a VLM's image placeholder)
    excluded: tuple[int, ...] = ()


class ShardMath:
    """Per-shard arithmetic of one chunk: no collectives, no autograd."""

    @staticmethod
    def scaled_logits(raw_CV: torch.Tensor, shard: VocabShard, *, owned: bool) -> torch.Tensor:
        """float32 ``raw / τ`` with padding columns at −inf, ``[C, V]``.

        ``owned``: ``raw_CV`` is a fresh buffer that may be overwritten (a matmul output). A
        borrowed float32 input is copied first, since ``.float()`` would return it unchanged.
        """
        logits_CV = raw_CV.float() if owned else raw_CV.to(torch.float32, copy=True)
        if shard.temperature != 1.0:
            logits_CV.div_(shard.temperature)
        if shard.real_rows < shard.rows:
            logits_CV[:, shard.real_rows :] = -math.inf
        if shard.excluded:
            logits_CV[:, list(shard.excluded)] = -math.inf
        return logits_CV

    @staticmethod
    def linear_logits(
        hidden_CH: torch.Tensor, weight_VH: torch.Tensor, shard: VocabShard
    ) -> torch.Tensor:
        """This shard's logits of one chunk, ``hidden_CH · weight_VHᵀ / τ``: float32 ``[C, V]``."""
        return ShardMath.scaled_logits(hidden_CH @ weight_VH.t(), shard, owned=True)

    @staticmethod
    def local_targets(
        targets_C: torch.Tensor, shard: VocabShard
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets as column indices into this shard (0 where not owned) and the ownership mask."""
        local_C = targets_C - shard.start
        owned_C = (local_C >= 0) & (local_C < shard.rows)
        return local_C.masked_fill(~owned_C, 0), owned_C

    @staticmethod
    def shifted_exp_sums(
        logits_CV: torch.Tensor,
        max_C: torch.Tensor,
        targets_CK: torch.Tensor,
        shard: VocabShard,
        *,
        entropy: bool = False,
    ) -> torch.Tensor:
        """This shard's partial sums ``[1 + K, C]`` (``[2 + K, C]`` with ``entropy``), to sum
        over TP.

        Rows: ``Σ_v exp(z − m)``; for each of the K targets ``z_y − m`` where this shard holds
        ``y``, else 0; with ``entropy`` last ``Σ_v exp(z − m)·(z − m)``. ``m`` is the global max.
        Overwrites ``logits_CV`` (it ends holding ``exp(z − m)``).
        """
        shifted_CV = logits_CV.sub_(max_C.unsqueeze(-1))
        local_CK, owned_CK = ShardMath.local_targets(targets_CK, shard)
        target_CK = shifted_CV.gather(-1, local_CK).masked_fill_(~owned_CK, 0.0)
        exp_CV = shifted_CV.exp_()
        partials = [exp_CV.sum(dim=-1).unsqueeze(0), target_CK.t()]
        if entropy:
            # e·log e = e·(z − m), and 0 where e = 0 (padding: z = −inf) instead of 0·(−inf) = NaN.
            partials.append(torch.special.xlogy(exp_CV, exp_CV).sum(dim=-1).unsqueeze(0))
        return torch.cat(partials)

    @staticmethod
    def logprob_and_lse(
        max_C: torch.Tensor, sums: torch.Tensor, num_targets: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logp [C, K] = (z_y − m) − log S`` and ``lse [C] = m + log S`` from the global max
        and the summed partials."""
        log_sum_C = sums[0].log()
        logp_CK = sums[1 : 1 + num_targets].t() - log_sum_C.unsqueeze(-1)
        return logp_CK, max_C + log_sum_C

    @staticmethod
    def entropy(sums: torch.Tensor) -> torch.Tensor:
        """``H = lse − Σ p·z = log S − Σ exp(z − m)·(z − m) / S`` from the summed partials."""
        return sums[0].log() - sums[-1] / sums[0]

    @staticmethod
    def grad_logits_(
        logits_CV: torch.Tensor,
        lse_C: torch.Tensor,
        grad_CK: torch.Tensor | None,
        targets_CK: torch.Tensor,
        shard: VocabShard,
        entropy: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``∂L/∂(hidden·Wᵀ)``, written over ``logits_CV`` (a second ``[C, V]`` buffer with
        ``entropy``).

        ``[Σ_k g_k·(onehot(y_k) − p) − g_H·p·(log p + H)] / τ`` for the upstream gradients
        ``grad_CK`` of the K target log-probs (``None``: zero) and, with ``entropy = (H_C,
        g_H_C)``, of the entropy.
        """
        if grad_CK is None:
            scale_CK = torch.zeros_like(targets_CK, dtype=torch.float32)
        else:
            scale_CK = grad_CK.float() / shard.temperature
        scale_C = scale_CK.sum(dim=-1) if scale_CK.shape[-1] != 1 else scale_CK.squeeze(-1)
        logp_CV = logits_CV.sub_(lse_C.unsqueeze(-1))  # log p; padding: −inf
        if entropy is None:
            grad_CV = logp_CV.exp_().mul_(-scale_C.unsqueeze(-1))  # padding: exp(−inf) = 0
        else:
            entropy_C, grad_entropy_C = entropy
            p_CV = logp_CV.exp()
            # p · [−(g_H/τ)·(log p + H) − Σ_k g_k/τ]
            grad_CV = logp_CV.add_(entropy_C.unsqueeze(-1))
            grad_CV.mul_((-grad_entropy_C.float() / shard.temperature).unsqueeze(-1))
            grad_CV.sub_(scale_C.unsqueeze(-1)).mul_(p_CV)
            del p_CV
            # Padding columns: p = 0 times log p = −inf is NaN; their true gradient is 0.
            grad_CV[:, shard.real_rows :] = 0.0
            if shard.excluded:
                grad_CV[:, list(shard.excluded)] = 0.0
        local_CK, owned_CK = ShardMath.local_targets(targets_CK, shard)
        grad_CV.scatter_add_(-1, local_CK, scale_CK * owned_CK)
        return grad_CV

    @staticmethod
    def topk_candidates(logits_CV: torch.Tensor, k: int, shard: VocabShard) -> torch.Tensor:
        """This shard's best ``min(k, V)`` logits and their global ids, packed ``[2, C, K]``.

        float64 holds both the float32 values and the ids exactly, so one all-gather moves both.
        Padding columns are −inf and lose to every real entry.
        """
        values_CK, index_CK = logits_CV.topk(min(k, shard.rows), dim=-1)
        return torch.stack([values_CK.double(), (index_CK + shard.start).double()])

    @staticmethod
    def global_topk(candidates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``k`` of every rank's candidates ``[P, 2, C, K]``: float32 logits, int64 ids."""
        values_CPK, ids_CPK = candidates.permute(1, 2, 0, 3).flatten(2).unbind(0)
        best_CK, position_CK = values_CPK.topk(k, dim=-1)
        return best_CK.float(), ids_CPK.gather(-1, position_CK).long()


def tp_all_reduce(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def tp_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every TP rank's ``tensor`` stacked in rank order, ``[P, ...]``."""
    if group is None:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def token_chunks(num_tokens: int, chunk_tokens: int) -> Iterator[slice]:
    for start in range(0, num_tokens, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, num_tokens))


class SplitOptions(TypedDict, total=False):
    """Where the vocabulary lies: the keyword options every vocab-parallel op takes.

    ``tp_group``: the tensor-parallel group the vocabulary is split over (Megatron's contiguous
    split: rank r holds global ids [r·V, (r+1)·V)); ``None`` (the default): this rank holds the
    whole output layer and no collective runs. ``vocab_size``: the real vocabulary size; rows at
    or above it (TP padding, embedding rows beyond the tokenizer) take no probability mass;
    ``None``: every row is real. ``excluded_ids``: real ids that take no probability mass either
    (logit −inf), the ids the sampler never draws (a VLM's image placeholder); a target among
    them gets −inf.
    """

    tp_group: dist.ProcessGroup | None
    vocab_size: int | None
    excluded_ids: Sequence[int]


class ChunkOptions(SplitOptions, total=False):
    """:class:`SplitOptions` and ``chunk_tokens``: tokens per chunk (default 2048), bounding the
    logits memory to ``chunk_tokens × V/tp`` (ops that compute the logits)."""

    chunk_tokens: int


class TemperatureOptions(SplitOptions, total=False):
    """:class:`SplitOptions` and ``temperature``: τ > 0 dividing the logits (default 1; the
    sampler's temperature)."""

    temperature: float


class VocabOptions(ChunkOptions, TemperatureOptions, total=False):
    """Every option: :class:`SplitOptions`, ``chunk_tokens`` and ``temperature``."""


def vocab_shard(
    rows: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_tokens: int = 2048,
    temperature: float = 1.0,
    excluded_ids: Sequence[int] = (),
) -> VocabShard:
    """Validate the per-call options (:class:`VocabOptions`) and locate this rank's ``rows`` in
    the full vocabulary: the one set-up of every vocab-parallel op."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if rows < 1:
        raise ValueError("the weight shard has no vocabulary rows")
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    total_rows = rows * tp_size
    if vocab_size is None:
        vocab_size = total_rows
    if not 1 <= vocab_size <= total_rows:
        raise ValueError(
            f"vocab_size={vocab_size} must lie in [1, {total_rows}], the rows of the full output "
            f"layer ({rows} per rank × TP size {tp_size})"
        )
    bad = sorted({int(i) for i in excluded_ids if not 0 <= int(i) < vocab_size})
    if bad or len(set(excluded_ids)) >= vocab_size:
        raise ValueError(
            f"excluded_ids must be ids in [0, vocab_size={vocab_size}) that leave at least one "
            f"id, got {sorted(set(excluded_ids))}"
        )
    start = tp_rank * rows
    real_rows = min(max(vocab_size - start, 0), rows)
    return VocabShard(
        group=tp_group if tp_size > 1 else None,  # a group of one needs no collective
        start=start,
        rows=rows,
        real_rows=real_rows,
        vocab_size=vocab_size,
        temperature=float(temperature),
        chunk_tokens=chunk_tokens,
        allowed=vocab_size - len(set(excluded_ids)),
        excluded=tuple(sorted({int(i) - start for i in excluded_ids
                               if start <= int(i) < start + real_rows})),
    )  # fmt: skip


def linear_shard(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    **options: Unpack[VocabOptions],
) -> VocabShard:
    """:func:`vocab_shard` of an op on hidden states and this rank's output-layer rows, after
    :func:`check_linear_shapes`."""
    check_linear_shapes(hidden, weight, targets)
    return vocab_shard(weight.shape[0], **options)


def logits_shard(logits: torch.Tensor, **options: Unpack[TemperatureOptions]) -> VocabShard:
    """:func:`vocab_shard` of an op on logits that already exist ``[..., V/tp]``: their float32
    working copies cover :data:`FROM_LOGITS_CHUNK_TOKENS` rows at a time."""
    return vocab_shard(logits.shape[-1], chunk_tokens=FROM_LOGITS_CHUNK_TOKENS, **options)


def linear_chunks(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, shard: VocabShard
) -> Iterator[tuple[slice, torch.Tensor]]:
    """Each chunk's rows and this shard's float32 logits ``[C, V]`` (:meth:`ShardMath.
    linear_logits`), one chunk alive at a time: a caller that drops its reference before the
    next chunk (``del``) never holds two."""
    for rows in token_chunks(hidden_TH.shape[0], shard.chunk_tokens):
        logits_CV = ShardMath.linear_logits(hidden_TH[rows], weight_VH, shard)
        yield rows, logits_CV
        del logits_CV  # before the next chunk's logits are allocated


def check_linear_shapes(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None
) -> None:
    """hidden ``[T, H]``, weight ``[V/tp, H]`` and (unless ``None``) targets ``[T]``/``[T, K]``."""
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or (
            targets is not None
            and (targets.dim() not in (1, 2) or targets.shape[:1] != hidden.shape[:1])
        )
    ):
        raise ValueError(
            "expected hidden [T, H], weight [V/tp, H] and targets [T] or [T, K] (flatten batch "
            f"and sequence first), got hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}"
            + ("" if targets is None else f", targets {tuple(targets.shape)}")
        )
    if targets is not None and targets.dim() == 2 and targets.shape[1] == 0:
        raise ValueError("targets [T, K] needs K >= 1 ids per token, got K = 0")
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}"
        )
