"""The token ids a run scores: the tokenizer's, checked against every model that scores them.

Both models' distributions are restricted to these ids (the rest of a padded vocabulary takes no
probability mass); the trainer and the rollout ranks read them the same way.
"""

from __future__ import annotations

from megatron_gndpo.config import Config, ConfigError
from megatron_gndpo.config.schema import teacher_sections
from megatron_gndpo.data.tokenizer import Tokenizer


def scoring_vocab(cfg: Config, tokenizer: Tokenizer) -> int:
    """The ids both models' distributions are restricted to; checked against both models."""
    vocab = cfg.data.vocab_size if cfg.data.vocab_size is not None else tokenizer.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer produces {tokenizer.vocab_size} ids but data.vocab_size is {vocab}; "
            "raise data.vocab_size or leave it null"
        )
    models = [("model", cfg.model)]
    # a teacher with its own tokenizer is checked against it (checks/vocab.py)
    sections = [(key, t) for key, t in teacher_sections(cfg) if not t.cross_tokenizer]
    models += [(f"{key}.model", t.model) for key, t in sections]
    for name, model in models:
        if model.vocab_size < vocab:
            raise ConfigError(
                f"{name}.vocab_size ({model.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({vocab}): it cannot score every token id; use a model built for "
                "this tokenizer"
            )
    return vocab
