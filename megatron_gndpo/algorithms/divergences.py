"""Divergences between the teacher's and the student's next-token distributions, restricted to
the teacher's top-k ids, with the rest of each distribution's mass in one tail bucket.

Shape legend: ``B`` = sequences on this rank, ``T`` = positions, ``K`` = the teacher's top-k ids
per position (``K + 1`` with the tail bucket). ``lt`` = the teacher's log-probs of its top-k ids
(a constant), ``ls`` = the student's log-probs of the same ids (differentiable: the update's
head computes them from the hidden states, so the gradient reaches every logit through the
softmax). Every function is per position; masking and aggregation are the caller's
(``engine/update.py``, ``aggregation.py``).

The two distributions the divergence compares, per position, on the K ids ``v_1 … v_K`` and,
with ``tail="bucket"``, one bucket for the rest of the vocabulary (TRL's ``loss_add_tail``):

    t = (π_T(v_1), …, π_T(v_K), 1 − Σ_k π_T(v_k))
    s = (π_S(v_1), …, π_S(v_K), 1 − Σ_k π_S(v_k))

``tail="renormalize"`` drops the bucket and renormalises both over the K ids (NeMo-RL's
``zero_outside_topk: false``, TRL with ``loss_add_tail=False``); ``tail="none"`` takes the K ids
as they are, not renormalised, forward KL only (TGPO's and TrOPD's formula). The divergences, with
``KL(a ‖ b) = Σ_j a_j (log a_j − log b_j)``:

    forward        KL(t ‖ s)                                   mode-covering
    reverse        KL(s ‖ t)                                   mode-seeking
    mixed          w·KL(t ‖ s) + (1 − w)·KL(s ‖ t)             NeMo-RL kl_type: mixed
    jsd            β·KL(t ‖ m) + (1 − β)·KL(s ‖ m),            GKD (Agarwal et al. 2024, eq. 1),
                   m = β·t + (1 − β)·s;                        TRL generalized_jsd_loss
                   β = 0 is KL(t ‖ s) and β = 1 is KL(s ‖ t), by definition
    skew_forward   KL(t ‖ λ·t + (1 − λ)·s)                     ROLL skewed_forward_kl (DistiLLM)
    skew_reverse   KL(s ‖ (1 − λ)·t + λ·s)                     ROLL skewed_reverse_kl

For 0 < β < 1 the JSD vanishes like β·KL(t ‖ s) as β → 0 and like (1 − β)·KL(s ‖ t) as β → 1:
the endpoints are the KLs themselves (as TRL defines them), not the JSD's limits.

With K = V − 1 the tail bucket is the one id left, and with K = V it is empty: the divergences
are then the full-vocabulary ones, value and gradient (tests/test_divergences.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_gndpo.algorithms.guidance import forward_kl_to_targets
from megatron_gndpo.algorithms.stats import check_same_shape

DIVERGENCES = ("forward", "reverse", "mixed", "jsd", "skew_forward", "skew_reverse")
# What the rest of each distribution's mass (outside the K ids) becomes; see the module docstring.
TAILS = ("none", "bucket", "renormalize")

# The least mass a tail bucket holds. The student's log-probs come from the head in float32, so
# 1 − Σ_k π(v_k) carries errors near float32's epsilon (1.2e-7): a smaller tail is noise, and its
# log would make the gradient through it (π_S(v_k) / tail) arbitrarily large. TRL floors it the
# same way. Where the floor applies the tail is a constant (no gradient through it).
_TAIL_FLOOR = 1e-7


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Which divergence the distillation term is, and what becomes of the mass outside the K
    ids (the module docstring has the formulas). The default is TGPO's and TrOPD's term: the
    forward KL to the K ids as they are."""

    kind: str = "forward"  # one of DIVERGENCES
    tail: str = "none"  # one of TAILS
    mixed_weight: float = 0.5  # w: the forward KL's share, kind "mixed"
    beta: float = 0.5  # β of kind "jsd", in [0, 1]
    skew: float = 0.1  # λ of kinds "skew_forward" / "skew_reverse", in [0, 1)

    def __post_init__(self) -> None:
        if self.kind not in DIVERGENCES:
            raise ValueError(f"unknown divergence {self.kind!r}; one of {DIVERGENCES}")
        if self.tail not in TAILS:
            raise ValueError(f"unknown tail {self.tail!r}; one of {TAILS}")
        if self.tail == "none" and self.kind != "forward":
            raise ValueError(
                f"the {self.kind} divergence needs a distribution on the K ids: tail 'bucket' "
                "or 'renormalize' ('none' is the unnormalised forward KL only)"
            )
        for name, value in (("mixed_weight", self.mixed_weight), ("beta", self.beta)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 0.0 <= self.skew < 1.0:
            raise ValueError(f"skew must be in [0, 1) (1 makes it 0), got {self.skew}")


def topk_divergence(
    student_logprobs_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    divergence: Divergence,
) -> torch.Tensor:
    """``divergence`` per position between the teacher's and the student's distributions on the
    K ids, float32 ``[B, T]``; differentiable w.r.t. ``student_logprobs`` only.

    Inputs ``[B, T, K]``: the log-probs of the same K ids (the teacher's top-k) under the student
    and the teacher. Teacher entries of −inf (mass 0) are allowed. ``Divergence()`` (forward, tail
    "none") is :func:`~megatron_gndpo.algorithms.guidance.forward_kl_to_targets`, bit for bit.
    """
    check_same_shape(student=student_logprobs_BTK, teacher=teacher_logprobs_BTK)
    if divergence.tail == "none":  # validated: forward
        return forward_kl_to_targets(student_logprobs_BTK, teacher_logprobs_BTK)
    # float64 on [B, T, K + 1]: small next to the model, and the tail 1 − Σ needs the digits
    log_t = _distribution(teacher_logprobs_BTK.detach().double(), divergence.tail)
    log_s = _distribution(student_logprobs_BTK.double(), divergence.tail)
    return _divergence(log_t, log_s, divergence).float()


def tail_mass(logprobs_BTK: torch.Tensor) -> torch.Tensor:
    """``1 − Σ_k π(v_k)`` per position, float32 ``[B, T]``: the mass outside the K ids (not
    floored; a metric of how much the top-k misses)."""
    return (-torch.expm1(logprobs_BTK.detach().double().logsumexp(-1))).clamp(min=0.0).float()


def _distribution(logprobs_BTK: torch.Tensor, tail: str) -> torch.Tensor:
    """Log-probs of the distribution compared, ``[B, T, K + 1]`` (bucket) or ``[B, T, K]``."""
    if tail == "renormalize":
        return logprobs_BTK - logprobs_BTK.logsumexp(-1, keepdim=True)
    # log(1 − Σ_k π) = log(−expm1(log Σ_k π)), with the tail at least _TAIL_FLOOR
    log_top = logprobs_BTK.logsumexp(-1, keepdim=True).clamp(max=math.log1p(-_TAIL_FLOOR))
    return torch.cat([logprobs_BTK, torch.log(-torch.expm1(log_top))], -1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a ‖ b) = Σ_j a_j (log a_j − log b_j)`` over the last dimension; ``a_j = 0`` adds 0."""
    a = log_a.exp()
    # where() before the product: 0 · (−inf) would be NaN in the value and in the gradient
    return (a * torch.where(a > 0, log_a - log_b, 0.0)).sum(-1)


def _log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight: float) -> torch.Tensor:
    """``log(weight·a + (1 − weight)·b)`` for ``weight`` in (0, 1)."""
    return torch.logaddexp(log_a + math.log(weight), log_b + math.log1p(-weight))


def _divergence(log_t: torch.Tensor, log_s: torch.Tensor, d: Divergence) -> torch.Tensor:
    """The divergence ``d`` between the distributions ``t`` and ``s`` (log-probs, last dim)."""
    if d.kind == "forward":
        return _kl(log_t, log_s)
    if d.kind == "reverse":
        return _kl(log_s, log_t)
    if d.kind == "mixed":
        w = d.mixed_weight
        if w in (0.0, 1.0):  # one KL only: 0 · inf would be NaN
            return _kl(log_t, log_s) if w == 1.0 else _kl(log_s, log_t)
        return w * _kl(log_t, log_s) + (1.0 - w) * _kl(log_s, log_t)
    if d.kind == "jsd":
        if d.beta in (0.0, 1.0):  # the endpoints are the KLs, by definition (as TRL's)
            return _kl(log_t, log_s) if d.beta == 0.0 else _kl(log_s, log_t)
        log_m = _log_mixture(log_t, log_s, d.beta)
        return d.beta * _kl(log_t, log_m) + (1.0 - d.beta) * _kl(log_s, log_m)
    if d.kind == "skew_forward":
        return _kl(log_t, log_s if d.skew == 0.0 else _log_mixture(log_t, log_s, d.skew))
    # skew_reverse: KL(s ‖ (1 − λ)·t + λ·s)
    return _kl(log_s, log_t if d.skew == 0.0 else _log_mixture(log_s, log_t, d.skew))
