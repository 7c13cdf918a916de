"""The per-span distillation score of a teacher with another tokenizer, on the student's tokens.

Shape legend: ``B`` = sequences on this rank; ``T`` = the student's padded row length, ``U`` =
the teacher's (its own tokens of the same responses). ``span_BT`` / ``span_BU`` give each token
the index of its span within its row (``-1``: in no kept span: prompt, padding, dropped spans);
``data/alignment.py`` says how spans are cut. For span ``j`` of row ``b`` with student tokens
``s_1..s_n`` and teacher tokens ``u_1..u_m`` (the same characters):

    T_j = Σ_k lt(u_k)          the teacher's log-prob of the span's text, at its own layout
    L_j = Σ_i lo(s_i)          the student's (at the rollout weights)
    D_j = T_j − L_j            the span's single-sample reverse-KL estimate (−k1)

Every student token of the span takes the span's whole score: ``d(s_i) = D_j``. The trainer's
methods compute ``lt − lo`` per student token, so the span is handed to them as an effective
teacher log-prob per student token,

    lt'(s_i) = T_j − (L_j − lo(s_i))       so that   lt'(s_i) − lo(s_i) = D_j,

and GNDPO, OPD and ``mix`` run unchanged on ``lt'`` (the clamp at ±C applies to ``D_j``).

Why the whole score on every token, not a share: a span is the smallest unit both models give
a probability to, so it is one action; ``D_j · ∇ log π(span) = Σ_i D_j ∇ log π(s_i)`` is the
policy gradient of that action. In expectation token ``s_i`` then receives its own per-token
score plus the reverse KL of the rest of its span (the reward-to-go, cut at the span's end):
between OPD's discount 0 and the sequence's full return. When teacher and student agree on the
span (``D_j = 0``) no token moves, which a uniform share ``T_j/n − lo(s_i)`` would break (it
pushes the span's tokens towards equal log-probs); putting ``D_j`` on the last token alone would
leave the first token of a multi-token number without any signal. A 1:1 span (n = m = 1) gives
``lt' = lt`` exactly (``L_j − lo = 0`` in floating point), the same-tokenizer score.

Sums are in float64 and the result is rounded to float32 once. Pure tensor math: no config, no
global state; the metrics' collectives go through the ``group`` argument (the student's
data-parallel × context-parallel group; ``None``: the batch is all local).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.stats import check_same_shape, global_sum


def span_sums(values_BX: torch.Tensor, span_BX: torch.Tensor, num_spans: int) -> torch.Tensor:
    """float64 ``[B, J]``: the sum of ``values`` over each span's tokens (J = ``num_spans``);
    tokens with span ``-1`` count nowhere (and may hold anything, inf or NaN included)."""
    check_same_shape(values=values_BX, span=span_BX)
    inside = span_BX >= 0
    values = torch.where(inside, values_BX.detach().double(), 0.0)
    index = torch.where(inside, span_BX, num_spans).long()  # a spare column for the rest
    out = values.new_zeros(values.shape[0], num_spans + 1)
    out.scatter_add_(1, index, values)
    return out[:, :num_spans]


def _num_spans(*spans: torch.Tensor) -> int:
    return int(max(int(s.max()) if s.numel() else -1 for s in spans)) + 1


def span_teacher_logprobs(
    teacher_logprobs_BU: torch.Tensor,
    teacher_span_BU: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    student_span_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lt' = T_j − (L_j − lo)`` on every student token of a kept span (module docstring),
    float32 ``[B, T]``, 0 elsewhere; and ``[B, T]`` bool, the tokens that have one.

    teacher_logprobs_BU: the teacher's log-probs of its own tokens; teacher_span_BU,
    student_span_BT: int64 span indices (``-1``: none); old_logprobs_BT: lo. Detached.
    """
    check_same_shape(old_logprobs=old_logprobs_BT, student_span=student_span_BT)
    with torch.no_grad():
        # at least one (empty) column: a batch without any kept span (every response a token
        # long, say) still gathers column 0 for the tokens it then leaves unscored
        j = max(_num_spans(teacher_span_BU, student_span_BT), 1)
        t_BJ = span_sums(teacher_logprobs_BU, teacher_span_BU, j)
        l_BJ = span_sums(old_logprobs_BT, student_span_BT, j)
        scored_BT = student_span_BT >= 0
        at = torch.where(scored_BT, student_span_BT, 0).long()
        lo = old_logprobs_BT.detach().double()
        # L_j − lo is exactly 0 for a one-token span, so lt' = T_j = lt there
        rest_BT = torch.gather(l_BJ, 1, at) - lo
        lt_BT = torch.gather(t_BJ, 1, at) - rest_BT
        return torch.where(scored_BT, lt_BT, 0.0).float(), scored_BT


