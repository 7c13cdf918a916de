"""The tokenizers against the models: what each teacher's must be, and the top-k that fit.

Run at start-up by the composition root (``components.py``) before any model is built: a
teacher whose tokenizer differs from the student's, a vocabulary its model cannot score, or a
top-k larger than the scored ids (``data/vocab.py``) fail here with the fix.
"""

from __future__ import annotations

from megatron_gndpo.config import Config, ConfigError
from megatron_gndpo.config.schema import teacher_sections
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.methods import build_method


def check_top_k(cfg: Config, vocab: int) -> None:
    """Every configured top-k fits in the ids the models score (the tokenizer's)."""
    used = build_method(cfg.algorithm).top_ks()
    too_big = [f"algorithm.{key}={k}" for key, k in used.items() if k > vocab]
    if too_big:
        raise ConfigError(
            f"{', '.join(too_big)} exceeds the {vocab} token ids the models score (the "
            "tokenizer's vocabulary); lower it"
        )


def check_same_tokenizer(
    student: Tokenizer, teacher: Tokenizer, cfg: Config, key: str = "teacher"
) -> None:
    if student.fingerprint() != teacher.fingerprint():
        section = dict(teacher_sections(cfg)).get(key, cfg.teacher)
        raise ConfigError(
            f"{key}.tokenizer ({section.tokenizer}) differs from the student's "
            f"({cfg.data.tokenizer or 'builtin:char'}): the teacher scores the student's token "
            f"ids, so both must share one vocabulary; set {key}.cross_tokenizer=true to score "
            "the student's text in the teacher's own tokens (gndpo, opd, mix; "
            "docs/methods/cross_tokenizer.md), or pick a teacher of the student's family"
        )


def check_teacher_tokenizer(
    cfg: Config, key: str, student: Tokenizer, own: Tokenizer, cross_tokenizer: bool
) -> None:
    """Teacher ``key``'s tokenizer ``own``: the student's unless it scores in its own
    (``cross_tokenizer``), in which case its model must score every id of it."""
    if not cross_tokenizer:
        check_same_tokenizer(student, own, cfg, key)
        return
    model = dict(teacher_sections(cfg))[key].model
    if model.vocab_size < own.vocab_size:
        raise ConfigError(
            f"{key}.model.vocab_size ({model.vocab_size}) is smaller than its "
            f"tokenizer's vocabulary ({own.vocab_size}, {key}.tokenizer): it cannot score "
            "every token id; use a model built for this tokenizer"
        )
