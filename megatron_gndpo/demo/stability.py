"""``megatron-gndpo demo --stability``: OPD's and GNDPO's gradients on outlier batches.

    study = run_stability("runs/demo_stability", "runs/demo/cache", quick=False)

The paper's claim is that OPD's gradient explodes on outlier batches and GNDPO's stays bounded.
The main demo cannot show it: its clip is active on every step, so no pre-clip norm reaches the
update and GNDPO's rescaling cancels (docs/methods/gndpo.md). This study sets up what the claim
needs, every setting in :class:`StabilitySettings`:

- a student close to the teacher, made from it as the main demo's is, with one layer dropped
  instead of two (``models.near_pruned_recipe``: held-out 0.742 where the teacher has 0.984;
  until 2026-12-05 a student fine-tuned on its own, held-out ~0.93), whose
  ordinary batches score little, so that an outlier batch stands out;
- outlier batches on a documented schedule, as users meet them: every ``outlier_interval``-th
  step draws harder prompts, chains with one operation more than the models were trained on
  (``rollout.outlier_interval``, ``data.outlier_train``; ``rollout.outlier_temperature`` is the
  other source, a hotter sampling temperature on those steps);
- a gradient clip above every norm of these runs, so the pre-clip norm is the update's;
- OPD, GNDPO, and GNDPO's two halves (``baseline_only``: A = c − μ, ``scale_only``:
  A = c / σ), from the same start over the same seeds.

Each run's measures (:func:`run_measures`) come from its ``metrics.jsonl``: the median pre-clip
norm of the ordinary and of the outlier steps and their ratio, the spike count, the slope of
log norm on log score RMS, the clip-active share, the score RMS and the accuracy. Files:

    RUN_DIR/METHOD_sSEED/{config.yaml,metrics.jsonl}   each run (written by the trainer)
    RUN_DIR/metrics.csv                                 every step of every run
    RUN_DIR/norm_vs_rms.png                             pre-clip norm against score RMS per step
    RUN_DIR/grad_norm.png                               pre-clip norm per step, outliers marked
    RUN_DIR/stability.md, stability.json                the table and the verdict
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from megatron_gndpo.config.schema import AlgorithmConfig, Config
from megatron_gndpo.data.tasks import chains
from megatron_gndpo.demo import models
from megatron_gndpo.demo.results import MethodRun, Settings
from megatron_gndpo.demo.run import method_config, prepare_models, run_method
from megatron_gndpo.parallel.world import distributed_world

# The study's variants: (name, algorithm). The same clamp and loss as the main demo.
VARIANTS: dict[str, AlgorithmConfig] = {
    "opd": AlgorithmConfig(estimator="opd", kl_clip=5.0, policy_loss="gspo"),
    "gndpo": AlgorithmConfig(estimator="gndpo", kl_clip=5.0, policy_loss="gspo"),
    "baseline_only": AlgorithmConfig(
        estimator="gndpo", kl_clip=5.0, policy_loss="gspo", gndpo_divide_std=False
    ),
    "scale_only": AlgorithmConfig(
        estimator="gndpo", kl_clip=5.0, policy_loss="gspo", gndpo_subtract_mean=False
    ),
}
# The outlier steps' prompts (write_outlier_prompts): their own seed, apart from the others.
OUTLIER_PROMPTS = 512
OUTLIER_SEED = 3
# The bar for the claim: OPD's outlier steps at least 3x its ordinary median, GNDPO's
# at most 1.5x, on every seed.
OPD_BAR = 3.0
GNDPO_BAR = 1.5


@dataclasses.dataclass(frozen=True)
class StabilitySettings:
    """Everything the study sets; ``--quick`` checks the pipeline, not the claim."""

    quick: bool
    seeds: tuple[int, ...]
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    lr: float
    clip_grad: float  # above every pre-clip norm of the full study's runs
    outlier_interval: int
    outlier_difficulty: int | None  # operations of the outlier steps' chains; None: data.train
    outlier_temperature: float | None = None  # None: the ordinary temperature (1.0)

    def run_settings(self, seed: int) -> Settings:
        """The main demo's settings of one run: accuracy at the start and the end only."""
        return Settings(
            self.quick, seed, steps=self.steps, prompts_per_step=self.prompts_per_step,
            samples_per_prompt=self.samples_per_prompt, lr=self.lr, eval_interval=self.steps,
            clip_grad=self.clip_grad,
        )  # fmt: skip