def alignment_metrics(
    teacher_logprobs_BU: torch.Tensor,
    teacher_span_BU: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    student_span_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    counts: dict[str, float],
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """How well the two tokenizations met, over the whole step (global over ``group``).

    ``xtok/aligned_frac``: share of student response tokens in a kept span (``/aligned_tokens``:
    how many: the tokens the step can train on);
    ``xtok/one_to_one_frac``: share in a 1:1 span (there the score is the same-tokenizer one);
    ``xtok/span_max_student``, ``/span_max_teacher``: the longest span's tokens on each side;
    ``xtok/span_kl``: mean over kept spans of ``L_j − T_j`` (the per-span reverse KL, k1);
    ``xtok/kl_per_token``: ``Σ_j (L_j − T_j)`` per aligned student token; and each entry of
    ``counts`` (local sums from building the teacher's rows: ``spans_dropped``,
    ``teacher_tokens``, ...) summed over the group, under ``xtok/``; ``teacher_tokens`` is
    reported per student response token (``xtok/teacher_tokens_per_student``).
    Every rank of ``group`` calls it (two all-reduces).
    """
    with torch.no_grad():
        j = _num_spans(teacher_span_BU, student_span_BT)
        t_BJ = span_sums(teacher_logprobs_BU, teacher_span_BU, j)
        l_BJ = span_sums(old_logprobs_BT, student_span_BT, j)
        n_BJ = span_sums(torch.ones_like(old_logprobs_BT), student_span_BT, j)
        m_BJ = span_sums(torch.ones_like(teacher_logprobs_BU), teacher_span_BU, j)
        kept_BJ = n_BJ > 0
        one_BJ = (n_BJ == 1) & (m_BJ == 1)
        names = sorted(counts)
        local = torch.stack([
            response_mask_BT.double().sum(),
            n_BJ.sum(),
            torch.where(one_BJ, n_BJ, 0.0).sum(),
            kept_BJ.double().sum(),
            torch.where(kept_BJ, l_BJ - t_BJ, 0.0).sum(),
            *[torch.tensor(float(counts[k]), dtype=torch.float64) for k in names],
        ])  # fmt: skip
        total = global_sum(local, group)
        longest = torch.stack([n_BJ.max() if j else n_BJ.new_zeros(()),
                               m_BJ.max() if j else m_BJ.new_zeros(())])  # fmt: skip
        if group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    response, aligned, one, spans, kl = (float(x) for x in total[:5])
    out = {
        "xtok/aligned_frac": aligned / max(response, 1.0),
        "xtok/aligned_tokens": aligned,
        "xtok/one_to_one_frac": one / max(response, 1.0),
        "xtok/span_max_student": float(longest[0]),
        "xtok/span_max_teacher": float(longest[1]),
        "xtok/span_kl": kl / max(spans, 1.0),
        "xtok/kl_per_token": kl / max(aligned, 1.0),
    }
    for name, value in zip(names, total[5:].tolist(), strict=True):
        if name == "teacher_tokens":
            out["xtok/teacher_tokens_per_student"] = value / max(response, 1.0)
        else:
            out[f"xtok/{name}"] = value
    return out
