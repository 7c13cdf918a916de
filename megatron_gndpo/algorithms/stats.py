"""Masked moments and whitening over the whole step batch, sharded or not.

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded).
``[B, T]`` tensors hold one value per response position; ``mask_BT`` is 1 on response tokens
(up to and including EOS) and 0 on padding.

The only collective is one float64 ``all_reduce(SUM)`` of ``[Σm, Σm·x, Σm·x²]`` over the group
passed in. That group is the data-parallel × context-parallel group: those ranks hold disjoint
tokens of the step batch. Never the tensor-parallel group (its ranks hold the same tokens, so a
sum over it counts each token TP times) and never per micro-batch (the statistics are over the
whole step batch). ``group=None`` means this process holds the whole batch: no collective at
all, and ``torch.distributed`` need not be initialised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Added to the token count before dividing, exactly as the GNDPO release does
# (verl/utils/torch_functional.py); it keeps mu and var finite without a host-side branch.
_COUNT_EPS = 1e-8

# Every rank must reach the same verdict, so the check uses the *global* count.
_MIN_TOKENS_FOR_WHITENING = 2


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all named tensors have the same shape (names go in the message)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(
            f"tensors must have the same [B, T] shape, got {listed}; pass per-token tensors "
            "cut to the same response length"
        )


def masked_values(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, exactly 0 elsewhere (padding may hold inf or NaN)."""
    return torch.where(mask_BT.bool(), values_BT, 0.0)


def global_sum(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """float64 copy of ``value`` summed over ``group`` (``None``: no collective, just the copy).

    Every rank of ``group`` must call it with a tensor of the same shape.
    """
    total = value.detach().to(torch.float64).clone()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def masked_moments(
    values: torch.Tensor,
    mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``[Σm, Σm·x, Σm·x²]`` over every valid token of the group, float64, shape ``[3]``.

    values, mask: ``[B, T]`` (any shape, as long as they match; ``B`` may be 0). Summed in
    float64 on this rank, then one ``all_reduce(SUM)`` over ``group``. Every rank of the group
    must call it, including one whose shard has no valid token or no row at all.
    Source: GNDPO (arXiv 2606.09091) global normalisation, ALGORITHMS.md §2.
    """
    check_same_shape(values=values, mask=mask)
    with torch.no_grad():
        m = mask.to(torch.float64)
        x = masked_values(values.detach().to(torch.float64), mask)
        local = torch.stack([m.sum(), (m * x).sum(), (m * x * x).sum()])
        return global_sum(local, group)


def moments_to_mean_var(
    moments: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance (float64 0-d) from ``[n, Σx, Σx²]``, with the release's ``n + 1e-8``.

    mu = Σx / (n + 1e-8);  var = [Σ(x − mu)² / (n + 1e-8)] · n / (n − 1) when unbiased, where
    Σ(x − mu)² = Σx² − 2·mu·Σx + mu²·n (float64, clamped at 0 against rounding).
    The Bessel factor is applied only for n > 1; the caller decides what n < 2 means.
    """
    n, sum_x, sum_x2 = moments.unbind()
    mu = sum_x / (n + _COUNT_EPS)
    sum_sq_dev = (sum_x2 - 2.0 * mu * sum_x + mu * mu * n).clamp(min=0.0)
    var = sum_sq_dev / (n + _COUNT_EPS)
    if unbiased:
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1.0), var)
    return mu, var


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
    unbiased: bool = True,
    subtract_mean: bool = True,
    divide_std: bool = True,
) -> torch.Tensor:
    """Whiten ``values`` over every valid token of the group; float32 ``[B, T]``, 0 where masked.

        n   = Σ m
        mu  = Σ m·x / (n + 1e-8)
        var = [Σ m·(x − mu)² / (n + 1e-8)] · n / (n − 1)      (the Bessel factor if unbiased)
        out = m · (x − mu) / sqrt(var + eps)

    ``subtract_mean`` / ``divide_std`` false leave out ``− mu`` / ``/ sqrt(var + eps)`` (one half
    of the whitening, from the same statistics).

    values, mask: ``[B, T]``. The statistics come from :func:`masked_moments` (one float64
    all-reduce over ``group``, the DP × CP group), so every split of the batch across ranks gives
    the single-process result. A constant input gives ~0, never NaN.
    Source: GNDPO (arXiv 2606.09091) and its release, ALGORITHMS.md §2.

    Detached. Raises ValueError (on every rank alike) when the whole batch has fewer than two
    valid tokens.
    """
    moments = masked_moments(values, mask, group)
    n_global = int(moments[0].item())
    if n_global < _MIN_TOKENS_FOR_WHITENING:
        raise ValueError(
            "GNDPO/whitening needs at least two valid response tokens in the whole batch "
            f"(got {n_global}); increase the rollout batch size or the max response length, "
            "or check that the response mask marks the generated tokens"
        )
    mu, var = moments_to_mean_var(moments, unbiased=unbiased)
    with torch.no_grad():
        x = values.detach().to(torch.float64)
        whitened = x - mu if subtract_mean else x
        if divide_std:
            whitened = whitened * torch.rsqrt(var + eps)
        return masked_values(whitened, mask).to(torch.float32)
