"""What a demo run is set up with and what it produced: the values the runner fills and the
report reads (``demo/run.py`` -> ``demo/report.py``; neither imports the other)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

# Where the rollouts are sampled: the built-in generator, or a real vLLM (the vLLM tier).
Engine = Literal["builtin", "vllm"]
ENGINES: tuple[Engine, ...] = ("builtin", "vllm")
# How the student is made: pruned from the teacher (its layers the teacher's, chosen by
# measured importance), or a smaller model fine-tuned briefly on its own (the weak-student
# regime of docs/demo/RESULTS.md, where the sampled-token methods do not teach).
StudentKind = Literal["pruned", "sft"]
STUDENTS: tuple[StudentKind, ...] = ("pruned", "sft")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``--quick`` changes: the teacher recipe and the size of each method's run."""

    quick: bool
    seed: int  # of one training run (prompt order, sampling); the prepared models do not change
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    lr: float
    eval_interval: int
    clip_grad: float = 1.0  # optimizer.clip_grad of every method
    engine: Engine = "builtin"  # rollout.engine of every method
    eval_samples: int = 0  # trainer.eval_samples: sampled accuracy and reverse KL when > 0
    student: StudentKind = "pruned"


@dataclasses.dataclass(frozen=True)
class MethodRun:
    """One method's run: its metrics per step (with ``eval/accuracy`` at 0 and every interval)."""

    name: str
    run_dir: Path
    history: list[dict[str, Any]]
    start_accuracy: float
    final_accuracy: float
    wall_seconds: float
    eval_problems: int  # held-out problems per evaluation: one of them is 1 / eval_problems
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Summary:
    """Everything the report shows: each method's runs, one per seed, in ``seeds`` order."""

    run_dir: Path
    settings: Settings  # of the first seed; the others differ by ``seed`` only
    teacher: Any  # models.PreparedModel, or multimodal.PreparedVLM
    student: Any
    runs: dict[str, list[MethodRun]]
    seeds: tuple[int, ...]
    prepare_seconds: float
    wall_seconds: float
    task: str = "chains"
