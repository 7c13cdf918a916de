"""Vocab-parallel multi-target log-probs, entropy, argmax, sampling and KL (issue 8) equal
float64 references on the gathered full-vocabulary logits, values and gradients.

Shapes: hidden [T, H], weight [V, H] (V rows, padding included; [V/tp, H] per TP rank),
targets [T] or [T, K]. The references are ``log_softmax(hidden · Wᵀ / τ)`` in float64 with the
padding columns at −inf. One 4-rank gloo launch covers TP = 1, 2 and 4 for every function.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_gndpo.parallel import vocab_stats
from megatron_gndpo.parallel.logprobs import (
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
    vocab_parallel_logprobs_from_logits,
    vocab_parallel_token_stats,
)
from megatron_gndpo.parallel.vocab_stats import (
    vocab_parallel_argmax,
    vocab_parallel_kl,
    vocab_parallel_kl_from_logits,
    vocab_parallel_sample,
)
from tests.harness import run_distributed
from tests.logprob_refs import MemoryRecorder, make_case, reference_log_softmax

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_targets(tokens: int, k: int, vocab_size: int, *, seed: int = 3) -> torch.Tensor:
    """[T, K] ids < vocab_size, with a repeated id in every row when K > 1 (ids may repeat)."""
    gen = torch.Generator().manual_seed(seed)
    targets_TK = torch.randint(0, vocab_size, (tokens, k), generator=gen)
    if k > 1:
        targets_TK[:, -1] = targets_TK[:, 0]
    return targets_TK


def reference_multi(hidden_TH, weight_VH, targets_TK, vocab_size, temperature):
    """float64 [T, K] log-probs and [T] entropy, differentiable by autograd."""
    logp_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temperature)
    real_TV = logp_TV[:, :vocab_size]  # padding: p·log p = 0·(−inf), whose autograd is NaN
    entropy_T = -(real_TV.exp() * real_TV).sum(-1)
    return logp_TV.gather(-1, targets_TK), entropy_T


def reference_loss_grads(hidden_TH, weight_VH, targets_TK, grad_TK, grad_ent_T, vocab, temp):
    """float64 gradients of Σ grad_TK·logp_TK + Σ grad_ent_T·H_T w.r.t. hidden and weight."""
    hidden64 = hidden_TH.detach().double().requires_grad_()
    weight64 = weight_VH.detach().double().requires_grad_()
    logp_TK, entropy_T = reference_multi(hidden64, weight64, targets_TK, vocab, temp)
    loss = torch.zeros((), dtype=torch.float64)
    if grad_TK is not None:
        loss = loss + (logp_TK * grad_TK.double()).sum()
    if grad_ent_T is not None:
        loss = loss + (entropy_T * grad_ent_T.double()).sum()
    loss.backward()
    return hidden64.grad, weight64.grad


# (tokens, hidden, rows, vocab_size, chunk_tokens, temperature, K)
CASES = [
    pytest.param(37, 16, 50, 45, 8, 0.7, 4, id="padding-chunks-not-dividing-K4"),
    pytest.param(64, 8, 33, 33, 64, 1.0, 1, id="one-chunk-no-padding-K1"),
    pytest.param(30, 12, 70, 61, 7, 1.6, 20, id="K20-temperature"),
    pytest.param(1, 4, 7, 5, 3, 1.3, 2, id="one-token"),
    pytest.param(0, 4, 7, 7, 2, 1.0, 3, id="no-tokens"),
]
CASE_ARGS = ("tokens", "hidden", "rows", "vocab_size", "chunk", "temp", "k")


def _leaf_case(tokens, hidden, rows, vocab_size):
    hidden_TH, weight_VH, _ = make_case(tokens, hidden, rows, vocab_size)
    if rows > vocab_size:  # padding rows that would dominate if they were not masked
        weight_VH[vocab_size:] = 3.0 * weight_VH[:1]
    return hidden_TH.requires_grad_(), weight_VH.requires_grad_()


@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_multi_target_logprobs_and_gradients(tokens, hidden, rows, vocab_size, chunk, temp, k):
    hidden_TH, weight_VH = _leaf_case(tokens, hidden, rows, vocab_size)
    targets_TK = make_targets(tokens, k, vocab_size)
    kwargs = {"vocab_size": vocab_size, "chunk_tokens": chunk, "temperature": temp}
    logp_TK = vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK, **kwargs)
    assert logp_TK.shape == (tokens, k) and logp_TK.dtype == torch.float32
    ref_TK, _ = reference_multi(
        hidden_TH.detach(), weight_VH.detach(), targets_TK, vocab_size, temp
    )
    torch.testing.assert_close(logp_TK.double(), ref_TK, **FP32_TOL)
    # column k of the [T, K] call is the [T] call on column k
    for col in range(k):
        one_T = vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK[:, col], **kwargs)
        torch.testing.assert_close(logp_TK[:, col], one_T, rtol=0, atol=1e-6)

    grad_TK = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    (logp_TK * grad_TK).sum().backward()
    ref_hidden, ref_weight = reference_loss_grads(
        hidden_TH, weight_VH, targets_TK, grad_TK, None, vocab_size, temp
    )
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    torch.testing.assert_close(hidden_TH.grad.double(), ref_hidden, **FP32_TOL)
    torch.testing.assert_close(weight_VH.grad.double(), ref_weight, **FP32_TOL)
    assert not weight_VH.grad[vocab_size:].any()  # padding takes no mass, gets no gradient


@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_logprobs_and_entropy_values_and_gradients(
    tokens, hidden, rows, vocab_size, chunk, temp, k
):
    hidden_TH, weight_VH = _leaf_case(tokens, hidden, rows, vocab_size)
    targets_TK = make_targets(tokens, k, vocab_size)
    kwargs = {"vocab_size": vocab_size, "chunk_tokens": chunk, "temperature": temp}
    logp_TK, entropy_T = vocab_parallel_logprobs_and_entropy(
        hidden_TH, weight_VH, targets_TK, **kwargs
    )
    assert entropy_T.shape == (tokens,) and entropy_T.dtype == torch.float32
    ref_TK, ref_entropy_T = reference_multi(
        hidden_TH.detach(), weight_VH.detach(), targets_TK, vocab_size, temp
    )
    torch.testing.assert_close(logp_TK.double(), ref_TK, **FP32_TOL)
    torch.testing.assert_close(entropy_T.double(), ref_entropy_T, **FP32_TOL)

    gen = torch.Generator().manual_seed(2)
    grad_TK, grad_ent_T = torch.randn(tokens, k, generator=gen), torch.randn(tokens, generator=gen)
    ((logp_TK * grad_TK).sum() + (entropy_T * grad_ent_T).sum()).backward()
    ref_hidden, ref_weight = reference_loss_grads(
        hidden_TH, weight_VH, targets_TK, grad_TK, grad_ent_T, vocab_size, temp
    )
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    torch.testing.assert_close(hidden_TH.grad.double(), ref_hidden, **FP32_TOL)
    torch.testing.assert_close(weight_VH.grad.double(), ref_weight, **FP32_TOL)
    assert not weight_VH.grad[vocab_size:].any()
    assert torch.isfinite(weight_VH.grad).all()


@pytest.mark.parametrize("use", ["entropy-only", "logp-only", "entropy-function"])
def test_entropy_gradient_when_one_output_is_unused(use):
    tokens, vocab_size, temp = 19, 29, 0.8
    hidden_TH, weight_VH = _leaf_case(tokens, 8, 32, vocab_size)
    targets_T = make_targets(tokens, 1, vocab_size)[:, 0]
    kwargs = {"vocab_size": vocab_size, "chunk_tokens": 6, "temperature": temp}
    grad_T = torch.randn(tokens, generator=torch.Generator().manual_seed(4))
    if use == "entropy-function":
        entropy_T = vocab_parallel_entropy(hidden_TH, weight_VH, **kwargs)
        (entropy_T * grad_T).sum().backward()
        grads: tuple[Any, Any] = (None, grad_T)
    else:
        logp_T, entropy_T = vocab_parallel_logprobs_and_entropy(
            hidden_TH, weight_VH, targets_T, **kwargs
        )
        used = entropy_T if use == "entropy-only" else logp_T
        (used * grad_T).sum().backward()
        grads = (None, grad_T) if use == "entropy-only" else (grad_T[:, None], None)
    ref_hidden, ref_weight = reference_loss_grads(
        hidden_TH, weight_VH, targets_T[:, None], *grads, vocab_size, temp
    )
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    torch.testing.assert_close(hidden_TH.grad.double(), ref_hidden, **FP32_TOL)
    torch.testing.assert_close(weight_VH.grad.double(), ref_weight, **FP32_TOL)


def test_entropy_function_equals_token_stats_and_single_target_path_is_unchanged():
    tokens, vocab_size, temp = 25, 40, 1.2
    hidden_TH, weight_VH, targets_T = make_case(tokens, 8, 48, vocab_size)
    kwargs = {"vocab_size": vocab_size, "chunk_tokens": 7, "temperature": temp}
    stats = vocab_parallel_token_stats(hidden_TH, weight_VH, targets_T, entropy=True, **kwargs)
    entropy_T = vocab_parallel_entropy(hidden_TH, weight_VH, **kwargs)
    assert stats.entropy is not None
    assert torch.equal(entropy_T, stats.entropy)
    logp_T, _ = vocab_parallel_logprobs_and_entropy(hidden_TH, weight_VH, targets_T, **kwargs)
    assert logp_T.shape == (tokens,)
    assert torch.equal(logp_T, vocab_parallel_logprobs(hidden_TH, weight_VH, targets_T, **kwargs))
    # token_stats takes [T, K] targets too
    targets_TK = make_targets(tokens, 3, vocab_size)
    stats = vocab_parallel_token_stats(hidden_TH, weight_VH, targets_TK, **kwargs)
    assert stats.logprobs.shape == (tokens, 3)
    torch.testing.assert_close(
        stats.logprobs, vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK, **kwargs)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_logits_multi_target(dtype):
    vocab_size, temp, k = 45, 0.8, 5
    hidden_TH, weight_VH, _ = make_case(30, 16, 50, vocab_size)
    logits_BSV = (hidden_TH @ weight_VH.t()).to(dtype).view(5, 6, 50).requires_grad_()
    before = logits_BSV.detach().clone()
    targets_BSK = make_targets(30, k, vocab_size).view(5, 6, k)
    logp_BSK = vocab_parallel_logprobs_from_logits(
        logits_BSV, targets_BSK, vocab_size=vocab_size, temperature=temp
    )
    assert logp_BSK.shape == (5, 6, k) and logp_BSK.dtype == torch.float32
    logits64_BSV = logits_BSV.detach().double().requires_grad_()
    padding_V = torch.arange(50) >= vocab_size
    ref_BSV = torch.log_softmax(logits64_BSV.masked_fill(padding_V, -math.inf) / temp, dim=-1)
    ref_BSK = ref_BSV.gather(-1, targets_BSK)
    torch.testing.assert_close(logp_BSK.double(), ref_BSK.detach(), **FP32_TOL)
    grad_BSK = torch.randn(5, 6, k)
    (logp_BSK * grad_BSK).sum().backward()
    (ref_BSK * grad_BSK.double()).sum().backward()
    assert logits_BSV.grad is not None and logits_BSV.grad.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(logits_BSV.grad.double(), logits64_BSV.grad, **tol)
    assert torch.equal(logits_BSV.detach(), before)


def test_memory_of_multi_target_and_entropy_is_bounded_by_the_chunk():
    tokens, hidden, vocab, chunk, k = 1024, 8, 2000, 128, 8
    hidden_TH, weight_VH, _ = make_case(tokens, hidden, vocab, vocab)
    targets_TK = make_targets(tokens, k, vocab)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    chunk_bytes = 4 * chunk * vocab  # one float32 [C, V] buffer
    with MemoryRecorder(hidden_TH, weight_VH, targets_TK) as rec:
        logp_TK, entropy_T = vocab_parallel_logprobs_and_entropy(
            hidden_TH, weight_VH, targets_TK, chunk_tokens=chunk
        )
        (logp_TK.sum() + entropy_T.sum()).backward()
    assert rec.largest_numel <= chunk * vocab
    # The entropy path holds two [C, V] buffers at once (logits and p, or e and e·log e).
    assert rec.peak_bytes < 2.25 * chunk_bytes
    assert 8 * chunk_bytes <= 4 * tokens * vocab


def test_errors_name_the_problem():
    hidden_TH, weight_VH, _ = make_case(6, 4, 10, 8)
    targets_TK = make_targets(6, 3, 8)
    with pytest.raises(ValueError, match="K >= 1"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK[:, :0])
    with pytest.raises(ValueError, match="K >= 1"):
        vocab_parallel_logprobs_and_entropy(hidden_TH, weight_VH, targets_TK[:, :0])
    bad_TK = targets_TK.clone()
    bad_TK[2, 1] = 8
    with pytest.raises(ValueError, match=r"vocab_size=8\); got \[8\]"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, bad_TK, vocab_size=8)
    with pytest.raises(ValueError, match=r"targets \(5, 3\)"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK[:5])
    with pytest.raises(ValueError, match=r"targets \(6, 3, 1\)"):
        vocab_parallel_logprobs(hidden_TH, weight_VH, targets_TK[..., None])
    with pytest.raises(ValueError, match=r"hidden \(6, 5\)"):
        vocab_parallel_entropy(torch.randn(6, 5), weight_VH)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_entropy(hidden_TH, weight_VH, temperature=0.0)
    logits_TV = hidden_TH @ weight_VH.t()
    with pytest.raises(ValueError, match="K >= 1"):
        vocab_parallel_logprobs_from_logits(logits_TV, targets_TK[:, :0])
    with pytest.raises(ValueError, match=r"logits \(6, 10\) and targets \(5, 3\)"):
        vocab_parallel_logprobs_from_logits(logits_TV, targets_TK[:5])
    with pytest.raises(ValueError, match=r"vocab_size=8\); got \[8\]"):
        vocab_parallel_logprobs_from_logits(logits_TV, bad_TK, vocab_size=8)


# ---------------------------------------------------------------------------------------------
# Forward-only: argmax, sampling, full-vocabulary KL (parallel/vocab_stats.py).


def reference_gumbel(seed: int, tokens: int, chunk: int, vocab_size: int) -> torch.Tensor:
    """float64 [T, vocab_size] noise laid out as vocab_parallel_sample draws it: per chunk of
    tokens, per block of _NOISE_BLOCK_IDS ids, one [C, block] float64 uniform draw."""
    gen = torch.Generator().manual_seed(seed)
    block = vocab_stats._NOISE_BLOCK_IDS
    rows = []
    for start in range(0, tokens, chunk):
        num = min(chunk, tokens - start)
        rows.append(
            torch.cat(
                [
                    torch.rand(
                        (num, min(block, vocab_size - lo)), generator=gen, dtype=torch.float64
                    )
                    for lo in range(0, vocab_size, block)
                ],
                dim=-1,
            )
        )
    uniform_TV = torch.cat(rows) if rows else torch.empty(0, vocab_size, dtype=torch.float64)
    return -(-uniform_TV.log()).log()


def test_argmax_matches_reference_and_token_stats_top1():
    tokens, vocab_size, temp = 37, 45, 0.7
    hidden_TH, weight_VH, targets_T = make_case(tokens, 16, 50, vocab_size)
    weight_VH[vocab_size:] = 10.0 * hidden_TH[:1]  # padding that would win if not masked
    ids_T = vocab_parallel_argmax(hidden_TH, weight_VH, vocab_size=vocab_size, chunk_tokens=8)
    ref_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temp)
    assert ids_T.dtype == torch.int64 and torch.equal(ids_T, ref_TV.argmax(-1))
    stats = vocab_parallel_token_stats(
        hidden_TH, weight_VH, targets_T, vocab_size=vocab_size, temperature=temp, top_k=1
    )
    assert stats.topk_ids is not None and stats.topk_logprobs is not None
    assert torch.equal(stats.topk_ids[:, 0], ids_T)
    torch.testing.assert_close(
        stats.topk_logprobs[:, 0].double(), ref_TV.max(-1).values, **FP32_TOL
    )


@pytest.mark.parametrize("block", [4096, 10], ids=["one-block", "blocks-of-10"])
def test_sample_is_gumbel_max_of_the_documented_noise(block, monkeypatch):
    monkeypatch.setattr(vocab_stats, "_NOISE_BLOCK_IDS", block)
    tokens, vocab_size, temp, chunk = 37, 45, 0.7, 8
    hidden_TH, weight_VH, _ = make_case(tokens, 16, 50, vocab_size)
    weight_VH[vocab_size:] = 10.0 * hidden_TH[:1]
    kwargs = {"vocab_size": vocab_size, "chunk_tokens": chunk, "temperature": temp}
    ids_T = vocab_parallel_sample(
        hidden_TH, weight_VH, generator=torch.Generator().manual_seed(7), **kwargs
    )
    ref_TV = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temp)[:, :vocab_size]
    noise_TV = reference_gumbel(7, tokens, chunk, vocab_size)
    assert torch.equal(ids_T, (ref_TV + noise_TV).argmax(-1))
    again = vocab_parallel_sample(
        hidden_TH, weight_VH, generator=torch.Generator().manual_seed(7), **kwargs
    )
    other = vocab_parallel_sample(
        hidden_TH, weight_VH, generator=torch.Generator().manual_seed(8), **kwargs
    )
    assert torch.equal(ids_T, again) and not torch.equal(ids_T, other)


def test_sample_frequencies_follow_the_tempered_softmax():
    tokens, vocab_size, temp = 6000, 6, 1.5
    hidden_TH, weight_VH, _ = make_case(1, 4, 8, vocab_size)
    weight_VH[vocab_size:] = 10.0 * hidden_TH  # padding that would win if not masked
    ids_T = vocab_parallel_sample(
        hidden_TH.expand(tokens, -1),
        weight_VH,
        generator=torch.Generator().manual_seed(0),
        vocab_size=vocab_size,
        chunk_tokens=1000,
        temperature=temp,
    )
    freq_V = torch.bincount(ids_T, minlength=8).double() / tokens
    probs_V = reference_log_softmax(hidden_TH, weight_VH, vocab_size, temp)[0].exp()
    assert not freq_V[vocab_size:].any()
    # binomial std ≤ sqrt(0.25 / 6000) ≈ 0.0065: 0.03 is over 4.5 sigma
    torch.testing.assert_close(freq_V, probs_V, rtol=0, atol=0.03)


def reference_kl(hidden_p, weight_p, hidden_q, weight_q, vocab_size, temp):
    logp_TV = reference_log_softmax(hidden_p, weight_p, vocab_size, temp)[:, :vocab_size]
    logq_TV = reference_log_softmax(hidden_q, weight_q, vocab_size, temp)[:, :vocab_size]
    return (logp_TV.exp() * (logp_TV - logq_TV)).sum(-1)


def kl_pair(tokens, rows, vocab_size, *, seed=0):
    """Student p (H=8) and teacher q (H=12, bfloat16-free float32) sharing the vocabulary."""
    hidden_p, weight_p, _ = make_case(tokens, 8, rows, vocab_size, seed=seed)
    hidden_q, weight_q, _ = make_case(tokens, 12, rows, vocab_size, seed=seed + 100)
    weight_p[vocab_size:] = 10.0 * weight_p[:1]  # padding that would dominate if not masked
    weight_q[vocab_size:] = -10.0 * weight_q[:1]
    return hidden_p, weight_p, hidden_q, weight_q


@pytest.mark.parametrize(
    ("tokens", "rows", "vocab_size", "chunk", "temp"),
    [(37, 50, 45, 8, 0.7), (16, 33, 33, 64, 1.0), (0, 7, 7, 2, 1.0)],
    ids=["padding-chunks-not-dividing", "one-chunk-no-padding", "no-tokens"],
)
def test_kl_matches_reference(tokens, rows, vocab_size, chunk, temp):
    hidden_p, weight_p, hidden_q, weight_q = kl_pair(tokens, rows, vocab_size)
    kwargs = {"vocab_size": vocab_size, "temperature": temp}
    kl_T = vocab_parallel_kl(hidden_p, weight_p, hidden_q, weight_q, chunk_tokens=chunk, **kwargs)
    assert kl_T.dtype == torch.float32 and kl_T.shape == (tokens,)
    ref_T = reference_kl(hidden_p, weight_p, hidden_q, weight_q, vocab_size, temp)
    torch.testing.assert_close(kl_T.double(), ref_T, **FP32_TOL)
    same_T = vocab_parallel_kl(hidden_p, weight_p, hidden_p, weight_p, **kwargs)
    torch.testing.assert_close(same_T, torch.zeros(tokens), rtol=0, atol=1e-6)
    logits_p = (hidden_p @ weight_p.t()).view(1, tokens, rows)
    logits_q = (hidden_q @ weight_q.t()).view(1, tokens, rows)
    before = logits_p.clone()
    from_logits = vocab_parallel_kl_from_logits(logits_p, logits_q, **kwargs)
    assert from_logits.shape == (1, tokens) and torch.equal(logits_p, before)
    torch.testing.assert_close(from_logits[0].double(), ref_T, **FP32_TOL)


def test_kl_memory_is_bounded_by_the_chunk():
    tokens, vocab, chunk = 1024, 2000, 128
    hidden_p, weight_p, hidden_q, weight_q = kl_pair(tokens, vocab, vocab)
    chunk_bytes = 4 * chunk * vocab
    with MemoryRecorder(hidden_p, weight_p, hidden_q, weight_q) as rec:
        vocab_parallel_kl(hidden_p, weight_p, hidden_q, weight_q, chunk_tokens=chunk)
    assert rec.largest_numel <= chunk * vocab
    assert rec.peak_bytes < 3.25 * chunk_bytes  # both models' logits and a − b
    assert 8 * chunk_bytes <= 4 * tokens * vocab


def test_forward_only_errors_name_the_problem():
    hidden_p, weight_p, hidden_q, weight_q = kl_pair(6, 10, 8)
    with pytest.raises(ValueError, match="same vocabulary rows"):
        vocab_parallel_kl(hidden_p, weight_p, hidden_q, weight_q[:9])
    with pytest.raises(ValueError, match="same tokens"):
        vocab_parallel_kl(hidden_p, weight_p, hidden_q[:5], weight_q)
    with pytest.raises(ValueError, match=r"hidden \(6, 12\), weight \(10, 8\)"):
        vocab_parallel_kl(hidden_q, weight_p, hidden_q, weight_q)
    with pytest.raises(ValueError, match="share a dtype"):
        vocab_parallel_kl(hidden_p, weight_p, hidden_q.double(), weight_q)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_kl(hidden_p, weight_p, hidden_q, weight_q, temperature=-1.0)
    with pytest.raises(ValueError, match=r"vocab_size=11"):
        vocab_parallel_argmax(hidden_p, weight_p, vocab_size=11)
    with pytest.raises(ValueError, match="same shape"):
        vocab_parallel_kl_from_logits(torch.randn(3, 10), torch.randn(3, 9))
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_sample(
            hidden_p, weight_p, generator=torch.Generator().manual_seed(0), chunk_tokens=0
        )


# ---------------------------------------------------------------------------------------------
# Tensor parallel: one 4-rank launch, TP = 1, 2 and 4, every function of this file.

TP_TOKENS, TP_HIDDEN, TP_VOCAB, TP_CHUNK, TP_TEMP, TP_K = 23, 8, 37, 5, 0.9, 6


def padded_rows(tp: int) -> int:
    """Megatron-style padding to a multiple of 16·tp: 48, 64, 64 rows for TP 1, 2, 4 (with
    TP=4 the last rank holds padding only, and 37 is a multiple of no TP size)."""
    multiple = 16 * tp
    return -(-TP_VOCAB // multiple) * multiple


def tp_case(tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], full weight [rows, H], [T, K] targets and [T, K] upstream gradients."""
    hidden_TH, weight_VH, _ = make_case(TP_TOKENS, TP_HIDDEN, padded_rows(tp), TP_VOCAB, seed=tp)
    weight_VH[TP_VOCAB:] = 10.0 * hidden_TH[:1]  # padding that would win if it were not masked
    targets_TK = make_targets(TP_TOKENS, TP_K, TP_VOCAB, seed=10 + tp)
    grad_TK = torch.randn(TP_TOKENS, TP_K, generator=torch.Generator().manual_seed(20 + tp))
    return hidden_TH, weight_VH, targets_TK, grad_TK