def stability_settings(quick: bool) -> StabilitySettings:
    """The full study took 7 minutes on 2 CPU cores (docs/demo/RESULTS.md); quick about one.

    lr 2e-4 as the main demo; clip 100: above every pre-clip norm of these runs (the largest
    was ~20, docs/demo/RESULTS.md), so no step is clipped. The outlier steps' chains have 4
    operations where the models learnt 3: the near-teacher student's score RMS on them is ~5x
    its ordinary one (2.8 vs 0.52 in 12 OPD steps; 5 operations gave 2.2).
    """
    if quick:
        return StabilitySettings(True, (1234, 1235), steps=8, prompts_per_step=4,
                                 samples_per_prompt=4, lr=2e-4, clip_grad=100.0,
                                 outlier_interval=4, outlier_difficulty=4)  # fmt: skip
    return StabilitySettings(False, (1234, 1235), steps=80, prompts_per_step=16,
                             samples_per_prompt=4, lr=2e-4, clip_grad=100.0,
                             outlier_interval=10, outlier_difficulty=4)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StabilityStudy:
    """Everything the report shows."""

    run_dir: Path
    settings: StabilitySettings
    teacher: models.PreparedModel
    student: models.PreparedModel
    runs: dict[tuple[str, int], MethodRun]  # (variant, seed) -> run
    prepare_seconds: float
    wall_seconds: float


def run_stability(
    run_dir: str | Path, cache_dir: str | Path | None = None, *, quick: bool = False,
    settings: StabilitySettings | None = None,
    prepared_models: tuple[Any, Any, Any] | None = None,
) -> StabilityStudy:  # fmt: skip
    """Prepare (or reuse) the teacher and the near-teacher student, run every variant on every
    seed, write the report; return its numbers. ``settings``: other than
    :func:`stability_settings` (e.g. the temperature as the outlier source);
    ``prepared_models``: (teacher, student, task) instead of the study's own (tests)."""
    run_dir = Path(run_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else run_dir / "cache"
    started = time.perf_counter()
    with distributed_world(alone="the demo"):
        st = settings or stability_settings(quick)
        if prepared_models is not None:
            teacher, start, task = prepared_models
        else:
            run = st.run_settings(st.seeds[0])  # its student: pruned, one layer dropped
            teacher, start, task = prepare_models(cache_dir, run, prune=models.near_pruned_recipe())
        outlier_prompts = write_outlier_prompts(run_dir, st.outlier_difficulty)
        prepare_seconds = time.perf_counter() - started
        runs = {}
        for seed in st.seeds:
            for name in VARIANTS:
                cfg = variant_config(
                    name, seed, run_dir, cache_dir, teacher, start, task, st, outlier_prompts
                )
                runs[(name, seed)] = run_method(cfg)
    study = StabilityStudy(
        run_dir=run_dir, settings=st, teacher=teacher, student=start, runs=runs,
        prepare_seconds=prepare_seconds, wall_seconds=time.perf_counter() - started,
    )  # fmt: skip
    write_stability_report(study)
    return study


def write_outlier_prompts(run_dir: Path, difficulty: int | None) -> Path | None:
    """The outlier steps' prompts: chains of ``difficulty`` operations as a JSONL file in
    ``run_dir`` (prompt, answer); None for no such prompts."""
    if difficulty is None:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"outlier_prompts_d{difficulty}.jsonl"
    problems = chains.generate(OUTLIER_PROMPTS, OUTLIER_SEED, difficulty)
    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                            for p in problems))  # fmt: skip
    return path


