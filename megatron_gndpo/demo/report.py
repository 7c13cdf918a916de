"""The demo's report: a combined CSV, PNG plots and ``summary.md`` in the run directory.

RUN_DIR/RUN/config.yaml         the resolved config of each run (RUN: METHOD, or METHOD_sSEED)
RUN_DIR/RUN/metrics.jsonl       every step of each run (written by the trainer)
RUN_DIR/metrics.csv             all runs' steps, one row a step (step 0: the start's evaluation)
RUN_DIR/accuracy.png            held-out greedy accuracy per step (teacher as a line)
RUN_DIR/sampled_accuracy.png    held-out accuracy of samples at temperature 1 per step
RUN_DIR/reverse_kl.png          per-token reverse KL to the teacher on those samples per step
RUN_DIR/grad_norm.png           pre-clip gradient norm per step
RUN_DIR/scores.png              score mean/std and advantage mean/std/min/max per step
RUN_DIR/response_length.png     mean response length per step
RUN_DIR/summary.md              the table and the verdict
RUN_DIR/summary.json            the table's numbers

With several seeds every curve is the mean over seeds with the range of the seeds shaded, and
every number of the table is the mean with its standard deviation over seeds.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.demo.results import MethodRun, Summary

PLOTS = (
    "accuracy.png", "sampled_accuracy.png", "reverse_kl.png", "grad_norm.png", "scores.png",
    "response_length.png",
)  # fmt: skip
# The three measures of what is trained, by the key the trainer logs them under.
MEASURES = {
    "greedy": "eval/accuracy",
    "sampled": "eval/sampled_accuracy",
    "reverse_kl": "eval/reverse_kl",
}
# scores.png: one panel a metric (the advantage's scale differs by construction between methods)
_SCORE_PANELS = (
    "score/mean", "score/std", "advantage/mean", "advantage/std", "advantage/min",
    "advantage/max",
)  # fmt: skip
# A difference counts when it exceeds this many standard errors.
NOISE_STANDARD_ERRORS = 2.0
# What "distillation teaches" means in the report: a gain of at least this much accuracy ...
MIN_GAIN = 0.20
# ... or an accuracy of at least this share of the teacher's; and the reverse KL at most this
# share of where it started.
TEACHER_SHARE = 0.80
KL_SHARE = 0.5

# How the report writes each method's name in prose.
_DISPLAY = {"gndpo": "GNDPO", "opd": "OPD", "rlvr": "RLVR", "tgpo": "TGPO", "tropd": "TrOPD",
            "vopd": "vOPD"}  # fmt: skip


def _display(method: str) -> str:
    return _DISPLAY.get(method, method)


# ---------------------------------------------------------------------------------------------
# Per-run statistics


def grad_norm_stats(run: MethodRun) -> dict[str, float]:
    """Max, median and max/median of the pre-clip gradient norm over the training steps.

    max/median is a scale-free spread, shown for reference, never as a stability verdict: where
    the clip is active on every step (see :func:`diagnostics`) no pre-clip norm reaches the
    update. Steps with no gradient at all (RLVR when every sample of every prompt scored the
    same) are left out.
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


def _series(run: MethodRun, key: str) -> tuple[list[float], list[float]]:
    points = [(float(h["step"]), float(h[key])) for h in run.history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


def _spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, standard deviation (0 for one value) and the values, NaNs left out."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"mean": math.nan, "sd": math.nan, "values": list(values)}
    sd = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return {"mean": statistics.fmean(finite), "sd": sd, "values": list(values)}


def _at(run: MethodRun, key: str, index: int) -> float:
    values = _series(run, key)[1]
    return values[index] if values else math.nan


def mean_curve(runs: Sequence[MethodRun], key: str) -> list[tuple[float, float, float, float]]:
    """(step, mean, min, max) over the runs at each evaluated step all of them logged."""
    by_step: dict[float, list[float]] = {}
    for run in runs:
        for step, value in zip(*_series(run, key), strict=True):
            by_step.setdefault(step, []).append(value)
    return [
        (step, statistics.fmean(v), min(v), max(v))
        for step, v in sorted(by_step.items())
        if len(v) == len(runs)
    ]


def first_step_at(curve: Sequence[tuple[float, float, float, float]], target: float) -> float:
    """The first evaluated step whose mean reaches ``target`` (NaN: never)."""
    return next((step for step, mean, _, _ in curve if mean >= target), math.nan)


# ---------------------------------------------------------------------------------------------
# Files


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
    runs = [run for group in summary.runs.values() for run in group]
    keys = sorted({k for run in runs for h in run.history for k in h} - {"step"})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "seed", "step", *keys])
        for run in runs:
            for h in run.history:
                writer.writerow([run.name, run.seed, h["step"], *(h.get(k, "") for k in keys)])


