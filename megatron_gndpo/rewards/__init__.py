"""Rewards computed from a response's text (verifiable answers), for outcome estimators and
evaluation."""

from megatron_gndpo.rewards.short_answer import short_answer_reward
from megatron_gndpo.rewards.verifiable import (
    answers_match,
    extract_answer,
    math_verify_available,
    normalize_answer,
    reward,
)

__all__ = [
    "answers_match",
    "extract_answer",
    "math_verify_available",
    "normalize_answer",
    "reward",
    "short_answer_reward",
]
