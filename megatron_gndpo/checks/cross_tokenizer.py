"""Rules of cross-tokenizer teachers (``teacher.cross_tokenizer``), each reported with the fix.

A teacher with its own tokenizer scores the student's response text in its own tokens, so all it
can give is each aligned span's log-prob (docs/methods/cross_tokenizer.md). What needs more (its
distribution over the student's vocabulary: top-k ids, their log-probs, a full-vocabulary KL;
its own written tokens as the student's prefix), a served teacher (which scores the student's
ids) and image placeholders (tokens of each tokenizer's own) are refused here, before anything
is built. Called by :func:`~megatron_gndpo.checks.rules.validate`.
"""

from __future__ import annotations

from typing import Any

from megatron_gndpo.config.schema import Config, teacher_sections

_FIX = (
    "use algorithm.estimator gndpo, opd, grpo, reinforce_pp or mix (distill_estimator gndpo "
    "or opd), or a teacher of the student's tokenizer ({key}.cross_tokenizer=false)"
)


def _method_need(method: Any) -> str:
    """What ``method`` asks of the teacher beyond the sampled text's log-probs ('' if nothing:
    the method declares ``scores_spans``)."""
    if method.scores_spans:
        return ""
    if method.teacher_samples:
        return "teacher-written prefixes (tropd.prefix_*), written in the teacher's tokens"
    if method.student_first:
        return "the teacher's log-probs of the student's top-k ids or a full-vocabulary KL"
    return "the teacher's own top-k ids and log-probs, in the student's vocabulary"


def cross_tokenizer_problems(cfg: Config, method: Any) -> list[str]:
    """Every cross-tokenizer teacher's problems; ``method``: the configured one (None when the
    estimator is unknown, which is reported elsewhere)."""
    p: list[str] = []
    for key, t in teacher_sections(cfg):
        if not t.cross_tokenizer:
            continue
        need = "" if method is None else _method_need(method)
        if need:
            p.append(
                f"{key}.cross_tokenizer with algorithm.estimator={cfg.algorithm.estimator}: it "
                f"needs {need}, which a teacher with another tokenizer cannot give; "
                + _FIX.format(key=key)
            )
        if t.server is not None:
            p.append(
                f"{key}.cross_tokenizer with {key}.server: a served teacher scores the student's "
                f"token ids; colocate the teacher (remove {key}.server, set {key}.load) to score "
                "in its own tokenizer, or serve a teacher of the student's tokenizer"
            )
        if t.model.vision is not None or cfg.model.vision is not None:
            p.append(
                f"{key}.cross_tokenizer with a vision-language model: image placeholders are "
                f"tokens of each tokenizer's own; use a teacher of the student's tokenizer "
                f"({key}.cross_tokenizer=false)"
            )
    return p