def write_plots(summary: Summary, run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CPU box or in CI
    import matplotlib.pyplot as plt

    seeds = len(summary.seeds)
    note = f" (mean of {seeds} seeds, range shaded)" if seeds > 1 else ""

    def curves(ax: Any, key: str, marker: str = "") -> None:
        for name, runs in summary.runs.items():
            curve = mean_curve(runs, key)
            if not curve:
                continue
            steps, mean, low, high = (list(x) for x in zip(*curve, strict=True))
            (line,) = ax.plot(steps, mean, label=_display(name), marker=marker)
            if seeds > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)

    def single(key: str, ylabel: str, filename: str, teacher: float | None = None,
               log: bool = False) -> None:  # fmt: skip
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        curves(ax, key, marker="o" if key.startswith("eval") else "")
        if teacher is not None:
            ax.axhline(teacher, color="gray", linestyle="--", label="teacher (greedy)")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}{note}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / filename, dpi=100)
        plt.close(fig)

    teacher = summary.teacher.accuracy
    single("eval/accuracy", "held-out greedy accuracy", "accuracy.png", teacher)
    single("eval/sampled_accuracy", "held-out sampled accuracy (T=1)", "sampled_accuracy.png",
           teacher)  # fmt: skip
    single("eval/reverse_kl", "reverse KL to the teacher (nats/token)", "reverse_kl.png",
           log=True)  # fmt: skip
    single("grad_norm", "pre-clip gradient norm", "grad_norm.png")
    single("response_length/mean", "mean response length (tokens)", "response_length.png")

    fig, axes = plt.subplots(2, 3, figsize=(12.0, 6.4), sharex=True)
    for ax, key in zip(axes.flat, _SCORE_PANELS, strict=True):
        curves(ax, key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(run_dir / "scores.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Numbers


def _method_numbers(runs: Sequence[MethodRun], steps: int) -> dict[str, Any]:
    norms = [grad_norm_stats(r) for r in runs]
    diag = [diagnostics(r) for r in runs]
    out: dict[str, Any] = {
        "seeds": [r.seed for r in runs],
        "start": {m: _spread([_at(r, k, 0) for r in runs]) for m, k in MEASURES.items()},
        "final": {m: _spread([_at(r, k, -1) for r in runs]) for m, k in MEASURES.items()},
        "curve": {m: mean_curve(runs, k) for m, k in MEASURES.items()},
        "best_accuracy": max(max(_series(r, "eval/accuracy")[1]) for r in runs),
        "wall_seconds": sum(r.wall_seconds for r in runs),
        "grad_norm": {
            key: statistics.fmean(n[key] for n in norms)
            for key in ("max", "median", "max_over_median", "zero_steps")
        },
        "diagnostics": {
            key: statistics.fmean(d[key] for d in diag)
            for key in (
                "clip_active_frac",
                "spikes",
                "score_rms_slope",
                "score_rms_slope_se",
                "score_rms_median",
            )
        },
    }
    # kept for readers of older summaries: the greedy accuracy at the start and the end
    out["start_accuracy"] = out["start"]["greedy"]["mean"]
    out["final_accuracy"] = out["final"]["greedy"]["mean"]
    return out


def summary_numbers(summary: Summary) -> dict[str, Any]:
    """The numbers of the summary table, as plain JSON values."""
    first = next(iter(summary.runs.values()))
    methods = {name: _method_numbers(runs, summary.settings.steps)
               for name, runs in summary.runs.items()}  # fmt: skip
    start = {  # the start's evaluation: the same model for every method
        m: statistics.fmean(x["start"][m]["mean"] for x in methods.values()) for m in MEASURES
    }
    return {
        "quick": summary.settings.quick,
        "steps": summary.settings.steps,
        "seeds": list(summary.seeds),
        "clip_grad": summary.settings.clip_grad,
        "engine": summary.settings.engine,
        "student": summary.settings.student,
        "eval_problems": first[0].eval_problems,
        "eval_samples": summary.settings.eval_samples,
        "teacher_accuracy": summary.teacher.accuracy,
        "student_start_accuracy": summary.student.accuracy,
        "student_start": start,
        "prepare_seconds": summary.prepare_seconds,
        "wall_seconds": summary.wall_seconds,
        "methods": methods,
    }


def _mean_sd(spread: dict[str, Any], digits: int = 3) -> str:
    if math.isnan(spread["mean"]):
        return "-"
    if len(spread["values"]) < 2:
        return f"{spread['mean']:.{digits}f}"
    return f"{spread['mean']:.{digits}f} ± {spread['sd']:.{digits}f}"


def _plain(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def summary_table(numbers: dict[str, Any]) -> str:
    """The Markdown table: greedy and sampled accuracy and reverse KL at the end (mean ± sd
    over seeds), the pre-clip grad-norm median and the clip's share, wall time."""
    start = numbers["student_start"]
    lines = [
        "| model | greedy accuracy | sampled accuracy | reverse KL (nats/token) | best greedy "
        "| grad-norm median | clip active | wall time |",
        "|---|---|---|---|---|---|---|---|",
        f"| teacher | {numbers['teacher_accuracy']:.3f} | | | | | | |",
        f"| student start | {start['greedy']:.3f} | {_plain(start['sampled'])} "
        f"| {_plain(start['reverse_kl'])} | | | | {numbers['prepare_seconds']:.0f} s "
        "(preparation) |",
    ]
    for name, m in numbers["methods"].items():
        f, d = m["final"], m["diagnostics"]
        lines.append(
            f"| student + {name} | {_mean_sd(f['greedy'])} | {_mean_sd(f['sampled'])} "
            f"| {_mean_sd(f['reverse_kl'])} | {m['best_accuracy']:.3f} "
            f"| {m['grad_norm']['median']:.3f} | {d['clip_active_frac']:.0%} "
            f"| {m['wall_seconds']:.0f} s |"
        )
    lines.append(f"| total | | | | | | | {numbers['wall_seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The verdict


def _standard_error(accuracy: float, problems: int) -> float:
    """The binomial standard error of an accuracy measured on ``problems`` problems."""
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / problems)


def noise_of(spread: dict[str, Any], problems: int) -> float:
    """The smallest change of a mean final accuracy from a fixed start that is not noise.

    Two standard errors of the mean over the seeds, each seed's spread taken as the larger of
    the measured one and a ``problems``-problem accuracy's binomial error (one seed cannot
    show its spread; three show it roughly); never less than one problem.
    """
    values = [v for v in spread["values"] if not math.isnan(v)]
    per_seed = max(spread["sd"], _standard_error(spread["mean"], problems))
    return max(1.0 / problems, NOISE_STANDARD_ERRORS * per_seed / math.sqrt(max(len(values), 1)))


def noise_between(a: dict[str, Any], b: dict[str, Any], problems: int) -> float:
    """The smallest difference between two methods' mean final accuracies that is not noise."""
    return max(1.0 / problems, math.hypot(noise_of(a, problems), noise_of(b, problems)))


def bar_parts(
    m: dict[str, Any], start: dict[str, float], teacher: float, problems: int
) -> list[tuple[bool, str]]:
    """The three parts of the bar for one method, each ``(met, in words)``: greedy and sampled
    accuracy up beyond noise, each by ``MIN_GAIN`` or to ``TEACHER_SHARE`` of the teacher's;
    the reverse KL at most ``KL_SHARE`` of the start's."""
    f, parts = m["final"], []
    for measure in ("greedy", "sampled"):
        mean, base = f[measure]["mean"], start[measure]
        if math.isnan(mean):
            parts.append((False, f"{measure} accuracy (not measured)"))
            continue
        delta, noise = mean - base, noise_of(f[measure], problems)
        words = f"{measure} accuracy ({delta:+.3f}"
        if delta <= noise:
            parts.append((False, f"{words}: within noise {noise:.3f})"))
        elif delta < MIN_GAIN and mean < TEACHER_SHARE * teacher:
            parts.append((False, f"{words}: under +{MIN_GAIN:.2f} and under {TEACHER_SHARE:.0%} "
                                 f"of the teacher's {teacher:.3f})"))  # fmt: skip
        else:
            parts.append((True, f"{words})"))
    kl, base = f["reverse_kl"]["mean"], start["reverse_kl"]
    if math.isnan(kl) or base <= 0:
        parts.append((False, "reverse KL (not measured)"))
    else:
        words = f"reverse KL ({kl / base - 1.0:+.0%}"
        met = kl <= KL_SHARE * base
        parts.append(
            (met, f"{words})" if met else f"{words}: above {KL_SHARE:.0%} of the start's)")
        )
    return parts


def teaches(m: dict[str, Any], start: dict[str, float], teacher: float, problems: int) -> bool:
    """Whether a method taught the student: every part of :func:`bar_parts` met."""
    return all(met for met, _ in bar_parts(m, start, teacher, problems))


def _and(words: list[str]) -> str:
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else words[0]


def _short_of_the_bar(name: str, parts: list[tuple[bool, str]]) -> str:
    """What of the bar a method that did not meet all of it met, and what it missed."""
    met = [words for ok, words in parts if ok]
    missed = [words for ok, words in parts if not ok]
    if not met:
        return f"{_display(name)} met no part of it: {_and(missed)}."
    return f"{_display(name)} met {_and(met)}; not {_and(missed)}."


def _learning_sentence(name: str, m: dict[str, Any], start: dict[str, float],
                       problems: int) -> str:  # fmt: skip
    """What a method did to the three measures, in words."""
    f = m["final"]
    greedy = f["greedy"]
    delta = greedy["mean"] - start["greedy"]
    noise = noise_of(greedy, problems)
    arrow = f"{start['greedy']:.3f} -> {_mean_sd(greedy)}"
    if abs(delta) > noise:
        how = "raised" if delta > 0 else "lowered"
        text = (
            f"{_display(name)} {how} the greedy held-out accuracy ({arrow}, {delta:+.3f}, "
            f"beyond noise {noise:.3f})"
        )
    else:
        text = (
            f"{_display(name)} did not change the greedy held-out accuracy beyond noise ({arrow})"
        )
    sampled, kl = f["sampled"], f["reverse_kl"]
    if not math.isnan(sampled["mean"]):
        text += f"; sampled accuracy {start['sampled']:.3f} -> {_mean_sd(sampled)}"
    if not math.isnan(kl["mean"]) and start["reverse_kl"] > 0:
        change = kl["mean"] / start["reverse_kl"] - 1.0
        text += f"; reverse KL {start['reverse_kl']:.3f} -> {_mean_sd(kl)} ({change:+.0%})"
    return text


def _race_sentence(numbers: dict[str, Any]) -> str:
    """How many steps the sparse reward needs to reach the accuracy a distillation method
    reached at its first evaluation."""
    methods = numbers["methods"]
    leader = next((n for n in ("opd", "gndpo") if n in methods), None)
    if leader is None or "rlvr" not in methods:
        return ""
    curve = methods[leader]["curve"]["greedy"]
    if len(curve) < 2:
        return ""
    step, target = curve[1][0], curve[1][1]
    reached = first_step_at(methods["rlvr"]["curve"]["greedy"], target)
    where = (
        f"did not reach it within the {numbers['steps']} steps"
        if math.isnan(reached)
        else f"reached it at step {reached:.0f}, {reached / step:.0f}x the steps"
    )
    return (
        f" {_display(leader)} reached {target:.3f} greedy at its first evaluation (step "
        f"{step:.0f}); RLVR, on the sparse verifiable reward, {where}."
    )


def _stability_sentence(numbers: dict[str, Any], names: tuple[str, ...]) -> str:
    """What the clip let through; no max/median verdict (``demo --stability`` measures that)."""
    methods, clip = numbers["methods"], numbers["clip_grad"]
    fracs = {n: methods[n]["diagnostics"]["clip_active_frac"] for n in names}
    where = f"The gradient clip (optimizer.clip_grad={clip})"
    if all(f >= 1.0 for f in fracs.values()):
        return (
            f"{where} was active on 100% of the steps of "
            f"{' and '.join(_display(n) for n in names)}: every update was g·{clip}/‖g‖, so the "
            "pre-clip norms never reached the update and GNDPO's division by the batch's "
            "standard deviation cancelled (it acted as OPD with a batch-mean baseline). "
            "`megatron-gndpo demo --stability` measures stability with the clip above the norms."
        )
    shares = " and ".join(f"{f:.0%} of {_display(n)}'s steps" for n, f in fracs.items())
    if max(fracs.values()) >= 0.5:
        effect = (
            "where it was active the update was rescaled to that norm, so the pre-clip norms "
            "reached the update only on the other steps"
        )
    else:
        effect = "most updates took the pre-clip gradient as it was"
    return (
        f"{where} was active on {shares}: {effect}. Stability under outlier batches is "
        "`megatron-gndpo demo --stability`'s question."
    )


def verdict(numbers: dict[str, Any]) -> str:
    """What each method did to greedy accuracy, sampled accuracy and reverse KL, whether GNDPO
    and OPD taught the student (the bar: ``teaches``), how they compare, and how long the
    sparse reward took to catch up."""
    methods = numbers["methods"]
    if not methods:
        return ""
    start, n = numbers["student_start"], numbers["eval_problems"]
    teacher = numbers["teacher_accuracy"]
    lines = [_learning_sentence(name, m, start, n) + "." for name, m in methods.items()]
    distill = [name for name in ("gndpo", "opd") if name in methods]
    taught = [name for name in distill if teaches(methods[name], start, teacher, n)]
    bar = (
        f"greedy and sampled accuracy each up by {MIN_GAIN:.2f} or to {TEACHER_SHARE:.0%} of "
        f"the teacher's {teacher:.3f}, beyond noise, and the reverse KL at most "
        f"{KL_SHARE:.0%} of the start's"
    )
    if distill:
        parts = {x: bar_parts(methods[x], start, teacher, n) for x in distill if x not in taught}
        some = any(met for p in parts.values() for met, _ in p)  # the bar met in part
        nobody = "neither" if len(distill) > 1 else "no"
        who = " and ".join(_display(x) for x in taught) or (f"{nobody} in full" if some else nobody)
        short = [_short_of_the_bar(x, p) for x, p in parts.items()]
        lines.append(" ".join([f"Taught the student ({bar}): {who}.", *short]))
    if len(distill) == 2:
        g, o = (methods[x]["final"]["greedy"] for x in distill)
        apart = abs(g["mean"] - o["mean"]) > noise_between(g, o, n)
        lines.append(
            f"GNDPO and OPD ended {'apart, beyond' if apart else 'within'} noise of each other "
            f"({g['mean']:.3f} vs {o['mean']:.3f} greedy)."
        )
    race = _race_sentence(numbers)
    if race:
        lines.append(race.strip())
    if distill:
        lines.append(_stability_sentence(numbers, tuple(distill)))
    seeds = len(numbers["seeds"])
    if seeds > 1:
        how = (
            f"Values are means ± standard deviations over {seeds} seeds; a change counts beyond "
            "noise when it exceeds two standard errors of the mean, each seed's spread taken as "
            f"at least a {n}-problem accuracy's binomial error"
        )
    else:
        how = (
            "Values are of one seed, which cannot show the seed spread; a change counts beyond "
            f"noise when it exceeds two binomial standard errors of a {n}-problem accuracy "
            "(`--seeds 3` measures the spread)"
        )
    lines.append(f"(Teacher {teacher:.3f} greedy. {how}.)")
    return "\n\n".join(lines) + "\n"


def summary_markdown(summary: Summary, numbers: dict[str, Any]) -> str:
    s = summary.settings
    seeds = ", ".join(map(str, summary.seeds))
    student = (
        f"pruned from the teacher ({summary.student.name})"
        if s.student == "pruned"
        else f"fine-tuned on its own ({summary.student.name})"
    )
    engine = (
        "rollouts sampled by a real vLLM (rollout.engine=vllm), the student's weights synced "
        "into it every step; "
        if s.engine == "vllm"
        else ""
    )
    samples = (
        f" and {s.eval_samples} samples per problem at temperature 1 (their accuracy and the "
        "per-token reverse KL to the teacher)"
        if s.eval_samples
        else ""
    )
    return (
        f"# megatron-gndpo demo{' (--quick)' if s.quick else ''}\n\n"
        f"Student {student}, distilled from the teacher ({summary.teacher.name}) on the "
        f"{summary.task} task: {s.steps} steps of {s.prompts_per_step} prompts x "
        f"{s.samples_per_prompt} samples, lr {s.lr:g}, seeds {seeds}, the same start and "
        f"prompts for every method; {engine}held-out problems evaluated every "
        f"{s.eval_interval} steps greedily{samples}. Resolved configs and metrics: "
        "`RUN/config.yaml`, `RUN/metrics.jsonl` and `metrics.csv`.\n\n"
        f"{summary_table(numbers)}\n{verdict(numbers)}\n" + "".join(f"![{p}]({p})\n" for p in PLOTS)
    )
