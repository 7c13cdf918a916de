"""Built-in arithmetic prompts: "What is 23 + 58?" -> "81".

Deterministic from ``(n, seed, difficulty)`` (Python's ``random.Random`` with an integer seed
gives the same stream on every platform and Python version), so the tiny CPU example and the
tests need no data file. Kept deliberately simple; richer reasoning tasks live beside it in
``data/tasks/``.
"""

from __future__ import annotations

import dataclasses
import random

from megatron_gndpo.data.tasks.request import check_request

# Operators drawn at each difficulty; subtraction can give negative answers, which exercises the
# reward's number parsing.
_OPERATORS = ("+", "-")

# Above this the numbers stop fitting comfortably in a tiny model's context (and the tokenizer's
# single-character vocabulary makes every digit one token).
MAX_DIFFICULTY = 6


@dataclasses.dataclass(frozen=True)
class Problem:
    """One arithmetic question and its exact answer (an integer, as text)."""

    prompt: str
    answer: str


def generate(n: int, seed: int = 0, difficulty: int = 2) -> list[Problem]:
    """``n`` problems ``"What is a OP b?"`` with operands of up to ``difficulty`` digits.

    ``difficulty`` is the number of decimal digits of each operand (1..MAX_DIFFICULTY);
    ``OP`` is ``+`` or ``-``.
    """
    check_request(
        "arithmetic", n, difficulty, MAX_DIFFICULTY,
        f"the number of digits per operand, 1..{MAX_DIFFICULTY}",
    )  # fmt: skip
    rng = random.Random(seed)
    high = 10**difficulty - 1
    return [_problem(rng, high) for _ in range(n)]


def _problem(rng: random.Random, high: int) -> Problem:
    a = rng.randint(0, high)
    b = rng.randint(0, high)
    op = rng.choice(_OPERATORS)
    value = a + b if op == "+" else a - b
    return Problem(prompt=f"What is {a} {op} {b}?", answer=str(value))
