"""What every built-in task's ``generate(n, seed, difficulty)`` checks first."""

from __future__ import annotations


def check_request(task: str, n: int, difficulty: int, max_difficulty: int, levels: str) -> None:
    """A ValueError unless ``n >= 1`` and ``1 <= difficulty <= max_difficulty``; ``levels``
    says what the difficulty counts, with its range (the error quotes it)."""
    if n < 1:
        raise ValueError(f"{task}.generate needs n >= 1 problems, got {n}")
    if not 1 <= difficulty <= max_difficulty:
        raise ValueError(f"{task} difficulty is {levels}; got {difficulty}")
