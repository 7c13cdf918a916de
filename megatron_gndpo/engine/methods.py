"""What each method needs from the two scoring passes and what it hands to the update.

Every method runs the same step; they differ in what the teacher and the student score besides
the sampled tokens' log-probs, and in what the update receives per token:

    method        scores first  teacher also scores            student also scores (no grad)
    gndpo/opd/…   teacher       -                              entropy (a metric)
    vopd (top-k)  student       log-probs of the student's     its top-k ids and log-probs
                                top-k ids
    vopd (full)   student       KL(student ‖ teacher) from     its final hidden states
                                the student's hidden states    (same layout: same ranks)
    tgpo          teacher       its top-1 (greedy), a sampled  guidance=advantage: log-prob of
                                token, or its top-k            the teacher's token
    tropd         teacher       its top-k (outliers, prefix)   -

:class:`Targets` is the update's per-token input (``engine/update.py`` forms the loss
``g·PG(A) + λ·d·Σ_k q (log q − ls) − β·H``, see ``algorithms/guidance.py``). Tensors are
``[n, S]`` / ``[n, S, K]`` in the scoring convention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_gndpo.algorithms import advantages as adv
from megatron_gndpo.algorithms import guidance
from megatron_gndpo.algorithms.stats import global_sum
from megatron_gndpo.config.schema import AlgorithmConfig
from megatron_gndpo.engine.advantages import compute_advantages
from megatron_gndpo.engine.scoring import ScoreRequest

Scores = dict[str, torch.Tensor]


@dataclasses.dataclass
class Targets:
    """Per-token inputs of the update beyond the tokens and the old log-probs."""

    advantages: torch.Tensor  # [n, S] float32
    pg_mask: torch.Tensor | None = None  # [n, S]: tokens in the policy gradient (None: all)
    aux_ids: torch.Tensor | None = None  # [n, S, K] int64: ids of the distillation target q
    aux_logq: torch.Tensor | None = None  # [n, S, K] float32: log q on those ids
    aux_mask: torch.Tensor | None = None  # [n, S]: tokens with the distillation term
    aux_coef: float = 0.0  # λ
    entropy_coef: float = 0.0  # β


def prefix_share(cfg: AlgorithmConfig, step: int) -> float:
    """TrOPD's off-policy guidance at 1-based ``step``: the share of the teacher's response kept
    as the prefix the student continues from (0: ordinary on-policy rollouts)."""
    if cfg.estimator != "tropd" or cfg.tropd.prefix_share_start <= 0:
        return 0.0
    t = cfg.tropd
    return guidance.linear_schedule(
        step, t.prefix_share_start, t.prefix_share_end, t.prefix_decay_steps
    )


def student_scores_first(cfg: AlgorithmConfig) -> bool:
    """vOPD's teacher scores the student's top-k ids, so the student goes first."""
    return _uses_vopd(cfg)


def _uses_vopd(cfg: AlgorithmConfig) -> bool:
    return cfg.estimator == "vopd" or (cfg.estimator == "mix" and cfg.distill_estimator == "vopd")


def teacher_request(
    cfg: AlgorithmConfig, student: Scores | None, seed: int = 0
) -> ScoreRequest | None:
    """What the teacher scores besides the sampled tokens (``student``: when it went first;
    ``seed``: of TGPO's sampled teacher tokens, one per step and data-parallel rank)."""
    if _uses_vopd(cfg):
        assert student is not None, "vopd scores the student first"
        if cfg.vopd_top_k == 0:  # full vocabulary: the student's hidden states meet the teacher's
            return ScoreRequest(full_kl=True, kl_hidden=student.get("hidden"))
        return ScoreRequest(extra_ids=student["topk_ids"])
    if cfg.estimator == "tgpo" and cfg.tgpo.teacher_token == "sampled":
        return ScoreRequest(sample_seed=seed)
    if cfg.estimator == "tgpo":
        return ScoreRequest(top_k=1 if cfg.tgpo.teacher_token == "greedy" else cfg.tgpo.top_k)
    if cfg.estimator == "tropd" and (
        cfg.tropd.outlier == "topk_kl" or cfg.tropd.prefix_share_start > 0
    ):
        return ScoreRequest(top_k=cfg.tropd.top_k)
    return None


def student_request(cfg: AlgorithmConfig, teacher: Scores | None) -> ScoreRequest:
    """What the student's old-log-prob pass scores (``teacher``: when it went first)."""
    if _uses_vopd(cfg) and cfg.vopd_top_k == 0:
        return ScoreRequest(hidden=True, entropy=True)
    if _uses_vopd(cfg):
        return ScoreRequest(top_k=cfg.vopd_top_k, entropy=True)
    if cfg.estimator == "tgpo" and cfg.tgpo.guidance == "advantage":
        assert teacher is not None, "tgpo scores the teacher first"
        return ScoreRequest(extra_ids=guidance_ids(teacher), entropy=True)
    return ScoreRequest(entropy=True)


def guidance_ids(teacher: Scores) -> torch.Tensor:
    """TGPO's teacher token(s) per position, ``[n, S, K]``: sampled, greedy (K = 1) or top-k."""
    if "sampled_ids" in teacher:
        return teacher["sampled_ids"].unsqueeze(-1)
    return teacher["topk_ids"]


def build_targets(
    cfg: AlgorithmConfig,
    *,
    teacher: Scores,
    student: Scores,
    response_mask: torch.Tensor,
    rewards: torch.Tensor | None,
    group_size: int,
    group: Any,
    step: int,
    tokens: torch.Tensor | None = None,
    teacher_written: torch.Tensor | None = None,
) -> tuple[Targets, dict[str, float]]:
    """The update's :class:`Targets` for ``cfg.estimator`` at 1-based ``step``, with metrics.

    ``tokens [n, S]``: the sampled tokens (for TGPO's agreement metric). ``teacher_written
    [n, S]``: tokens the teacher wrote (TrOPD's off-policy prefix); they get the distillation
    term instead of the policy gradient. Metrics are global means over ``group``.
    """
    mask = response_mask
    lt, lo = teacher["logprobs"], student["logprobs"]
    beta = cfg.entropy_bonus
    if cfg.estimator == "tgpo":
        return _tgpo_targets(
            cfg, teacher, student, mask, rewards, group_size, group, step, beta, tokens
        )
    if cfg.estimator == "tropd":
        return _tropd_targets(cfg, teacher, student, mask, group, teacher_written, beta)
    token_kl = None
    if _uses_vopd(cfg) and cfg.vopd_top_k == 0:
        token_kl = teacher["kl"]
    elif _uses_vopd(cfg):
        token_kl = adv.token_kl_topk(student["topk_logprobs"], teacher["extra_logprobs"])
    advantages = compute_advantages(
        cfg, teacher_logprobs=lt, old_logprobs=lo, response_mask=mask, rewards=rewards,
        group_size=group_size, group=group, token_kl=token_kl,
    )  # fmt: skip
    metrics = {}
    if token_kl is not None:
        metrics["vopd/kl_mean"] = _global_mean(token_kl, mask, group)
    return Targets(advantages, entropy_coef=beta), metrics


def _tgpo_targets(
    cfg: AlgorithmConfig, teacher: Scores, student: Scores, mask: torch.Tensor,
    rewards: torch.Tensor | None, group_size: int, group: Any, step: int, beta: float,
    tokens: torch.Tensor | None,
) -> tuple[Targets, dict[str, float]]:  # fmt: skip
    t = cfg.tgpo
    if rewards is None:
        raise ValueError(
            "estimator tgpo needs a verifiable reward: the prompts have no answers "
            "(data.answer_key)"
        )
    outcome = adv.grpo_advantages(rewards, mask.float(), group_size=group_size)
    coef = guidance.linear_decay(step, t.coef_start, t.coef_decay)
    ids = guidance_ids(teacher)
    metrics = {"guidance/coef": coef}
    if tokens is not None:  # how often the student sampled the teacher's first choice
        agree = (ids[..., 0] == tokens).float()
        metrics["guidance/agree_frac"] = _global_mean(agree, mask, group)
    if t.guidance == "advantage":
        advantages = guidance.guidance_advantages(
            outcome, student["extra_logprobs"][..., 0], mask, coef
        )
        return Targets(advantages, entropy_coef=beta), metrics
    # greedy or sampled: one token with q = 1 (log q = 0): the term is the cross-entropy −ls(ŷ)
    logq = (
        teacher["topk_logprobs"]
        if t.teacher_token == "topk"
        else torch.zeros_like(ids, dtype=torch.float32)
    )
    targets = Targets(
        outcome, aux_ids=ids, aux_logq=logq, aux_mask=mask.float(), aux_coef=coef,
        entropy_coef=beta,
    )  # fmt: skip
    return targets, metrics


def _tropd_targets(
    cfg: AlgorithmConfig, teacher: Scores, student: Scores, mask: torch.Tensor, group: Any,
    teacher_written: torch.Tensor | None, beta: float,
) -> tuple[Targets, dict[str, float]]:  # fmt: skip
    t = cfg.tropd
    on_policy = mask.float()
    if teacher_written is not None:
        on_policy = on_policy * (1.0 - teacher_written.float())
    advantages, pg_mask, kl_mask = guidance.tropd_routing(
        teacher["logprobs"], student["logprobs"], on_policy, kl_clip=cfg.kl_clip,
        threshold=t.trust_threshold, outlier=t.outlier, outlier_clip=t.outlier_clip,
    )  # fmt: skip
    if teacher_written is not None:
        kl_mask = kl_mask + teacher_written.float() * mask.float()
    trusted = guidance.trusted_tokens(teacher["logprobs"], student["logprobs"], t.trust_threshold)
    metrics = {"tropd/trusted_frac": _global_mean(trusted.float(), on_policy, group)}
    if "topk_ids" not in teacher:  # outlier rule mask or clip, no prefix: no KL term
        return Targets(advantages, pg_mask=pg_mask, entropy_coef=beta), metrics
    targets = Targets(
        advantages, pg_mask=pg_mask, aux_ids=teacher["topk_ids"],
        aux_logq=teacher["topk_logprobs"], aux_mask=kl_mask, aux_coef=t.kl_coef,
        entropy_coef=beta,
    )  # fmt: skip
    return targets, metrics


def _global_mean(values: torch.Tensor, mask: torch.Tensor, group: Any) -> float:
    """Mean of ``values`` over the masked tokens of every rank of ``group`` (one all-reduce)."""
    m = mask.float()
    sums = global_sum(torch.stack([(values.float() * m).sum(), m.sum()]), group)
    return float(sums[0] / sums[1].clamp(min=1.0))
