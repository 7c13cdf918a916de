"""The SmolLM2 distillation study's data and scoring (benchmarks/real_distill.py): no model.

The committed prompt files are what ``examples/data/make_short_answers.py`` writes, held-out
questions never appear in training, and the task score reads answers as the study reports them.
The study itself runs the real model (benchmarks/results/real-distill-cpu-2026-12-05.md).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.real_distill import EVAL_DATA, load_questions, task_score, words

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


def _generator() -> Any:
    path = DATA / "make_short_answers.py"
    spec = importlib.util.spec_from_file_location("make_short_answers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_prompt_files_are_the_generators() -> None:
    make = _generator()
    train, held_out = make.split(make.records())
    for rows, part in ((train, "train"), (held_out, "eval")):
        name = f"short_answers_{part}.jsonl"
        committed = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        assert committed == rows, f"{name} is stale: run examples/data/make_short_answers.py"
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held_out)
    questions = load_questions(EVAL_DATA)
    assert len(questions) == 64
    assert {q.task for q in questions} == {"capital", "opposite", "plural", "repeat"}


@pytest.mark.parametrize(
    ("task", "response", "reference", "right"),
    [
        ("capital", "The capital of France is Paris.", "Paris", 1.0),
        ("capital", "The capital of Mexico is Mexico City.", "Mexico City", 1.0),
        ("capital", "Mexico is a country.", "Mexico City", 0.0),
        ("opposite", 'The opposite of "hot" is "cold"', "cold", 1.0),
        ("opposite", 'The opposite of "hot" is "coldness"', "cold", 0.0),  # whole words only
        ("plural", "The plural of 'mouse' is mice", "mice", 1.0),
        ("repeat", "The cat sat on the mat", "The cat sat on the mat.", 1.0),
        ("repeat", "The cat sat on the mat today.", "The cat sat on the mat.", 0.0),
    ],
)
def test_task_score(task: str, response: str, reference: str, right: float) -> None:
    assert task_score(task, response, reference) == right


def test_agreement_ignores_case_punctuation_and_spacing() -> None:
    assert words('The opposite of "up" is  "down."') == words("the opposite of up is down")
