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

from benchmarks.real_distill import (
    EVAL_DATA,
    EXAMPLE,
    MEASURES,
    METHODS,
    Settings,
    load_questions,
    markdown,
    mean_curves,
    method_overrides,
    run_kd_then,
    task_score,
    words,
)

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
        # the first sentence only: an answer that rambles until it says the reference is wrong
        ("capital", "Lyon is a city. The capital of France is Paris.", "Paris", 0.0),
        ("capital", "Paris\nIt is also the largest city", "Paris", 1.0),
        ("plural", "Mice! That is the plural of mouse", "mice", 1.0),
    ],
)
def test_task_score(task: str, response: str, reference: str, right: float) -> None:
    assert task_score(task, response, reference) == right


def test_agreement_ignores_case_punctuation_and_spacing() -> None:
    assert words('The opposite of "up" is  "down."') == words("the opposite of up is down")


def _run(method: str, seed: int, steps: list[int], kl: list[float]) -> dict[str, Any]:
    curve = [{**dict.fromkeys(MEASURES, 0.0), "step": t, "reverse_kl": k}
             for t, k in zip(steps, kl, strict=True)]  # fmt: skip
    return {"method": method, "seed": seed, "curve": curve, "seconds": 1.0,
            "response_tokens_per_step": 100.0}  # fmt: skip


def test_report_averages_seeds_per_step_for_a_two_stage_method() -> None:
    """kd_gndpo's curve is KD's steps then GNDPO's, counted on from KD's last (no second step 0):
    the report averages seeds at each step like any method's."""
    runs = [
        _run("gndpo", 1, [0, 8, 16], [3.0, 2.0, 1.0]),
        _run("kd_gndpo", 1, [0, 8, 16], [3.0, 2.5, 1.5]),
        _run("kd_gndpo", 2, [0, 8, 16], [3.0, 2.7, 1.1]),
    ]
    curves = mean_curves(runs)
    assert list(curves["kd_gndpo"]) == [0, 8, 16]
    assert curves["kd_gndpo"][16]["reverse_kl"] == pytest.approx(1.3)
    assert curves["kd_gndpo"][16]["reverse_kl_sd"] == pytest.approx(0.2828, abs=1e-4)
    kd = {"task": 0.8, "eos": 1.0, "length": 11.0}
    teacher = {"task": 0.78, "task_by_kind": {"capital": 0.81}, "greedy_eos": 0.97,
               "greedy_length": 10.8, "kd": kd, "kd_sampled": kd}  # fmt: skip
    text = markdown(runs, teacher)
    assert "| kd_gndpo | 16 | 1.300 ± 0.283 |" in text
    assert "kd_gndpo: [1, 2]" in text


@pytest.mark.parametrize("kd_steps", [0, 8, 12])
def test_kd_then_needs_both_parts(kd_steps: int, tmp_path: Path) -> None:
    s = Settings(teacher=tmp_path, student=tmp_path, tokenizer=tmp_path, out=tmp_path, steps=8,
                 eval_interval=4, seeds=(1,), overrides=(), kd_steps=kd_steps)  # fmt: skip
    with pytest.raises(ValueError, match="0 < --kd-steps < --steps"):
        run_kd_then(s, "kd_tropd", 1, None, [], None)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_a_valid_config(method: str) -> None:
    """Each study method's overrides of the example config pass the trainer's checks (a typo in
    a key or value fails here, not an hour into a study)."""
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config.loader import load_config

    validate(load_config(EXAMPLE, list(method_overrides(method))), 1)
