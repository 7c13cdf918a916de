"""Teacher guidance beside the policy gradient: TGPO's guidance token, TrOPD's trust region,
forward-KL imitation, and the schedules of their coefficients.

Shape legend: ``B`` = sequences on this rank, ``T`` = positions, ``K`` = candidate token ids per
position. ``lt`` = teacher log-prob, ``ls`` = student log-prob (``lo`` at the rollout weights),
``m`` = response mask. All per-token quantities here are losses or advantages *before*
aggregation; ``aggregation.py`` turns them into a global mean.

One per-token loss covers every method (``engine/update.py`` assembles it)::

    L_t = g_t · PG_t(A_t)  +  λ · d_t · Σ_k q_tk (log q_tk − ls(v_tk))  −  β · H_t(π_θ)

``PG`` is the clipped policy loss, ``g`` routes a token to the policy gradient, ``d`` to the
distillation term, whose target distribution ``q`` is given on ``K`` ids ``v``: the teacher's
top-k (forward KL, unnormalised as the TrOPD formula writes it), or one guidance token with
``q = 1`` (then the term is the cross-entropy ``−ls(ŷ_t)``). ``H`` is the student's entropy.
The distillation term generalises to other divergences on the K ids with a tail bucket
(``divergences.py``, the ``topk_kd`` method); this forward KL is its default.

Sources (abstracts and released code; the papers were not available, so every unstated detail
here is our reading and a config option, see docs/methods/):
TGPO, arXiv 2605.13230; TrOPD, arXiv 2606.01249.
"""

from __future__ import annotations

import math

import torch

from megatron_gndpo.algorithms.stats import check_same_shape, masked_values

# How TrOPD treats an untrusted (outlier) token; see :func:`tropd_routing`.
TROPD_OUTLIERS = ("topk_kl", "mask", "clip")


def linear_decay(step: int, start: float, decay_per_step: float) -> float:
    """TGPO's coefficient at 1-based step ``k``: ``λ_k = max(λ_0 − (k − 1)·δ, 0)``."""
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    return max(start - (step - 1) * decay_per_step, 0.0)


def linear_schedule(step: int, start: float, end: float, steps: int) -> float:
    """``start`` at step 1 moving linearly to ``end`` at step ``steps + 1``, then ``end``."""
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    if steps <= 0:
        return end
    progress = min((step - 1) / steps, 1.0)
    return start + (end - start) * progress


def forward_kl_to_targets(
    student_logprobs_BTK: torch.Tensor, target_logprobs_BTK: torch.Tensor
) -> torch.Tensor:
    """``Σ_k q_k (log q_k − ls_k)`` per position, float32 ``[B, T]``; gradient through ``ls``.

    ``target_logprobs`` = log q on the same ``K`` ids as ``student_logprobs`` (e.g. the
    teacher's top-k, not renormalised; or one guidance token with log q = 0, which makes the
    term the cross-entropy ``−ls``). Entries with q = 0 (log q = −inf) contribute 0.
    """
    check_same_shape(student=student_logprobs_BTK, target=target_logprobs_BTK)
    log_q = target_logprobs_BTK.detach().float()
    q = log_q.exp()
    # where() before the product: 0 · (−inf) would be NaN in the value and in the gradient.
    diff = torch.where(q > 0, log_q - student_logprobs_BTK.float(), 0.0)
    return (q * diff).sum(-1)


def trusted_tokens(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, threshold: float = 1.0
) -> torch.Tensor:
    """TrOPD's trust region: ``π_T(y_t) ≥ threshold · π_S(y_t)``, bool ``[B, T]``.

    The trust score is ``w_t = min(π_T(y_t)/π_S(y_t), 1)``; with the default threshold 1 a
    token is trusted exactly when ``w_t = 1`` (the teacher likes the token at least as much as
    the student does). The paper's threshold rule is not public: this default is our reading.
    """
    check_same_shape(teacher=teacher_logprobs, student=student_logprobs)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"the trust threshold must be in (0, 1], got {threshold}")
    log_w = teacher_logprobs.detach().float() - student_logprobs.detach().float()
    return log_w >= math.log(threshold)


def tropd_routing(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float,
    threshold: float = 1.0,
    outlier: str = "topk_kl",
    outlier_clip: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TrOPD per token: ``(advantages, pg_mask, kl_mask)``, float32 ``[B, T]`` each.

    Trusted tokens (:func:`trusted_tokens`) take the OPD advantage ``clamp(lt − lo, ±C)`` in
    the policy gradient. Outliers, by ``outlier``:

    - ``topk_kl``: leave the policy gradient; forward KL over the teacher's top-k instead;
    - ``mask``: leave the loss altogether (they still count in the aggregation's denominator);
    - ``clip``: stay in the policy gradient with the advantage bounded below by
      ``−outlier_clip`` (our reading of "gradient clipping": an outlier's push away from its
      token is limited; its score ``lt − lo`` is negative by definition at threshold 1).
    """
    check_same_shape(teacher=teacher_logprobs, old=old_logprobs, mask=response_mask)
    if outlier not in TROPD_OUTLIERS:
        raise ValueError(f"unknown TrOPD outlier rule {outlier!r}; one of {TROPD_OUTLIERS}")
    with torch.no_grad():
        mask = response_mask.float()
        score = (teacher_logprobs.float() - old_logprobs.float()).clamp(-kl_clip, kl_clip)
        trusted = trusted_tokens(teacher_logprobs, old_logprobs, threshold).float() * mask
        outliers = mask - trusted
        if outlier == "clip":
            bounded = torch.where(trusted > 0, score, score.clamp(min=-outlier_clip))
            return masked_values(bounded, mask), mask, torch.zeros_like(mask)
        advantages = masked_values(score, trusted)
        kl_mask = outliers if outlier == "topk_kl" else torch.zeros_like(mask)
        return advantages, trusted, kl_mask


def guidance_advantages(
    outcome_advantages: torch.Tensor,
    old_guidance_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coefficient: float,
) -> torch.Tensor:
    """TGPO's advantage-bonus variant: ``A_t = Â_i + λ · π_old(ŷ_t | s_t)``, float32 ``[B, T]``.

    ``old_guidance_logprobs``: the student's log-prob of the teacher's guidance token at the
    rollout weights.
    """
    check_same_shape(outcome=outcome_advantages, guidance=old_guidance_logprobs, mask=response_mask)
    with torch.no_grad():
        bonus = coefficient * old_guidance_logprobs.float().exp()
        return masked_values(outcome_advantages.float() + bonus, response_mask)
