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

    max/median is a scale-free spread (GNDPO normalises its advantages, so its raw norms are on
    another scale than OPD's), shown for reference, never as a stability verdict: where the
    clip is active on every step (see :func:`diagnostics`) no pre-clip norm reaches the update.
    Steps with no gradient at all (RLVR when every sample of every prompt scored the same) are
    left out.
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


def diagnostics(run: MethodRun) -> dict[str, float]:
    """The run's stability diagnostics (``algorithms/metrics.py``): the last step's running
    values are the whole run's; NaN where the run could not determine one (a slope needs a
    spread of score RMS). Also the median score RMS of its steps."""
    steps = [h for h in run.history if h["step"] > 0]
    last = steps[-1] if steps else {}
    out = {
        key: float(last.get(f"grad_norm/{key}", math.nan))
        for key in ("clip_active_frac", "spikes", "score_rms_slope", "score_rms_slope_se")
    }
    rms = [float(h["score/rms"]) for h in steps if "score/rms" in h]
    out["score_rms_median"] = statistics.median(rms) if rms else math.nan
    return out


def summary_numbers(summary: Summary) -> dict[str, Any]:
    """The numbers of the summary table, as plain JSON values."""
    runs = list(summary.methods.values())
    return {
        "quick": summary.settings.quick,
        "steps": summary.settings.steps,
        "clip_grad": summary.settings.clip_grad,
        "engine": summary.settings.engine,
        "eval_problems": runs[0].eval_problems if runs else 0,
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
                "diagnostics": diagnostics(run),
            }
            for name, run in summary.methods.items()
        },
    }


def _slope(d: dict[str, float]) -> str:
    if math.isnan(d["score_rms_slope"]):
        return "-"
    return f"{d['score_rms_slope']:.2f} ± {d['score_rms_slope_se']:.2f}"


def summary_table(numbers: dict[str, Any]) -> str:
    """The Markdown table: accuracy, pre-clip grad-norm statistics and diagnostics, wall time."""
    blank = "| " * 7
    lines = [
        "| model | held-out accuracy (final) | best | grad-norm median | max/median "
        "| clip active | spikes | slope on score RMS | wall time |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| teacher | {numbers['teacher_accuracy']:.3f} {blank}|",
        f"| student start | {numbers['student_start_accuracy']:.3f} {blank}"
        f"{numbers['prepare_seconds']:.0f} s (preparation) |",
    ]
    for name, m in numbers["methods"].items():
        g, d = m["grad_norm"], m["diagnostics"]
        lines.append(
            f"| student + {name} | {m['final_accuracy']:.3f} | {m['best_accuracy']:.3f} "
            f"| {g['median']:.3f} | {g['max_over_median']:.2f} | {d['clip_active_frac']:.0%} "
            f"| {d['spikes']:.0f} | {_slope(d)} | {m['wall_seconds']:.0f} s |"
        )
    lines.append(f"| total {blank}| {numbers['wall_seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


# A difference counts when it exceeds this many standard errors of a held-out accuracy.
NOISE_STANDARD_ERRORS = 2.0


# How the report writes each method's name in prose.
_DISPLAY = {"gndpo": "GNDPO", "opd": "OPD", "rlvr": "RLVR", "tgpo": "TGPO", "tropd": "TrOPD",
            "vopd": "vOPD"}  # fmt: skip


def _display(method: str) -> str:
    return _DISPLAY.get(method, method)


def _standard_error(accuracy: float, problems: int) -> float:
    """The binomial standard error of an accuracy measured on ``problems`` problems."""
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / problems)


def noise_from_start(final: float, problems: int) -> float:
    """The smallest change from the start's accuracy that is not noise.

    The start is one fixed model's greedy evaluation; the final accuracy varies with the seed.
    One seed cannot show that spread, so two binomial standard errors of the final accuracy
    stand in for it (docs/demo/RESULTS.md measured a seed spread of ~0.04 on 128 problems,
    a little under one such error); never less than one problem.
    """
    return max(1.0 / problems, NOISE_STANDARD_ERRORS * _standard_error(final, problems))


def noise_between(a: float, b: float, problems: int) -> float:
    """The smallest difference between two methods' final accuracies that is not noise: two
    standard errors of the difference of two such evaluations; never less than one problem."""
    se = math.hypot(_standard_error(a, problems), _standard_error(b, problems))
    return max(1.0 / problems, NOISE_STANDARD_ERRORS * se)


def _change(name: str, start: float, final: float, problems: int) -> tuple[str, int]:
    """A method's change from the start in words, and its sign beyond noise (+1, 0, -1)."""
    noise, arrow = noise_from_start(final, problems), f"({start:.3f} -> {final:.3f})"
    if final - start > noise:
        return f"{name} raised the student's accuracy beyond noise {arrow}", 1
    if start - final > noise:
        return f"{name} lowered the student's accuracy beyond noise {arrow}", -1
    return f"{name} did not change the student's accuracy beyond noise {arrow}", 0


