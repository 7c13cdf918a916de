"""The demo's report: a combined CSV, PNG plots and ``summary.md`` in the run directory.

RUN_DIR/METHOD/config.yaml      the resolved config of each method (written by ``run``)
RUN_DIR/METHOD/metrics.jsonl    every step of each method (written by the trainer)
RUN_DIR/metrics.csv             all methods' steps, one row a step (step 0: the start eval)
RUN_DIR/grad_norm.png           pre-clip gradient norm per step
RUN_DIR/accuracy.png            held-out greedy accuracy per step (teacher as a line)
RUN_DIR/scores.png              score mean/std and advantage mean/std/min/max per step
RUN_DIR/response_length.png     mean response length per step
RUN_DIR/summary.md              the table and the verdict
RUN_DIR/summary.json            the table's numbers
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_gndpo.demo.run import MethodRun, Summary

PLOTS = ("grad_norm.png", "accuracy.png", "scores.png", "response_length.png")
# scores.png: one panel a metric (the advantage's scale differs by construction between methods)
_SCORE_PANELS = (
    "score/mean", "score/std", "advantage/mean", "advantage/std", "advantage/min",
    "advantage/max",
)  # fmt: skip


def grad_norm_stats(run: MethodRun) -> dict[str, float]:
    """Max, median and max/median of the pre-clip gradient norm over the training steps.

    max/median is the scale-free spread the stability comparison uses: GNDPO normalises its
    advantages, so its raw gradient norms are on another scale than OPD's. Steps with no
    gradient at all (RLVR when every sample of every prompt scored the same) are left out.
    """
    all_norms = [float(h["grad_norm"]) for h in run.history if "grad_norm" in h]
    norms = [n for n in all_norms if n > 0.0]
    zero = float(len(all_norms) - len(norms))
    if not norms:
        return {"max": 0.0, "median": 0.0, "max_over_median": math.nan, "zero_steps": zero}
    median = statistics.median(norms)
    return {
        "max": max(norms), "median": median, "max_over_median": max(norms) / median,
        "zero_steps": zero,
    }  # fmt: skip


def write_report(summary: Summary) -> Path:
    """Write the CSV, the plots and the summary into ``summary.run_dir``; return summary.md."""
    run_dir = summary.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_csv(summary, run_dir / "metrics.csv")
    write_plots(summary, run_dir)
    numbers = summary_numbers(summary)
    (run_dir / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n")
    path = run_dir / "summary.md"
    path.write_text(summary_markdown(summary, numbers))
    return path


def write_csv(summary: Summary, path: Path) -> None:
    keys = sorted(
        {k for run in summary.methods.values() for h in run.history for k in h} - {"step"}
    )
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "step", *keys])
        for name, run in summary.methods.items():
            for h in run.history:
                writer.writerow([name, h["step"], *(h.get(k, "") for k in keys)])


def _series(run: MethodRun, key: str) -> tuple[list[float], list[float]]:
    points = [(float(h["step"]), float(h[key])) for h in run.history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(summary: Summary, run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CPU box or in CI
    import matplotlib.pyplot as plt

    runs = summary.methods

    def single(key: str, ylabel: str, filename: str, teacher: float | None = None) -> None:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name, run in runs.items():
            ax.plot(*_series(run, key), label=name, marker="o" if key.startswith("eval") else "")
        if teacher is not None:
            ax.axhline(teacher, color="gray", linestyle="--", label="teacher")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / filename, dpi=100)
        plt.close(fig)

    single("grad_norm", "pre-clip gradient norm", "grad_norm.png")
    single("eval/accuracy", "held-out greedy accuracy", "accuracy.png", summary.teacher.accuracy)
    single("response_length/mean", "mean response length (tokens)", "response_length.png")

    fig, axes = plt.subplots(2, 3, figsize=(12.0, 6.4), sharex=True)
    for ax, key in zip(axes.flat, _SCORE_PANELS, strict=True):
        for name, run in runs.items():
            ax.plot(*_series(run, key), label=name)
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(run_dir / "scores.png", dpi=100)
    plt.close(fig)


def summary_numbers(summary: Summary) -> dict[str, Any]:
    """The numbers of the summary table, as plain JSON values."""
    return {
        "quick": summary.settings.quick,
        "steps": summary.settings.steps,
        "teacher_accuracy": summary.teacher.accuracy,
        "student_start_accuracy": summary.student.accuracy,
        "prepare_seconds": summary.prepare_seconds,
        "wall_seconds": summary.wall_seconds,
        "methods": {
            name: {
                "start_accuracy": run.start_accuracy,
                "final_accuracy": run.final_accuracy,
                "best_accuracy": max(_series(run, "eval/accuracy")[1]),
                "wall_seconds": run.wall_seconds,
                "grad_norm": grad_norm_stats(run),
            }
            for name, run in summary.methods.items()
        },
    }


def summary_table(numbers: dict[str, Any]) -> str:
    """The Markdown table: accuracy, grad-norm max/median and wall time of each row."""
    lines = [
        "| model | held-out accuracy (final) | best | grad-norm max | grad-norm median "
        "| max/median | wall time |",
        "|---|---|---|---|---|---|---|",
        f"| teacher | {numbers['teacher_accuracy']:.3f} | | | | | |",
        f"| student start | {numbers['student_start_accuracy']:.3f} | | | | | "
        f"{numbers['prepare_seconds']:.0f} s (preparation) |",
    ]
    for name, m in numbers["methods"].items():
        g = m["grad_norm"]
        lines.append(
            f"| student + {name} | {m['final_accuracy']:.3f} | {m['best_accuracy']:.3f} "
            f"| {g['max']:.3f} | {g['median']:.3f} | {g['max_over_median']:.2f} "
            f"| {m['wall_seconds']:.0f} s |"
        )
    lines.append(f"| total | | | | | | {numbers['wall_seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def verdict(numbers: dict[str, Any]) -> str:
    """One honest sentence each on stability and accuracy, GNDPO against OPD, with the numbers."""
    methods = numbers["methods"]
    if "gndpo" not in methods or "opd" not in methods:
        return ""
    g, o = methods["gndpo"], methods["opd"]
    g_spread, o_spread = g["grad_norm"]["max_over_median"], o["grad_norm"]["max_over_median"]
    steadier = "did" if g_spread < o_spread else "did not"
    better = "did" if g["final_accuracy"] > o["final_accuracy"] else "did not"
    start = numbers["student_start_accuracy"]
    others = "".join(
        f", -> {m['final_accuracy']:.3f} with {name.upper()}"
        for name, m in methods.items()
        if name not in ("gndpo", "opd")
    )
    g_max, o_max = g["grad_norm"]["max"], o["grad_norm"]["max"]
    return (
        f"At this scale GNDPO {steadier} beat OPD on stability: its pre-clip grad-norm "
        f"max/median is {g_spread:.2f} against OPD's {o_spread:.2f} (max {g_max:.3f} vs "
        f"{o_max:.3f}). GNDPO {better} beat OPD on accuracy: held-out greedy accuracy "
        f"{start:.3f} -> {g['final_accuracy']:.3f} with GNDPO, -> {o['final_accuracy']:.3f} with "
        f"OPD{others} (teacher {numbers['teacher_accuracy']:.3f}).\n"
    )


def summary_markdown(summary: Summary, numbers: dict[str, Any]) -> str:
    s = summary.settings
    zero = ", ".join(
        f"{name} {m['grad_norm']['zero_steps']:.0f}" for name, m in numbers["methods"].items()
    )
    return (
        f"# megatron-gndpo demo{' (--quick)' if s.quick else ''}\n\n"
        f"Student ({summary.student.name}) distilled from the teacher ({summary.teacher.name}) on "
        f"the {summary.task} task, {s.steps} steps of {s.prompts_per_step} prompts x "
        f"{s.samples_per_prompt} samples, lr {s.lr:g}, the same seed ({s.seed}) and start for "
        "every method; "
        f"greedy held-out accuracy every {s.eval_interval} steps. Resolved configs and metrics: "
        f"{', '.join(f'`{name}/config.yaml`' for name in summary.methods)}, "
        "`metrics.csv` and `METHOD/metrics.jsonl`.\n\n"
        f"{summary_table(numbers)}\nGrad-norm statistics leave out steps without a gradient "
        f"(every sample of every prompt scored alike): {zero}.\n\n{verdict(numbers)}\n"
        + "".join(f"![{p}]({p})\n" for p in PLOTS)
    )
