"""The held-out questions of a compression run and how an answer is scored.

    questions = load_questions("examples/data/short_answers_eval.jsonl")
    task_score(q.task, "Paris. It is also ...", q.reference)   # 1.0 for reference "Paris"

A question file holds one JSON object a line with ``prompt``, ``reference`` and ``task``
(``examples/data/make_short_answers.py`` writes them). The score reads only an answer's first
sentence, so it never rewards an answer for rambling on until it happens to say the reference.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_gndpo.errors import DataError, MissingFileError
from megatron_gndpo.rewards.short_answer import first_sentence, short_answer_reward, words

__all__ = ["Question", "first_sentence", "load_questions", "same_answer", "task_score", "words"]

FIELDS = ("prompt", "reference", "task")
# The task whose answer is the reference itself (the question asks to repeat a sentence).
REPEAT = "repeat"


@dataclasses.dataclass(frozen=True)
class Question:
    prompt: str
    reference: str
    task: str


def load_questions(path: str | Path, *, option: str = "--eval") -> list[Question]:
    """The ``{"prompt", "reference", "task"}`` lines of ``path`` (blank lines aside); a missing
    file or a malformed line is an error naming ``option`` and the line."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(
            f"{option} {path}: no such file; name a .jsonl file of held-out questions, one "
            '{"prompt", "reference", "task"} object a line (e.g. '
            "examples/data/short_answers_eval.jsonl)"
        )
    questions = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{option} {path}, line {number}: not JSON ({err.msg})") from None
            missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
            if missing:
                raise DataError(
                    f"{option} {path}, line {number}: no {', '.join(missing)} field; each line "
                    f"needs {', '.join(FIELDS)}"
                )
            questions.append(Question(*(str(record[k]) for k in FIELDS)))
    if not questions:
        raise DataError(f"{option} {path} holds no questions; it needs at least one line")
    return questions


def task_score(task: str, response: str, reference: str) -> float:
    """1.0 when ``response`` answers the question: the sentence itself for ``repeat`` (case and
    punctuation aside), otherwise the reference as a whole word or phrase in its first sentence
    (so an answer that rambles on until it happens to say the reference scores nothing); the
    trainer's reward with ``data.answer_match=first_sentence`` (rewards/short_answer.py)."""
    return short_answer_reward(response, reference, whole=task == REPEAT)


def same_answer(a: str, b: str) -> bool:
    """The two answers are the same, case, punctuation and spacing aside."""
    return words(a) == words(b)