def variant_config(
    name: str, seed: int, run_dir: Path, cache_dir: Path, teacher: models.PreparedModel,
    student: models.PreparedModel, task: models.DemoTask, st: StabilitySettings,
    outlier_prompts: Path | None,
) -> Config:  # fmt: skip
    """The main demo's config of one run, with the variant's algorithm, the outlier steps (and
    room for their longer answers) and its own directory ``RUN_DIR/NAME_sSEED``."""
    cfg = method_config("gndpo", run_dir, cache_dir, teacher, student, task, st.run_settings(seed))
    longest = max(task.difficulty, st.outlier_difficulty or 0)
    rollout = dataclasses.replace(
        cfg.rollout, outlier_interval=st.outlier_interval,
        outlier_temperature=st.outlier_temperature,
        max_response_length=models.max_new_tokens(longest),
    )  # fmt: skip
    data = dataclasses.replace(
        cfg.data, outlier_train=None if outlier_prompts is None else str(outlier_prompts)
    )
    logging = dataclasses.replace(cfg.logging, run_dir=str(run_dir / f"{name}_s{seed}"))
    return dataclasses.replace(
        cfg, algorithm=VARIANTS[name], rollout=rollout, data=data, logging=logging
    )


# ---------------------------------------------------------------------------------- measures


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_measures(history: list[dict[str, Any]], outlier_interval: int) -> dict[str, float]:
    """One run's stability measures from its steps (``history``: step 0 is the start eval).

    ``outlier_over_normal``: the median pre-clip norm of the outlier steps over that of the
    ordinary ones; ``spikes`` (and how many of them fell on outlier steps), ``slope`` (±
    ``slope_se``) and ``clip_active_frac`` are the trainer's diagnostics at the last step.
    """
    steps = [h for h in history if h["step"] > 0 and math.isfinite(h.get("grad_norm", math.nan))]
    outlier = [h for h in steps if h["step"] % outlier_interval == 0]
    normal = [h for h in steps if h["step"] % outlier_interval != 0]
    normal_norm = _median([float(h["grad_norm"]) for h in normal])
    outlier_norm = _median([float(h["grad_norm"]) for h in outlier])
    last = history[-1]
    accuracies = [float(h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    return {
        "normal_norm": normal_norm,
        "outlier_norm": outlier_norm,
        "outlier_over_normal": outlier_norm / normal_norm if normal_norm > 0 else math.nan,
        "normal_rms": _median([float(h["score/rms"]) for h in normal]),
        "outlier_rms": _median([float(h["score/rms"]) for h in outlier]),
        "spikes": float(last["grad_norm/spikes"]),
        "spikes_on_outliers": float(sum(h["grad_norm/spike"] for h in outlier)),
        "slope": float(last.get("grad_norm/score_rms_slope", math.nan)),
        "slope_se": float(last.get("grad_norm/score_rms_slope_se", math.nan)),
        "clip_active_frac": float(last["grad_norm/clip_active_frac"]),
        "max_norm": max(float(h["grad_norm"]) for h in steps),
        "start_accuracy": accuracies[0],
        "final_accuracy": accuracies[-1],
    }


def study_numbers(study: StabilityStudy) -> dict[str, Any]:
    """The numbers of the report, as plain JSON values."""
    st = study.settings
    return {
        "settings": dataclasses.asdict(st),
        "teacher_accuracy": study.teacher.accuracy,
        "student_start_accuracy": study.student.accuracy,
        "prepare_seconds": study.prepare_seconds,
        "wall_seconds": study.wall_seconds,
        "runs": [
            {
                "method": name,
                "seed": seed,
                "wall_seconds": run.wall_seconds,
                **run_measures(run.history, st.outlier_interval),
            }
            for (name, seed), run in study.runs.items()
        ],
    }


def stability_verdict(numbers: dict[str, Any]) -> str:
    """Whether OPD's outlier steps reach 3x its ordinary median and GNDPO's stay under 1.5x, on
    every seed, with the numbers; and what the two halves show."""
    runs = numbers["runs"]

    def ratios(method: str) -> list[float]:
        return [r["outlier_over_normal"] for r in runs if r["method"] == method]

    def listed(method: str) -> str:
        return " / ".join(f"{x:.2f}" for x in ratios(method))

    opd, gndpo = ratios("opd"), ratios("gndpo")
    opd_ok = bool(opd) and all(x >= OPD_BAR for x in opd)
    gndpo_ok = bool(gndpo) and all(x <= GNDPO_BAR for x in gndpo)
    held = sum(o >= OPD_BAR and g <= GNDPO_BAR for o, g in zip(opd, gndpo, strict=True))
    if held == len(opd):
        outcome = "reproduced on " + ("both seeds" if held == 2 else f"all {held} seeds")
    else:
        outcome = f"held on {held} of {len(opd)} seeds"
    head = (
        f"The claim {outcome}: OPD's outlier steps had {listed('opd')}x its ordinary median "
        f"pre-clip norm (bar: >= {OPD_BAR:g}x, {'met' if opd_ok else 'missed'}), GNDPO's "
        f"{listed('gndpo')}x (bar: <= {GNDPO_BAR:g}x, {'met' if gndpo_ok else 'missed'})."
    )
    baseline, scale = ratios("baseline_only"), ratios("scale_only")
    halves = ""
    if baseline and scale:
        halves = (
            f" GNDPO's halves: the batch-mean baseline alone had {listed('baseline_only')}x, the "
            f"division by σ alone {listed('scale_only')}x"
        )
        if all(x <= GNDPO_BAR for x in scale) and all(x >= OPD_BAR for x in baseline):
            halves += ": the bound comes from the division by σ, not from the baseline"
        halves += "."
    spikes = "; ".join(
        f"{m} " + " / ".join(
            f"{r['spikes']:.0f} ({r['spikes_on_outliers']:.0f} on outlier steps)"
            for r in runs if r["method"] == m
        )
        for m in ("opd", "gndpo")
    )  # fmt: skip
    return (
        f"{head}{halves} Spikes found without knowing the schedule (above 3x the median of the "
        f"previous 20 steps), per seed: {spikes}.\n"
    )


# ---------------------------------------------------------------------------------- report


def write_stability_report(study: StabilityStudy) -> Path:
    """Write the CSV, the plots, ``stability.json`` and ``stability.md``; return the latter."""
    run_dir = study.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    numbers = study_numbers(study)
    (run_dir / "stability.json").write_text(json.dumps(numbers, indent=2) + "\n")
    _write_csv(study, run_dir / "metrics.csv")
    _write_plots(study, run_dir)
    path = run_dir / "stability.md"
    path.write_text(stability_markdown(numbers))
    return path


def stability_table(numbers: dict[str, Any]) -> str:
    """One row per run: pre-clip norms on ordinary and outlier steps, diagnostics, accuracy."""
    lines = [
        "| method | seed | median norm, ordinary steps | outlier steps | outlier / ordinary "
        "| spikes (on outlier steps) | slope on score RMS | score RMS, ordinary / outlier "
        "| clip active | max norm | accuracy | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in numbers["runs"]:
        lines.append(
            f"| {r['method']} | {r['seed']} | {r['normal_norm']:.3f} | {r['outlier_norm']:.3f} "
            f"| {r['outlier_over_normal']:.2f} | {r['spikes']:.0f} ({r['spikes_on_outliers']:.0f}) "
            f"| {r['slope']:.2f} ± {r['slope_se']:.2f} "
            f"| {r['normal_rms']:.3f} / {r['outlier_rms']:.3f} | {r['clip_active_frac']:.0%} "
            f"| {r['max_norm']:.2f} | {r['start_accuracy']:.3f} -> {r['final_accuracy']:.3f} "
            f"| {r['wall_seconds']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def stability_markdown(numbers: dict[str, Any]) -> str:
    st = numbers["settings"]
    return (
        f"# megatron-gndpo demo --stability{' (--quick)' if st['quick'] else ''}\n\n"
        f"Student start held-out accuracy {numbers['student_start_accuracy']:.3f}, teacher "
        f"{numbers['teacher_accuracy']:.3f}. {st['steps']} steps of {st['prompts_per_step']} "
        f"prompts x {st['samples_per_prompt']} samples, lr {st['lr']:g}, "
        f"optimizer.clip_grad={st['clip_grad']:g}; every {st['outlier_interval']}th step is an "
        f"outlier step ({_outlier_source(st)}); seeds "
        f"{', '.join(str(s) for s in st['seeds'])}. Spikes: steps above 3x the median pre-clip "
        "norm of the previous 20 (the trainer does not know which steps are outliers); slope: "
        "of log pre-clip norm on log score RMS over the run's steps (± its standard error); "
        "baseline_only is A = c − μ, scale_only A = c / σ (docs/methods/gndpo.md). Prepared "
        f"models in {numbers['prepare_seconds']:.0f} s, {numbers['wall_seconds']:.0f} s in all."
        f"{_QUICK_NOTE if st['quick'] else ''}\n\n"
        f"{stability_table(numbers)}\n{stability_verdict(numbers)}\n"
        "![pre-clip norm against score RMS](norm_vs_rms.png)\n"
        "![pre-clip norm per step](grad_norm.png)\n"
    )


def _outlier_source(st: dict[str, Any]) -> str:
    parts = []
    if st["outlier_difficulty"] is not None:
        parts.append(
            f"it draws chains of {st['outlier_difficulty']} operations, data.outlier_train"
        )
    if st["outlier_temperature"] is not None:
        parts.append(
            f"it samples at temperature {st['outlier_temperature']:g}, rollout.outlier_temperature"
        )
    return "; ".join(parts) or "nothing makes it one"


_QUICK_NOTE = (
    " --quick checks the pipeline, not the claim: 8 steps with the main demo's weaker student "
    "and the quick teacher; run `megatron-gndpo demo --stability` for the study."
)


def _write_csv(study: StabilityStudy, path: Path) -> None:
    keys = sorted({k for run in study.runs.values() for h in run.history for k in h} - {"step"})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "seed", "step", *keys])
        for (name, seed), run in study.runs.items():
            for h in run.history:
                writer.writerow([name, seed, h["step"], *(h.get(k, "") for k in keys)])


def _write_plots(study: StabilityStudy, run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CPU box or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    interval = study.settings.outlier_interval
    names = list(VARIANTS)
    seeds = study.settings.seeds
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def points(run: MethodRun, outliers: bool, key: str) -> tuple[list[float], list[float]]:
        rows = [h for h in run.history if h["step"] > 0 and (h["step"] % interval == 0) == outliers]
        return [float(h[key]) for h in rows], [float(h["grad_norm"]) for h in rows]

    fig, axes = plt.subplots(1, len(names), figsize=(4.0 * len(names), 3.8), sharey=True)
    for ax, name in zip(axes, names, strict=True):
        for i, seed in enumerate(seeds):
            run = study.runs[(name, seed)]
            ax.scatter(*points(run, False, "score/rms"), s=10, color=colors[i], alpha=0.6,
                       label=f"seed {seed}, ordinary")  # fmt: skip
            ax.scatter(*points(run, True, "score/rms"), s=40, color=colors[i], marker="x",
                       label=f"seed {seed}, outlier")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # log axes label their minor ticks on top of each other
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(name)
        ax.set_xlabel("score RMS (clamped)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("pre-clip gradient norm")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "norm_vs_rms.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(7.0, 2.2 * len(names)), sharex=True)
    for ax, name in zip(axes, names, strict=True):
        for i, seed in enumerate(seeds):
            h = [x for x in study.runs[(name, seed)].history if x["step"] > 0]
            ax.plot([x["step"] for x in h], [x["grad_norm"] for x in h], color=colors[i],
                    label=f"seed {seed}")  # fmt: skip
            out = [x for x in h if x["step"] % interval == 0]
            ax.scatter([x["step"] for x in out], [x["grad_norm"] for x in out], color=colors[i],
                       marker="x")  # fmt: skip
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    axes[0].set_title("pre-clip gradient norm per step (x: outlier steps)")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(run_dir / "grad_norm.png", dpi=100)
    plt.close(fig)
