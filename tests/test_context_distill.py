"""The context-distillation study's data and scoring (benchmarks/context_distill.py): no model.

Each row's examples are training questions of its own kind, never the question itself, the same
on every run; the example config takes them as the teacher's earlier turns and validates; the
scores read answers as the study reports them. The study itself runs the real model
(benchmarks/results/context-distill-cpu-2026-12-07.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.context_distill import EXAMPLE, SHOTS, scores, write_data
from megatron_gndpo.checks import validate
from megatron_gndpo.config import load_config
from megatron_gndpo.data.datasets import EncodedPrompt, load_prompts
from megatron_gndpo.data.prompt_sets import context_fields
from megatron_gndpo.teacher.context import check_fields, render


def test_each_row_gets_examples_of_its_kind_and_never_itself(tmp_path: Path) -> None:
    paths = write_data(tmp_path)
    again = write_data(tmp_path / "again")
    train = [json.loads(x) for x in paths["train"].read_text().splitlines()]
    kinds = {r["prompt"]: r["task"] for r in train}
    for split, path in paths.items():
        assert path.read_text() == again[split].read_text()  # seeded
        for row in map(json.loads, path.read_text().splitlines()):
            shots = [row[f"q{k}"] for k in range(1, SHOTS + 1)]
            assert row["prompt"] not in shots and len(set(shots)) == SHOTS
            assert all(kinds[q] == row["task"] for q in shots)


def test_the_example_config_renders_the_examples_as_earlier_turns(tmp_path: Path) -> None:
    paths = write_data(tmp_path)
    cfg = load_config(EXAMPLE, [f"data.train={paths['train']}"])
    validate(cfg, 1)
    rows = load_prompts(str(paths["eval"]), fields=context_fields(cfg))
    assert cfg.teacher.context is not None
    check_fields("teacher", cfg.teacher.context, [EncodedPrompt(r, []) for r in rows], "eval")
    first = render(cfg.teacher.context, rows[0])
    assert first.prompt == rows[0].prompt and len(first.turns) == SHOTS
    assert first.turns[0] == (rows[0].field("q1"), rows[0].field("a1"))


def test_scores_read_the_answer_alone_and_anywhere() -> None:
    assert scores("Jerusalem.", "Jerusalem") == (1.0, 1.0)
    assert scores("The capital of Israel is Jerusalem.", "Jerusalem") == (0.0, 1.0)
    assert scores("New Delhi", "New Delhi") == (1.0, 1.0)
    assert scores("Delhi", "New Delhi") == (0.0, 0.0)
