"""Vocab-parallel log-probs equal a float64 full-vocabulary reference, values and gradients.

Shapes: hidden [T, H], weight [V, H] (V rows, padding included; [V/tp, H] per TP rank),
targets [T]. The reference is ``log_softmax(hidden · Wᵀ / τ)`` in float64 with the padding
columns at −inf. One 4-rank gloo launch covers TP = 1, 2 and 4.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_gndpo.parallel.logprobs import (
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_from_logits,
    vocab_parallel_token_stats,
)
from tests.harness import run_distributed
from tests.logprob_refs import (
    MemoryRecorder,
    make_case,
    reference_entropy,
    reference_grads,
    reference_logprobs,
    reference_topk,
)

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# (tokens, hidden, rows, vocab_size, chunk_tokens, temperature)
CASES = [
    pytest.param(37, 16, 50, 45, 8, 0.7, id="padding-chunks-not-dividing"),
    pytest.param(64, 8, 33, 33, 64, 1.0, id="one-chunk-no-padding"),
    pytest.param(100, 12, 129, 100, 2048, 2.0, id="chunk-larger-than-T"),
    pytest.param(1, 4, 7, 5, 3, 1.3, id="one-token"),
    pytest.param(0, 4, 7, 7, 2, 1.0, id="no-tokens"),
]


@pytest.mark.parametrize(("tokens", "hidden", "rows", "vocab_size", "chunk", "temp"), CASES)
def test_values_and_gradients_match_float64_reference(
    tokens, hidden, rows, vocab_size, chunk, temp
):
    hidden_TH, weight_VH, targets_T = make_case(tokens, hidden, rows, vocab_size)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    logp_T = vocab_parallel_logprobs(
        hidden_TH, weight_VH, targets_T, vocab_size=vocab_size, chunk_tokens=chunk, temperature=temp
    )
    assert logp_T.dtype == torch.float32 and logp_T.shape == (tokens,)
    ref_T = reference_logprobs(hidden_TH.detach(), weight_VH.detach(), targets_T, vocab_size, temp)
    torch.testing.assert_close(logp_T.double(), ref_T, **FP32_TOL)

    grad_T = torch.randn(tokens, generator=torch.Generator().manual_seed(1))
    (logp_T * grad_T).sum().backward()
    ref_hidden, ref_weight = reference_grads(
        hidden_TH, weight_VH, targets_T, grad_T, vocab_size, temp
    )
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    torch.testing.assert_close(hidden_TH.grad.double(), ref_hidden, **FP32_TOL)
    torch.testing.assert_close(weight_VH.grad.double(), ref_weight, **FP32_TOL)
    # padding rows get no gradient: they take no probability mass
    assert not weight_VH.grad[vocab_size:].any()


def test_gradient_only_where_required():
    hidden_TH, weight_VH, targets_T = make_case(20, 8, 30, 30)
    hidden_TH.requires_grad_()
    vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, chunk_tokens=7).sum().backward()
    assert hidden_TH.grad is not None and weight_VH.grad is None

    hidden_TH, weight_VH, targets_T = make_case(20, 8, 30, 30)
    weight_VH.requires_grad_()
    vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, chunk_tokens=7).sum().backward()
    assert weight_VH.grad is not None and hidden_TH.grad is None

    with torch.no_grad():
        out = vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T)
    assert out.grad_fn is None


def test_bfloat16_inputs_within_bfloat16_tolerance():
    tokens, rows, vocab_size, temp = 48, 40, 37, 0.9
    hidden_TH, weight_VH, targets_T = make_case(tokens, 32, rows, vocab_size)
    hidden_TH = hidden_TH.bfloat16().requires_grad_()
    weight_VH = weight_VH.bfloat16().requires_grad_()
    logp_T = vocab_parallel_logprobs(
        hidden_TH, weight_VH, targets_T, vocab_size=vocab_size, chunk_tokens=10, temperature=temp
    )
    assert logp_T.dtype == torch.float32
    # Reference on the same (bf16-rounded) inputs; what remains is the bf16 rounding of the
    # logits (relative 2^-8 of logits of order 1-3) and of the gradients.
    ref_T = reference_logprobs(hidden_TH.detach(), weight_VH.detach(), targets_T, vocab_size, temp)
    torch.testing.assert_close(logp_T.double(), ref_T, rtol=0, atol=5e-2)

    grad_T = torch.ones(tokens)
    logp_T.sum().backward()
    ref_hidden, ref_weight = reference_grads(
        hidden_TH, weight_VH, targets_T, grad_T, vocab_size, temp
    )
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    assert hidden_TH.grad.dtype == weight_VH.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden_TH.grad.double(), ref_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weight_VH.grad.double(), ref_weight, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_logits_matches_reference_and_leaves_input_unchanged(dtype):
    vocab_size, temp = 45, 0.8
    hidden_TH, weight_VH, targets_T = make_case(30, 16, 50, vocab_size)
    logits_BSV = (hidden_TH @ weight_VH.t()).to(dtype).view(5, 6, 50).requires_grad_()
    before = logits_BSV.detach().clone()
    targets_BS = targets_T.view(5, 6)
    logp_BS = vocab_parallel_logprobs_from_logits(
        logits_BSV, targets_BS, vocab_size=vocab_size, temperature=temp
    )
    assert logp_BS.shape == (5, 6) and logp_BS.dtype == torch.float32
    assert torch.equal(logits_BSV.detach(), before)

    logits64_BSV = logits_BSV.detach().double().requires_grad_()
    padding_V = torch.arange(50) >= vocab_size
    ref_BSV = torch.log_softmax(logits64_BSV.masked_fill(padding_V, -math.inf) / temp, dim=-1)
    ref_BS = ref_BSV.gather(-1, targets_BS.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp_BS.double(), ref_BS.detach(), **FP32_TOL)

    grad_BS = torch.randn(5, 6)
    (logp_BS * grad_BS).sum().backward()
    (ref_BS * grad_BS.double()).sum().backward()
    assert logits_BSV.grad is not None and logits_BSV.grad.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(logits_BSV.grad.double(), logits64_BSV.grad, **tol)
    assert torch.equal(logits_BSV.detach(), before)


def test_token_stats_match_reference():
    tokens, rows, vocab_size, temp, k = 41, 60, 52, 1.4, 6
    hidden_TH, weight_VH, targets_T = make_case(tokens, 16, rows, vocab_size)
    # Padding rows that would win every top-k if they were not masked.
    weight_VH[vocab_size:] = 10.0 * hidden_TH[:1]
    stats = vocab_parallel_token_stats(
        hidden_TH,
        weight_VH,
        targets_T,
        vocab_size=vocab_size,
        chunk_tokens=9,
        temperature=temp,
        entropy=True,
        top_k=k,
    )
    ref_logp = reference_logprobs(hidden_TH, weight_VH, targets_T, vocab_size, temp)
    ref_top, ref_ids = reference_topk(hidden_TH, weight_VH, vocab_size, temp, k)
    assert stats.entropy is not None and stats.topk_logprobs is not None
    assert stats.topk_ids is not None and stats.topk_ids.dtype == torch.int64
    torch.testing.assert_close(stats.logprobs.double(), ref_logp, **FP32_TOL)
    torch.testing.assert_close(
        stats.entropy.double(),
        reference_entropy(hidden_TH, weight_VH, vocab_size, temp),
        **FP32_TOL,
    )
    torch.testing.assert_close(stats.topk_logprobs.double(), ref_top, **FP32_TOL)
    assert torch.equal(stats.topk_ids, ref_ids)
    assert (stats.topk_ids < vocab_size).all()


def test_token_stats_defaults_and_edges():
    hidden_TH, weight_VH, targets_T = make_case(5, 4, 9, 7)
    stats = vocab_parallel_token_stats(hidden_TH.requires_grad_(), weight_VH, targets_T)
    assert stats.entropy is None and stats.topk_ids is None and stats.topk_logprobs is None
    assert stats.logprobs.grad_fn is None
    # top-k of the whole vocabulary lists every real token once
    stats = vocab_parallel_token_stats(hidden_TH, weight_VH, targets_T, vocab_size=7, top_k=7)
    assert stats.topk_ids is not None and stats.topk_logprobs is not None
    assert torch.equal(stats.topk_ids.sort(-1).values, torch.arange(7).expand(5, 7))
    torch.testing.assert_close(stats.topk_logprobs.exp().sum(-1), torch.ones(5))
    empty = vocab_parallel_token_stats(
        hidden_TH[:0], weight_VH, targets_T[:0], entropy=True, top_k=3
    )
    assert empty.topk_ids is not None and empty.topk_ids.shape == (0, 3)


def test_errors_name_the_problem():
    hidden_TH, weight_VH, targets_T = make_case(6, 4, 10, 8)
    padding_target_T = targets_T.clone()
    padding_target_T[3] = 8
    with pytest.raises(ValueError, match=r"vocab_size=8\); got \[8\]"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, padding_target_T, vocab_size=8)
    with pytest.raises(ValueError, match=r"\[0, vocab_size=10\)"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T - 100)
    with pytest.raises(ValueError, match=r"vocab_size=11"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, vocab_size=11)
    with pytest.raises(ValueError, match=r"hidden \(6, 5\), weight \(10, 4\)"):
        vocab_parallel_logprobs(torch.randn(6, 5), weight_VH, targets_T)
    with pytest.raises(ValueError, match=r"targets \(5,\)"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T[:5])
    with pytest.raises(ValueError, match=r"hidden \(2, 3, 4\)"):
        vocab_parallel_logprobs(hidden_TH.view(2, 3, 4), weight_VH, targets_T.view(2, 3))
    with pytest.raises(ValueError, match="share a dtype"):
        vocab_parallel_logprobs(hidden_TH.double(), weight_VH, targets_T)
    with pytest.raises(ValueError, match="integer token ids"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T.float())
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature"):
            vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, temperature=bad)
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"logits \(6, 10\) and targets \(5,\)"):
        vocab_parallel_logprobs_from_logits(hidden_TH @ weight_VH.t(), targets_T[:5])
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_from_logits(hidden_TH @ weight_VH.t(), targets_T, temperature=0)
    with pytest.raises(ValueError, match=r"top_k must lie in \[0, 8\] \(vocab_size=8"):
        vocab_parallel_token_stats(hidden_TH, weight_VH, targets_T % 8, vocab_size=8, top_k=9)


def test_memory_is_bounded_by_the_chunk_not_by_tokens_times_vocab():
    tokens, hidden, vocab, chunk = 2048, 8, 2000, 128
    hidden_TH, weight_VH, targets_T = make_case(tokens, hidden, vocab, vocab)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    chunk_bytes = 4 * chunk * vocab  # one float32 [C, V] buffer
    # Everything else the call creates (log-probs, lse, both gradients) is below a fifth of it.
    assert 4 * (2 * tokens + tokens * hidden + vocab * hidden) < chunk_bytes // 5

    with MemoryRecorder(hidden_TH, weight_VH, targets_T) as fused:
        logp_T = vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, chunk_tokens=chunk)
        logp_T.sum().backward()
    # the backward ran under the recorder: one matmul per chunk forward, three backward
    assert fused.ops["mm"] + fused.ops["addmm_"] >= 4 * (tokens // chunk)
    assert fused.largest_numel <= chunk * vocab
    # One chunk's logits live at a time (two would be 2 · chunk_bytes), never [T, V].
    assert fused.peak_bytes < 1.25 * chunk_bytes
    assert 16 * chunk_bytes <= 4 * tokens * vocab

    # the recorder does see [T, V] tensors when there are some
    with MemoryRecorder(hidden_TH, weight_VH, targets_T) as naive:
        logits_TV = hidden_TH @ weight_VH.t()
        torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None]).sum().backward()
    assert naive.largest_numel >= tokens * vocab
    assert naive.peak_bytes >= 4 * tokens * vocab


# ---------------------------------------------------------------------------------------------
# Tensor parallel: one 4-rank launch, TP = 1, 2 and 4.

TP_TOKENS, TP_HIDDEN, TP_VOCAB, TP_CHUNK, TP_TEMP, TP_TOP_K = 23, 8, 37, 5, 0.9, 20


def padded_rows(tp: int) -> int:
    """Megatron-style padding to a multiple of 16·tp: 48, 64, 64 rows for TP 1, 2, 4 (with
    TP=4 the last rank holds padding only, and 37 is a multiple of no TP size)."""
    multiple = 16 * tp
    return -(-TP_VOCAB // multiple) * multiple


def tp_case(tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden_TH, weight_VH, targets_T = make_case(
        TP_TOKENS, TP_HIDDEN, padded_rows(tp), TP_VOCAB, seed=tp
    )
    weight_VH[TP_VOCAB:] = 10.0 * hidden_TH[:1]  # padding that would win if it were not masked
    return hidden_TH, weight_VH, targets_T


def _tp_body(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    # Group creation is collective: every rank creates every group, in the same order.
    groups: dict[int, dist.ProcessGroup | None] = {1: None}
    for size in (2, 4):
        groups[size], _ = dist.new_subgroups(group_size=size)
    results = {}
    for tp, group in groups.items():
        tp_rank = 0 if group is None else dist.get_rank(group)
        hidden_TH, weight_VH, targets_T = tp_case(tp)
        shard_rows = padded_rows(tp) // tp
        weight_shard = weight_VH[tp_rank * shard_rows : (tp_rank + 1) * shard_rows].clone()
        hidden_TH.requires_grad_()
        weight_shard.requires_grad_()
        kwargs = {
            "tp_group": group,
            "vocab_size": TP_VOCAB,
            "chunk_tokens": TP_CHUNK,
            "temperature": TP_TEMP,
        }
        logp_T = vocab_parallel_logprobs(hidden_TH, weight_shard, targets_T, **kwargs)
        (logp_T * torch.arange(TP_TOKENS)).sum().backward()
        logits_TV = (hidden_TH @ weight_shard.t()).detach()
        stats = vocab_parallel_token_stats(
            hidden_TH, weight_shard, targets_T, entropy=True, top_k=TP_TOP_K, **kwargs
        )
        kwargs.pop("chunk_tokens")
        results[tp] = {
            "tp_rank": tp_rank,
            "logp": logp_T.detach(),
            "grad_hidden": hidden_TH.grad,
            "grad_weight": weight_shard.grad,
            "from_logits": vocab_parallel_logprobs_from_logits(logits_TV, targets_T, **kwargs),
            "entropy": stats.entropy,
            "topk_logprobs": stats.topk_logprobs,
            "topk_ids": stats.topk_ids,
        }
    return results


@pytest.mark.distributed
def test_tensor_parallel_matches_reference_for_tp_1_2_4():
    ranks = run_distributed(_tp_body, world_size=4, timeout_s=120)
    for tp in (1, 2, 4):
        hidden_TH, weight_VH, targets_T = tp_case(tp)
        ref_logp = reference_logprobs(hidden_TH, weight_VH, targets_T, TP_VOCAB, TP_TEMP)
        ref_hidden, ref_weight = reference_grads(
            hidden_TH, weight_VH, targets_T, torch.arange(TP_TOKENS), TP_VOCAB, TP_TEMP
        )
        ref_top, ref_ids = reference_topk(hidden_TH, weight_VH, TP_VOCAB, TP_TEMP, TP_TOP_K)
        ref_entropy = reference_entropy(hidden_TH, weight_VH, TP_VOCAB, TP_TEMP)
        shard_rows = padded_rows(tp) // tp
        for rank, by_tp in enumerate(ranks):
            got = by_tp[tp]
            where = f"TP={tp}, rank {rank}"
            assert got["tp_rank"] == (rank % tp if tp > 1 else 0), where
            for key in ("logp", "from_logits"):
                torch.testing.assert_close(got[key].double(), ref_logp, **FP32_TOL, msg=where)
            torch.testing.assert_close(
                got["grad_hidden"].double(), ref_hidden, **FP32_TOL, msg=where
            )
            rows = slice(got["tp_rank"] * shard_rows, (got["tp_rank"] + 1) * shard_rows)
            torch.testing.assert_close(
                got["grad_weight"].double(), ref_weight[rows], **FP32_TOL, msg=where
            )
            torch.testing.assert_close(got["entropy"].double(), ref_entropy, **FP32_TOL)
            torch.testing.assert_close(got["topk_logprobs"].double(), ref_top, **FP32_TOL)
            assert torch.equal(got["topk_ids"], ref_ids), where
            # the hidden gradient is all-reduced: bitwise the same on every rank of the group
            assert torch.equal(got["grad_hidden"], ranks[rank - rank % tp][tp]["grad_hidden"])
