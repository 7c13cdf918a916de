"""Rules of a teacher with its own prompt (``teacher.context``) or the student's own weights
(``teacher.weights``), each reported with the fix. Called by
:func:`~megatron_gndpo.checks.rules.validate`, before anything is built.
"""

from __future__ import annotations

from typing import Any

from megatron_gndpo.config.schema import Config, TeacherContextConfig, teacher_sections


def context_problems(cfg: Config, method: Any) -> list[str]:
    """Every teacher's context and weights problems; ``method``: the configured one (None when
    the estimator is unknown, which is reported elsewhere)."""
    p: list[str] = []
    for key, t in teacher_sections(cfg):
        if t.context is not None:
            p += _template_problems(key, t.context)
            if method is not None and not method.scores_spans:
                p.append(
                    f"{key}.context with algorithm.estimator={cfg.algorithm.estimator}: the "
                    "teacher scores the response after its own prompt, which gives each sampled "
                    "token's log-prob only; use algorithm.estimator gndpo, opd, grpo, "
                    f"reinforce_pp or mix (distill_estimator gndpo or opd), or remove {key}.context"
                )
            if t.model.vision is not None or cfg.model.vision is not None:
                p.append(
                    f"{key}.context with a vision-language model: the teacher's prompt would "
                    f"need its images placed again; remove {key}.context"
                )
        if t.weights != "load":
            p += _weights_problems(cfg, key, t)
        if not 0.0 <= t.ema_decay < 1.0:
            p.append(f"{key}.ema_decay must be in [0, 1), got {t.ema_decay}")
    return p


def _template_problems(key: str, context: TeacherContextConfig) -> list[str]:
    try:
        context.fields()
    except ValueError as err:
        return [
            f"{key}.context: {err} (the template is a Python format string over the data "
            "row's fields; write literal braces as {{ and }})"
        ]
    return []


def _weights_problems(cfg: Config, key: str, t: Any) -> list[str]:
    p, weights = [], f"{key}.weights={t.weights}"
    given = [
        name
        for name, value in (
            ("load", t.load), ("server", t.server), ("tokenizer", t.tokenizer),
            ("cross_tokenizer", t.cross_tokenizer or None),
        )
        if value is not None
    ]  # fmt: skip
    if given:
        p.append(
            f"{weights} makes the teacher the student's own model, which "
            f"{', '.join(f'{key}.{g}' for g in given)} would replace; remove "
            f"{'it' if len(given) == 1 else 'them'}, or set {key}.weights=load for a teacher of "
            "its own"
        )
    if cfg.model.vision is not None:
        p.append(f"{weights}: a vision-language student; use a teacher of its own (load)")
    same = _layout(t.parallel) == _layout(cfg.parallel)
    if t.weights in ("live", "ema") and not same:
        p.append(
            f"{weights} holds the student's own shards, so {key}.parallel must equal parallel "
            f"(tensor, pipeline, context and expert parallel sizes); set {key}.parallel like it"
        )
    if t.weights == "initial" and not same and cfg.checkpoint.init is None:
        p.append(
            f"{weights} at a layout other than the student's loads checkpoint.init, which is "
            f"not set; set checkpoint.init, or {key}.parallel like parallel"
        )
    return p


def _layout(parallel: Any) -> tuple[int, int, int, int]:
    return (
        parallel.tensor_parallel,
        parallel.pipeline_parallel,
        parallel.context_parallel,
        parallel.expert_parallel,
    )
