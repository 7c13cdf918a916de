"""``megatron-gndpo compress`` on the real model: SmolLM2-135M-Instruct into 24 of its layers.

The short version of the recipe the study measured (benchmarks/results/real-distill-cpu-
2026-12-07.md): the Hugging Face teacher converted, pruned to 24 layers by Block Importance,
two steps of sequence-level KD on its greedy answers, two of the example's on-policy recipe
(GNDPO beside the forward KL to the teacher cooled to 0.3), measured on 8 held-out questions
(two of each kind). On the fixed seed the evaluation moves the right way: the student comes
closer to the teacher (reverse KL), ends more of its answers and answers more of them right
than the pruned start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_distributed
from tests.real import real_model_dir

pytestmark = [pytest.mark.real, pytest.mark.megatron]

EVAL = Path(__file__).resolve().parents[1] / "examples" / "data" / "short_answers_eval.jsonl"


def _compress_body(rank: int, world: int, hf_dir: str, out: str, eval_file: str) -> list[Any]:
    from megatron_gndpo.cli import main

    code = main([
        "compress", "--teacher", hf_dir, "--out", out, "--layers", "24", "--warmup-steps", "2",
        "--steps", "2", "--eval-interval", "2", "--eval", eval_file, "--calib-samples", "8",
        "--eval-samples", "2", "rollout.max_response_length=32",
    ])  # fmt: skip
    lines = Path(out, "curves.jsonl").read_text().splitlines() if code == 0 else []
    return [code, [json.loads(x) for x in lines]]


def test_compress_makes_the_pruned_smollm2_closer_to_its_teacher(
    tmp_path: Path, real_report: list[str]
) -> None:
    questions = [json.loads(x) for x in EVAL.read_text().splitlines()]
    picked = [q for kind in ("capital", "opposite", "plural", "repeat")
              for q in [r for r in questions if r["task"] == kind][:2]]  # fmt: skip
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(q) + "\n" for q in picked))
    code, curve = run_distributed(
        _compress_body, 1, (str(real_model_dir()), str(tmp_path / "run"), str(eval_file)),
        timeout_s=900,
    )[0]  # fmt: skip
    assert code == 0
    by_stage = {(x["stage"], x["step"]): x for x in curve}
    teacher, start, end = by_stage["teacher", None], by_stage["pruned", 0], by_stage["distill", 4]
    real_report.append(
        "compress SmolLM2 -> 24 layers, 2 KD + 2 on-policy steps, 8 questions: "
        + ", ".join(f"{k} {start[k]:.3f} -> {end[k]:.3f} (teacher {teacher[k]:.3f})"
                    for k in ("reverse_kl", "task", "greedy_eos", "sampled_eos"))
    )  # fmt: skip
    assert end["reverse_kl"] < start["reverse_kl"]
    assert end["sampled_eos"] > start["sampled_eos"]
    assert end["task"] >= start["task"]
    assert end["greedy_length"] < start["greedy_length"]
