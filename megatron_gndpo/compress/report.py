"""The report of a compression run: ``OUT/curves.jsonl`` (one line an evaluation, the
teacher's first), ``OUT/report.md`` (the table, the settings, the wall times) and
``OUT/curves.png`` (each measure against the step, the teacher dashed). Rewritten from the
stages' results on every run, so it is always the whole run's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.compress.evaluate import MEASURES
from megatron_gndpo.compress.recipe import Plan

FILES = ("report.md", "curves.jsonl", "curves.png")
# The plot's panels: (measure, title).
PANELS = (("reverse_kl", "held-out reverse KL (nats/token)"),
          ("agreement", "greedy answer = teacher's"), ("task", "task score (greedy)"),
          ("greedy_eos", "greedy answers that end"))  # fmt: skip
_HEADERS = {"reverse_kl": "reverse KL", "agreement": "agreement", "task": "task",
            "greedy_eos": "greedy EOS", "sampled_eos": "sampled EOS",
            "greedy_length": "greedy len", "sampled_length": "sampled len"}  # fmt: skip


def curve(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every evaluation of the student in step order: the pruned start, the warm-up's, the
    distillation's."""
    return [point for name in ("baseline", "warmup", "distill")
            for point in results.get(name, {}).get("curve", [])]  # fmt: skip


def write_report(p: Plan, results: dict[str, dict[str, Any]]) -> Path:
    """``report.md``, ``curves.jsonl`` and ``curves.png`` in OUT; returns the report's path."""
    points = curve(results)
    teacher = {"step": None, "stage": "teacher", **results["baseline"]["teacher"]}
    with (p.out / "curves.jsonl").open("w") as f:
        for point in (teacher, *points):
            f.write(json.dumps(point) + "\n")
    plot(points, results["baseline"]["teacher"], p.out / "curves.png")
    path = p.out / "report.md"
    path.write_text(markdown(p, results, points))
    return path


def _parameters(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def _cell(key: str, value: float) -> str:
    return f"{value:.1f}" if key.endswith("_length") else f"{value:.3f}"


def markdown(p: Plan, results: dict[str, dict[str, Any]], points: Sequence[dict[str, Any]]) -> str:
    r, cfg, pruned = p.request, p.config, results["prune"]
    teacher = results["baseline"]["teacher"]
    lines = [
        "# Compression report",
        "",
        f"Teacher {r.teacher} ({p.teacher_model.num_layers} layers, "
        f"{_parameters(pruned['teacher_parameters'])} parameters) -> student of "
        f"{pruned['num_layers']} layers (the teacher's {pruned['keep_layers']}, "
        f"{_parameters(pruned['student_parameters'])} parameters, importance "
        f"{pruned['importance']}, calibration KL {pruned['kl']:.4f}).",
        "",
        f"Measured on {len(p.questions)} held-out questions ({r.eval_file}), greedy answers cut "
        f"at {cfg.rollout.max_response_length} tokens; reverse KL(student || teacher) per token "
        f"on {r.eval_samples} samples a question at temperature 1. task: the reference in the "
        "answer's first sentence (the sentence itself for repeat); agreement: the teacher's "
        "greedy answer; EOS: answers that end within the limit.",
        "",
        "| stage | step | " + " | ".join(_HEADERS[k] for k in MEASURES) + " |",
        "|---|---|" + "---|" * len(MEASURES),
        "| teacher | - | " + " | ".join(_cell(k, teacher[k]) for k in MEASURES) + " |",
    ]
    for point in points:
        cells = " | ".join(_cell(k, point[k]) for k in MEASURES)
        lines.append(f"| {point['stage']} | {point['step']} | {cells} |")
    lines += ["", "## Settings", "",
              f"- warm-up (sequence-level KD on the teacher's greedy answers): "
              f"{r.warmup_steps} steps",
              f"- on-policy distillation: {r.steps} steps of algorithm.estimator="
              f"{cfg.algorithm.estimator}, {cfg.rollout.prompts_per_step} prompts x "
              f"{cfg.rollout.samples_per_prompt} samples a step, lr {cfg.optimizer.lr}",
              f"- base config {r.config}; overrides: {' '.join(r.overrides) or 'none'}",
              f"- training prompts {cfg.data.train}; evaluation every {r.eval_interval} steps",
              f"- the distilled student: {results['distill']['checkpoint']} (the trainer's "
              "config beside it in OUT/distill/config.yaml)",
              "", "## Wall time", ""]  # fmt: skip
    lines += [f"- {name}: {result['seconds']:.0f} s" for name, result in results.items()]
    return "\n".join(lines) + "\n"


def plot(points: Sequence[dict[str, Any]], teacher: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CPU box or in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    colours = {"pruned": "tab:gray", "warmup": "tab:green", "distill": "tab:blue"}
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        ax.plot([x["step"] for x in points], [x[key] for x in points], color="black", lw=1)
        for stage, colour in colours.items():
            mine = [x for x in points if x["stage"] == stage]
            if not mine:  # no warm-up asked for
                continue
            ax.plot([x["step"] for x in mine], [x[key] for x in mine], "o", color=colour,
                    ms=4, label=stage)  # fmt: skip
        ax.axhline(teacher[key], color="black", ls="--", lw=1, label="teacher")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
