"""Built-in reasoning task: short chains "a + b - c" computed step by step.

    prompt:    "4 + 9 - 7 + 3 = ?"
    solution:  "4 + 9 = 13, 13 - 7 = 6, 6 + 3 = 9, so \\boxed{9}"
    answer:    "9"

The worked solution states one running total per operation, so a model that writes it out only
ever does one single-digit addition or subtraction at a time; answering in one jump needs the
whole chain in one forward pass, which a tiny model cannot do. ``difficulty`` is the number of
operations (operands are digits 0..9), so each level adds one step to the chain. A subtraction
that would go below zero becomes an addition, so every number is a non-negative integer and the
answers spread evenly (at difficulty 3 over 0..36, none more frequent than 6%: a constant guess
scores little). Drawing the subtrahend from ``0..total`` instead would make 0 the answer of 15%.

Deterministic from ``(n, seed, difficulty)``: Python's ``random.Random`` with an integer seed
gives the same stream on every platform and Python version. Every number, operator and ``=`` is
a word of its own, so a tokenizer trained on the task (``megatron_gndpo.demo.tokenizer``) gives
each number one token: a worked solution is ``6 * difficulty + 5`` tokens (23 at the default
difficulty 3), short enough for a tiny model.
"""

from __future__ import annotations

import dataclasses
import random

from megatron_gndpo.data.tasks.request import check_request

# More steps than this stop fitting a tiny model's context comfortably.
MAX_DIFFICULTY = 6
DEFAULT_DIFFICULTY = 3

# Built-in prompt sets (builtin:chains, builtin:chains_eval): the held-out set is drawn from
# its own seed and never contains a training prompt.
TRAIN_SEED = 0
EVAL_SEED = 1
TRAIN_SIZE = 512
EVAL_SIZE = 128

_OPERATORS = ("+", "-")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One chain: the question, its worked solution (ending in ``\\boxed{answer}``), the answer."""

    prompt: str
    solution: str
    answer: str


def generate(n: int, seed: int = 0, difficulty: int = DEFAULT_DIFFICULTY) -> list[Problem]:
    """``n`` chains of ``difficulty`` operations on digits, with worked solutions."""
    check_request(
        "chains", n, difficulty, MAX_DIFFICULTY, f"the number of operations, 1..{MAX_DIFFICULTY}"
    )
    rng = random.Random(seed)
    return [_problem(rng, difficulty) for _ in range(n)]


def _problem(rng: random.Random, steps: int) -> Problem:
    total = rng.randint(0, 9)
    question = [str(total)]
    worked = []
    for _ in range(steps):
        op, operand = rng.choice(_OPERATORS), rng.randint(0, 9)
        if op == "-" and operand > total:
            op = "+"
        after = total + operand if op == "+" else total - operand
        question.append(f"{op} {operand}")
        worked.append(f"{total} {op} {operand} = {after}")
        total = after
    return Problem(
        prompt=" ".join(question) + " = ?",
        solution=", ".join(worked) + f", so \\boxed{{{total}}}",
        answer=str(total),
    )


def held_out(
    n: int, seed: int, difficulty: int, exclude: set[str] | frozenset[str]
) -> list[Problem]:
    """``n`` distinct problems drawn from ``seed`` whose prompts are not in ``exclude``."""
    out: list[Problem] = []
    seen = set(exclude)
    draw = 4 * n  # ample: collisions are rare at difficulty >= 2
    for problem in generate(draw, seed, difficulty):
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
            if len(out) == n:
                return out
    raise ValueError(
        f"only {len(out)} of {n} distinct held-out chains at difficulty {difficulty} (the task "
        "has too few distinct problems at this level); ask for fewer or raise the difficulty"
    )


def split(name: str, difficulty: int = DEFAULT_DIFFICULTY) -> list[Problem]:
    """The built-in sets: ``"train"`` (TRAIN_SIZE problems) or ``"eval"`` (EVAL_SIZE, held out)."""
    train = generate(TRAIN_SIZE, TRAIN_SEED, difficulty)
    if name == "train":
        return train
    if name == "eval":
        return held_out(EVAL_SIZE, EVAL_SEED, difficulty, {p.prompt for p in train})
    raise ValueError(f"unknown chains split {name!r}; use 'train' or 'eval'")


def prompt_examples(split_name: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` pairs of a built-in split, the form ``BUILTIN_DATASETS`` returns."""
    return [(p.prompt, p.answer) for p in split(split_name)]