def shard_of(weight_VH: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    rows = weight_VH.shape[0] // tp
    return weight_VH[tp_rank * rows : (tp_rank + 1) * rows].clone()


# Student and teacher for the forward-only checks: the same data at every TP size (64 rows
# split 64/32/16 per rank; with TP=4 rank 2 holds 5 real ids, rank 3 padding only), so the
# sampled ids can be compared across TP sizes. Noise blocks of 10 ids straddle the shards.
TP_ROWS, TP_HIDDEN_TEACHER, TP_SEED, TP_NOISE_BLOCK = 64, 12, 99, 10


def shared_case() -> tuple[torch.Tensor, ...]:
    """Student hidden [T, 8], weight [64, 8]; teacher hidden [T, 12], weight [64, 12]; [T]."""
    hidden_p, weight_p, targets_T = make_case(TP_TOKENS, TP_HIDDEN, TP_ROWS, TP_VOCAB, seed=5)
    hidden_q, weight_q, _ = make_case(TP_TOKENS, TP_HIDDEN_TEACHER, TP_ROWS, TP_VOCAB, seed=6)
    weight_p[TP_VOCAB:] = 10.0 * hidden_p[:1]  # padding that would win if it were not masked
    weight_q[TP_VOCAB:] = 10.0 * hidden_q[:1]
    return hidden_p, weight_p, hidden_q, weight_q, targets_T


def _forward_only_checks(tp: int, tp_rank: int, group: Any) -> dict[str, Any]:
    hidden_p, weight_p, hidden_q, weight_q, targets_T = shared_case()
    weight_p, weight_q = shard_of(weight_p, tp, tp_rank), shard_of(weight_q, tp, tp_rank)
    kwargs: dict[str, Any] = {"tp_group": group, "vocab_size": TP_VOCAB, "chunk_tokens": TP_CHUNK}
    tempered = {**kwargs, "temperature": TP_TEMP}
    logits_kwargs = {"tp_group": group, "vocab_size": TP_VOCAB, "temperature": TP_TEMP}
    # (5) the student's top-k ids, and the teacher's log-probs of those ids
    stats = vocab_parallel_token_stats(hidden_p, weight_p, targets_T, top_k=TP_K, **tempered)
    assert stats.topk_ids is not None
    return {
        "argmax": vocab_parallel_argmax(hidden_p, weight_p, **kwargs),
        "sample": vocab_parallel_sample(
            hidden_p, weight_p, generator=torch.Generator().manual_seed(TP_SEED), **tempered
        ),
        "kl": vocab_parallel_kl(hidden_p, weight_p, hidden_q, weight_q, **tempered),
        "kl_from_logits": vocab_parallel_kl_from_logits(
            hidden_p @ weight_p.t(), hidden_q @ weight_q.t(), **logits_kwargs
        ),
        "student_topk": (stats.topk_ids, stats.topk_logprobs),
        "teacher_at_student_topk": vocab_parallel_logprobs(
            hidden_q, weight_q, stats.topk_ids, **tempered
        ),
    }


def _tp_body(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    vocab_stats._NOISE_BLOCK_IDS = TP_NOISE_BLOCK  # this spawned process only
    # Group creation is collective: every rank creates every group, in the same order.
    groups: dict[int, dist.ProcessGroup | None] = {1: None}
    for size in (2, 4):
        groups[size], _ = dist.new_subgroups(group_size=size)
    results = {}
    for tp, group in groups.items():
        tp_rank = 0 if group is None else dist.get_rank(group)
        hidden_TH, weight_VH, targets_TK, grad_TK = tp_case(tp)
        weight_shard = shard_of(weight_VH, tp, tp_rank)
        kwargs: dict[str, Any] = {
            "tp_group": group,
            "vocab_size": TP_VOCAB,
            "chunk_tokens": TP_CHUNK,
            "temperature": TP_TEMP,
        }
        out: dict[str, Any] = {"tp_rank": tp_rank}

        # (1) multi-target log-probs with gradients
        hidden, weight = hidden_TH.clone().requires_grad_(), weight_shard.clone().requires_grad_()
        logp_TK = vocab_parallel_logprobs(hidden, weight, targets_TK, **kwargs)
        (logp_TK * grad_TK).sum().backward()
        out["multi"] = (logp_TK.detach(), hidden.grad, weight.grad)

        # (2) log-probs and entropy in one pass, loss on both
        hidden, weight = hidden_TH.clone().requires_grad_(), weight_shard.clone().requires_grad_()
        logp_TK, entropy_T = vocab_parallel_logprobs_and_entropy(
            hidden, weight, targets_TK, **kwargs
        )
        ((logp_TK * grad_TK).sum() + (entropy_T * grad_TK[:, 0]).sum()).backward()
        out["with_entropy"] = (logp_TK.detach(), entropy_T.detach(), hidden.grad, weight.grad)

        # entropy alone, and multi-target log-probs from existing logits
        hidden, weight = hidden_TH.clone().requires_grad_(), weight_shard.clone().requires_grad_()
        entropy_T = vocab_parallel_entropy(hidden, weight, **kwargs)
        (entropy_T * grad_TK[:, 1]).sum().backward()
        out["entropy"] = (entropy_T.detach(), hidden.grad, weight.grad)
        logits_TV = hidden_TH @ weight_shard.t()
        from_logits_kwargs = {k: v for k, v in kwargs.items() if k != "chunk_tokens"}
        out["from_logits"] = vocab_parallel_logprobs_from_logits(
            logits_TV, targets_TK, **from_logits_kwargs
        )
        out.update(_forward_only_checks(tp, tp_rank, group))
        results[tp] = out
    return results


def check_tp_grads(grads, ref_grads, own: slice, where: str) -> None:
    """This rank's (hidden, weight-shard) gradients against the full float64 reference."""
    (grad_hidden, grad_weight), (ref_hidden, ref_weight) = grads, ref_grads
    torch.testing.assert_close(grad_hidden.double(), ref_hidden, **FP32_TOL, msg=where)
    torch.testing.assert_close(grad_weight.double(), ref_weight[own], **FP32_TOL, msg=where)


def check_forward_only(got: dict[str, Any], where: str) -> None:
    """argmax, sample, KL and the top-k pieces against the gathered float64 computation."""
    hidden_p, weight_p, hidden_q, weight_q, _ = shared_case()
    logp_TV = reference_log_softmax(hidden_p, weight_p, TP_VOCAB, TP_TEMP)[:, :TP_VOCAB]
    logq_TV = reference_log_softmax(hidden_q, weight_q, TP_VOCAB, TP_TEMP)[:, :TP_VOCAB]
    assert torch.equal(got["argmax"], logp_TV.argmax(-1)), where
    noise_TV = reference_gumbel(TP_SEED, TP_TOKENS, TP_CHUNK, TP_VOCAB)
    assert torch.equal(got["sample"], (logp_TV + noise_TV).argmax(-1)), where
    ref_kl_T = (logp_TV.exp() * (logp_TV - logq_TV)).sum(-1)
    for key in ("kl", "kl_from_logits"):
        torch.testing.assert_close(got[key].double(), ref_kl_T, **FP32_TOL, msg=where)

    # (5) vOPD / TrOPD top-k pieces: the student's top-k over the full vocabulary, the
    # teacher's log-probs of those ids, and the top-k KL renormalised over them for both.
    ref_top_TK, ref_ids_TK = logp_TV.topk(TP_K, dim=-1)
    ids_TK, top_TK = got["student_topk"]
    assert torch.equal(ids_TK, ref_ids_TK), where
    torch.testing.assert_close(top_TK.double(), ref_top_TK, **FP32_TOL, msg=where)
    ref_teacher_TK = logq_TV.gather(-1, ref_ids_TK)
    teacher_TK = got["teacher_at_student_topk"]
    torch.testing.assert_close(teacher_TK.double(), ref_teacher_TK, **FP32_TOL, msg=where)

    def topk_kl(logp_TK: torch.Tensor, logq_TK: torch.Tensor) -> torch.Tensor:
        logp_TK, logq_TK = logp_TK.log_softmax(-1), logq_TK.log_softmax(-1)
        return (logp_TK.exp() * (logp_TK - logq_TK)).sum(-1)

    torch.testing.assert_close(
        topk_kl(top_TK.double(), teacher_TK.double()),
        topk_kl(ref_top_TK, ref_teacher_TK),
        **FP32_TOL,
        msg=where,
    )


@pytest.mark.distributed
def test_tensor_parallel_matches_reference_for_tp_1_2_4(monkeypatch):
    monkeypatch.setattr(vocab_stats, "_NOISE_BLOCK_IDS", TP_NOISE_BLOCK)  # as _tp_body does
    ranks = run_distributed(_tp_body, world_size=4, timeout_s=180)
    for tp in (1, 2, 4):
        hidden_TH, weight_VH, targets_TK, grad_TK = tp_case(tp)
        ref_TK, ref_entropy_T = reference_multi(hidden_TH, weight_VH, targets_TK, TP_VOCAB, TP_TEMP)
        ref_grads = {
            "multi": reference_loss_grads(
                hidden_TH, weight_VH, targets_TK, grad_TK, None, TP_VOCAB, TP_TEMP
            ),
            "with_entropy": reference_loss_grads(
                hidden_TH, weight_VH, targets_TK, grad_TK, grad_TK[:, 0], TP_VOCAB, TP_TEMP
            ),
            "entropy": reference_loss_grads(
                hidden_TH, weight_VH, targets_TK, None, grad_TK[:, 1], TP_VOCAB, TP_TEMP
            ),
        }
        for rank, by_tp in enumerate(ranks):
            got = by_tp[tp]
            where = f"TP={tp}, rank {rank}"
            assert got["tp_rank"] == (rank % tp if tp > 1 else 0), where
            rows = padded_rows(tp) // tp
            own = slice(got["tp_rank"] * rows, (got["tp_rank"] + 1) * rows)
            logp_TK, *grads = got["multi"]
            torch.testing.assert_close(logp_TK.double(), ref_TK, **FP32_TOL, msg=where)
            check_tp_grads(grads, ref_grads["multi"], own, f"multi {where}")
            logp_TK, entropy_T, *grads = got["with_entropy"]
            torch.testing.assert_close(logp_TK.double(), ref_TK, **FP32_TOL, msg=where)
            torch.testing.assert_close(entropy_T.double(), ref_entropy_T, **FP32_TOL, msg=where)
            check_tp_grads(grads, ref_grads["with_entropy"], own, f"with_entropy {where}")
            entropy_T, *grads = got["entropy"]
            torch.testing.assert_close(entropy_T.double(), ref_entropy_T, **FP32_TOL, msg=where)
            check_tp_grads(grads, ref_grads["entropy"], own, f"entropy {where}")
            torch.testing.assert_close(got["from_logits"].double(), ref_TK, **FP32_TOL, msg=where)
            check_forward_only(got, where)
            # the sample is the same at every TP size, not only equal to the reference
            assert torch.equal(got["sample"], ranks[0][1]["sample"]), where


# ---------------------------------------------------------------------------------------------
# Excluded ids (a VLM's image placeholder): no probability mass, at TP=1 and TP=2.

EXCLUDED = (3, 31)  # one id in each half of the 48 rows (one per TP=2 shard)


def reference_excluded(hidden_TH, weight_VH, vocab_size, temperature, excluded=EXCLUDED):
    """float64 log-softmax [T, V] with padding and the excluded ids at −inf."""
    logits_TV = hidden_TH.double() @ weight_VH.double().t() / temperature
    masked_V = torch.arange(weight_VH.shape[0]) >= vocab_size
    masked_V[list(excluded)] = True
    return torch.log_softmax(logits_TV.masked_fill(masked_V, -math.inf), dim=-1)


def excluded_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """48 rows, 40 real; the excluded rows would win every token if they took mass."""
    hidden_TH, weight_VH, targets_T = make_case(23, 8, 48, 40, seed=seed)
    weight_VH[list(EXCLUDED)] = 10.0 * hidden_TH.mean(0)
    targets_T = torch.where(torch.isin(targets_T, torch.tensor(EXCLUDED)), 7, targets_T)
    return hidden_TH, weight_VH, targets_T


def test_excluded_ids_take_no_mass():
    temp, kwargs = 0.9, {"vocab_size": 40, "chunk_tokens": 6, "excluded_ids": EXCLUDED}
    hidden_TH, weight_VH, targets_T = excluded_case()
    ref_TV = reference_excluded(hidden_TH, weight_VH, 40, temp)
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    logp_T, entropy_T = vocab_parallel_logprobs_and_entropy(
        hidden_TH, weight_VH, targets_T, temperature=temp, **kwargs
    )
    torch.testing.assert_close(logp_T.double(), ref_TV.gather(-1, targets_T[:, None])[:, 0],
                               **FP32_TOL)  # fmt: skip
    p_TV = ref_TV.exp()
    ref_entropy = -(p_TV * ref_TV.masked_fill(p_TV == 0, 0.0)).sum(-1)
    torch.testing.assert_close(entropy_T.double(), ref_entropy, **FP32_TOL)
    (logp_T.sum() + entropy_T.sum()).backward()
    assert hidden_TH.grad is not None and weight_VH.grad is not None
    assert torch.isfinite(hidden_TH.grad).all() and torch.isfinite(weight_VH.grad).all()
    assert torch.equal(weight_VH.grad[list(EXCLUDED)], torch.zeros(2, 8))  # no mass, no gradient
    with torch.no_grad():
        h, w = hidden_TH.detach(), weight_VH.detach()
        stats = vocab_parallel_token_stats(h, w, targets_T, top_k=5, temperature=temp, **kwargs)
        assert (
            stats.topk_ids is not None
            and not torch.isin(stats.topk_ids, torch.tensor(EXCLUDED)).any()
        )
        torch.testing.assert_close(stats.topk_ids, ref_TV.topk(5, -1).indices)
        ids = vocab_parallel_argmax(h, w, **kwargs)
        assert torch.equal(ids, ref_TV.argmax(-1))
        drawn = vocab_parallel_sample(h, w, generator=torch.Generator().manual_seed(1), **kwargs)
        assert not torch.isin(drawn, torch.tensor(EXCLUDED)).any()
        # KL between two models, both without the excluded ids: no NaN from −inf − (−inf)
        h2, w2, _ = excluded_case(seed=5)
        kl_T = vocab_parallel_kl(h, w, h2, w2, **kwargs)
        ref_p, ref_q = reference_excluded(h, w, 40, 1.0), reference_excluded(h2, w2, 40, 1.0)
        terms = ref_p.exp() * (ref_p - ref_q)
        torch.testing.assert_close(kl_T.double(), terms.nan_to_num(0.0).sum(-1), **FP32_TOL)
    with pytest.raises(ValueError, match="excluded_ids must be ids in"):
        vocab_parallel_logprobs(h, w, targets_T, vocab_size=40, excluded_ids=(40,))


def _excluded_tp2(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group([0, 1])
    hidden_TH, weight_VH, targets_T = excluded_case()
    shard = weight_VH.chunk(2)[rank]
    kwargs = {"vocab_size": 40, "chunk_tokens": 6, "excluded_ids": EXCLUDED, "tp_group": group}
    logp_T, entropy_T = vocab_parallel_logprobs_and_entropy(
        hidden_TH, shard, targets_T, temperature=0.9, **kwargs
    )
    return {"logp": logp_T, "entropy": entropy_T,
            "argmax": vocab_parallel_argmax(hidden_TH, shard, **kwargs)}  # fmt: skip


@pytest.mark.distributed
def test_excluded_ids_at_tp2():
    hidden_TH, weight_VH, targets_T = excluded_case()
    ref_TV = reference_excluded(hidden_TH, weight_VH, 40, 0.9)
    for got in run_distributed(_excluded_tp2, 2, timeout_s=120):
        expected = ref_TV.gather(-1, targets_T[:, None])[:, 0]
        torch.testing.assert_close(got["logp"].double(), expected, **FP32_TOL)
        assert torch.equal(got["argmax"], ref_TV.argmax(-1))
        assert torch.isfinite(got["entropy"]).all()