def _stability_sentence(numbers: dict[str, Any], names: tuple[str, ...]) -> str:
    """What the clip let through, the spikes and the sensitivity slope; no max/median verdict."""
    methods, clip = numbers["methods"], numbers["clip_grad"]
    fracs = {n: methods[n]["diagnostics"]["clip_active_frac"] for n in names}
    where = f"The gradient clip (optimizer.clip_grad={clip})"
    if all(f >= 1.0 for f in fracs.values()):
        return (
            f"{where} was active on 100% of the steps of "
            f"{' and '.join(_display(n) for n in names)}: "
            f"every update was g·{clip}/‖g‖, so the pre-clip norms in the table never reached "
            "the update, and GNDPO's division by the batch's standard deviation cancelled "
            "exactly (it acted as OPD with a batch-mean baseline). This run cannot tell which "
            "method is the more stable; `megatron-gndpo "
            "demo --stability` measures it with the clip above the typical norm "
            "(docs/methods/gndpo.md)."
        )
    shares = " and ".join(
        f"{f:.0%} of {_display(n)}'s steps" if i == 0 else f"{f:.0%} of {_display(n)}'s"
        for i, (n, f) in enumerate(fracs.items())
    )
    full = [_display(n) for n, f in fracs.items() if f >= 1.0]
    blocked = f" (on {', '.join(full)}'s every update was clipped)" if full else ""
    spikes = ", ".join(f"{_display(n)} {methods[n]['diagnostics']['spikes']:.0f}" for n in names)
    slopes = ", ".join(f"{_display(n)} {_slope(methods[n]['diagnostics'])}" for n in names)
    return (
        f"{where} was active on {shares}{blocked}. Steps above 3x the median pre-clip norm of "
        f"the previous 20: {spikes}; slope of log pre-clip norm on log score RMS (1: the norm "
        f"follows the score's scale, 0: it does not): {slopes}."
    )


def verdict(numbers: dict[str, Any]) -> str:
    """GNDPO against OPD, with the numbers: what the clip let through (no max/median verdict),
    and each method's accuracy against the start and the other, within noise or beyond it."""
    methods = numbers["methods"]
    if "gndpo" not in methods or "opd" not in methods:
        return ""
    start, n = numbers["student_start_accuracy"], numbers["eval_problems"]
    g, o = methods["gndpo"]["final_accuracy"], methods["opd"]["final_accuracy"]
    (g_text, g_sign), (o_text, o_sign) = _change("GNDPO", start, g, n), _change("OPD", start, o, n)
    apart = abs(g - o) > noise_between(g, o, n)
    if g_sign < 1 and o_sign < 1:
        both = f"({g:.3f} vs {o:.3f}, {'beyond' if apart else 'within'} noise of each other)"
        outcome = f"neither GNDPO nor OPD improved the student, and neither beat the other {both}"
    elif apart:
        ahead, behind = ("GNDPO", "OPD") if g > o else ("OPD", "GNDPO")
        outcome = f"{ahead} ended ahead of {behind} by {abs(g - o):.3f}, beyond noise"
    else:
        outcome = f"GNDPO and OPD ended within noise of each other ({g:.3f} vs {o:.3f})"
    others = "".join(
        f" {_change(_display(name), start, m['final_accuracy'], n)[0]}."
        for name, m in methods.items()
        if name not in ("gndpo", "opd")
    )
    noise = max(noise_from_start(x, n) for x in (g, o))
    return (
        f"{_stability_sentence(numbers, ('gndpo', 'opd'))}\n\n"
        f"On held-out accuracy, {g_text}; {o_text}: {outcome}.{others} (Teacher "
        f"{numbers['teacher_accuracy']:.3f}. A change counts beyond noise when it exceeds two "
        f"standard errors of a {n}-problem accuracy, about {noise:.3f} here, and never within "
        f"one problem, 1/{n}: one seed cannot show the seed spread.)\n"
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
        + (
            "rollouts sampled by a real vLLM (rollout.engine=vllm), the student's weights synced "
            "into it every step; "
            if s.engine == "vllm"
            else ""
        )
        + f"greedy held-out accuracy every {s.eval_interval} steps. Resolved configs and metrics: "
        f"{', '.join(f'`{name}/config.yaml`' for name in summary.methods)}, "
        "`metrics.csv` and `METHOD/metrics.jsonl`.\n\n"
        f"{summary_table(numbers)}\nGrad-norm statistics are of the pre-clip norm and leave "
        f"out steps without a gradient (every sample of every prompt scored alike): {zero}. "
        f"Clip active: the share of steps whose pre-clip norm exceeded optimizer.clip_grad="
        f"{s.clip_grad:g} (their update was rescaled to that norm); spikes: steps above 3x the "
        "median of the previous 20; slope: of log pre-clip norm on log score RMS over the steps "
        "(± its standard error). docs/methods/gndpo.md explains each.\n\n"
        f"{verdict(numbers)}\n" + "".join(f"![{p}]({p})\n" for p in PLOTS)
    )
