"""``megatron-gndpo demo --quick`` end to end, as a newcomer runs it: the report and its numbers."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_gndpo.demo.report import PLOTS, verdict
from megatron_gndpo.demo.run import ALL_METHODS
from megatron_gndpo.demo.stability import VARIANTS

pytestmark = [pytest.mark.megatron]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


METHODS = tuple(ALL_METHODS)  # every method, so each one's report path runs
# The stability diagnostics every step of every run logs (algorithms/metrics.py).
DIAGNOSTICS = (
    "score/rms", "grad_norm/clip_active", "grad_norm/clip_active_frac", "grad_norm/spike",
    "grad_norm/spikes", "rollout/temperature",
)  # fmt: skip


def _numbers(start: float, finals: dict[str, float], clip_active: float) -> dict[str, Any]:
    """summary.json-like numbers of a chains demo (128 held-out problems, clip 1.0)."""
    return {
        "student_start_accuracy": start, "teacher_accuracy": 1.0, "eval_problems": 128,
        "clip_grad": 1.0,
        "methods": {
            name: {
                "final_accuracy": final, "best_accuracy": max(final, start),
                "grad_norm": {"max": 10.0, "median": 5.0, "max_over_median": 2.0},
                "diagnostics": {
                    "clip_active_frac": clip_active, "spikes": 0.0, "score_rms_slope": 0.5,
                    "score_rms_slope_se": 0.3,
                },
            }
            for name, final in finals.items()
        },
    }  # fmt: skip


def test_verdict_calls_small_differences_noise_and_no_winner_below_the_start() -> None:
    """What `demo --quick` printed before (issue 17): 'GNDPO did beat OPD on stability: max/median
    1.43 against OPD's 1.46' and 'did beat OPD on accuracy: 0.219 -> 0.211 with GNDPO, -> 0.180
    with OPD'. Both methods ended below the start within noise: neither improved the student,
    and with the clip active on every step the pre-clip norms never reached the update."""
    text = verdict(_numbers(0.219, {"gndpo": 0.211, "opd": 0.180}, clip_active=1.0))
    assert "did beat" not in text and "max/median" not in text
    assert "neither GNDPO nor OPD improved the student" in text
    assert "within noise" in text
    assert "active on 100% of the steps" in text and "never reached the update" in text


def test_verdict_names_a_gain_beyond_noise_and_a_partly_active_clip() -> None:
    text = verdict(_numbers(0.219, {"gndpo": 0.664, "opd": 0.234}, clip_active=0.25))
    assert "GNDPO raised the student's accuracy beyond noise (0.219 -> 0.664)" in text
    assert "OPD did not change the student's accuracy beyond noise (0.219 -> 0.234)" in text
    assert "GNDPO ended ahead of OPD by 0.430, beyond noise" in text
    assert "active on 25% of GNDPO's steps and 25% of OPD's" in text
    assert "never reached the update" not in text
    # one problem of difference is within noise whatever the accuracies
    text = verdict(_numbers(0.219, {"gndpo": 0.664, "opd": 0.656}, clip_active=0.0))
    assert "within noise of each other" in text


def test_unknown_demo_method_is_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_gndpo.cli import main

    assert main(["demo", "--methods", "gndpo,ppo", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-gndpo: error: unknown demo method(s) ['ppo']"), err
    assert "--methods takes a comma-separated subset of gndpo,opd" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def quick_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the quick demos of this module: the quick teacher and the student
    are trained once (about a minute) and reused by the next test."""
    return tmp_path_factory.mktemp("demo_cache")


def test_demo_quick_writes_a_finite_report(tmp_path: Path, quick_cache: Path) -> None:
    run_dir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", "demo", "--quick",
         "--methods", ",".join(METHODS),
         "--run-dir", str(run_dir), "--cache-dir", str(quick_cache)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"report written to {run_dir / 'summary.md'}" in done.stdout
    assert "| student + gndpo |" in done.stdout

    summary = (run_dir / "summary.md").read_text()
    assert "| teacher |" in summary and "On held-out accuracy, GNDPO " in summary
    assert "The gradient clip (optimizer.clip_grad=1.0) was active on" in summary
    for plot in PLOTS:
        path = run_dir / plot
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
        assert f"]({plot})" in summary

    numbers = json.loads((run_dir / "summary.json").read_text())
    assert set(numbers["methods"]) == set(METHODS)
    assert 0.0 <= numbers["student_start_accuracy"] <= numbers["teacher_accuracy"] <= 1.0
    for name, m in numbers["methods"].items():
        assert m["start_accuracy"] == numbers["student_start_accuracy"], name  # same start
        assert 0.0 <= m["final_accuracy"] <= 1.0
        assert _finite(m["grad_norm"]["max"]) and _finite(m["grad_norm"]["median"]), (name, m)
        assert 0.0 <= m["diagnostics"]["clip_active_frac"] <= 1.0, (name, m)
        assert m["wall_seconds"] > 0
    assert numbers["eval_problems"] == 128 and numbers["clip_grad"] == 1.0

    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = numbers["steps"]
    for name in METHODS:
        method_dir = run_dir / name
        assert (method_dir / "config.yaml").is_file()
        lines = (method_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, steps + 1))
        mine = [r for r in rows if r["method"] == name]
        assert [int(r["step"]) for r in mine] == list(range(steps + 1))  # step 0: the start
        for r in mine[1:]:
            for key in ("grad_norm", "score/mean", "advantage/std", "response_length/mean",
                        *DIAGNOSTICS):  # fmt: skip
                assert math.isfinite(float(r[key])), (name, r["step"], key)
            assert float(r["grad_norm/clip_active"]) == float(float(r["grad_norm"]) > 1.0)
        assert "grad_norm/trailing_median" in mine[-1] and "grad_norm/spike" in mine[-1]
        accuracies = [float(r["eval/accuracy"]) for r in mine if r["eval/accuracy"]]
        assert len(accuracies) >= 2 and all(0.0 <= a <= 1.0 for a in accuracies)


def test_demo_multimodal_quick_writes_a_finite_report(tmp_path: Path) -> None:
    """``demo --multimodal --quick``: VLM teacher and student on the visual task, GNDPO vs OPD."""
    run_dir = tmp_path / "mm"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", "demo", "--multimodal", "--quick",
         "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (run_dir / "summary.md").read_text()
    assert "on the visual (images) task" in summary and "On held-out accuracy" in summary
    assert "nan" not in summary.split("The gradient clip", 1)[1]
    numbers = json.loads((run_dir / "summary.json").read_text())
    assert set(numbers["methods"]) == {"gndpo", "opd"}
    # the quick teacher reads the digits; the student starts clearly below it
    assert numbers["teacher_accuracy"] >= 0.5
    assert numbers["student_start_accuracy"] <= numbers["teacher_accuracy"] / 2
    for name, m in numbers["methods"].items():
        assert 0.0 <= m["final_accuracy"] <= 1.0
        assert _finite(m["grad_norm"]["max"]) and m["grad_norm"]["max"] > 0, name
        config = (run_dir / name / "config.yaml").read_text()
        assert "vision:" in config and "freeze_encoder: true" in config


def test_demo_stability_quick_runs_every_variant_and_seed(
    tmp_path: Path, quick_cache: Path
) -> None:
    """``demo --stability --quick``: the pipeline (4 variants x 2 seeds, outlier steps, the
    report and its plots), not the claim: 8 steps cannot show it."""
    run_dir = tmp_path / "stability"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", "demo", "--stability", "--quick",
         "--run-dir", str(run_dir), "--cache-dir", str(quick_cache)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"report written to {run_dir / 'stability.md'}" in done.stdout
    report = (run_dir / "stability.md").read_text()
    assert "The claim " in report and "| opd | 1234 |" in report
    for plot in ("norm_vs_rms.png", "grad_norm.png"):
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    numbers = json.loads((run_dir / "stability.json").read_text())
    st = numbers["settings"]
    assert {(r["method"], r["seed"]) for r in numbers["runs"]} == {
        (m, s) for m in VARIANTS for s in st["seeds"]
    } and len(st["seeds"]) == 2
    for r in numbers["runs"]:
        assert _finite(r["normal_norm"]) and _finite(r["outlier_over_normal"]), r
        assert r["clip_active_frac"] == 0.0, r  # the clip is above every norm
        lines = (run_dir / f"{r['method']}_s{r['seed']}" / "metrics.jsonl").read_text()
        steps = [json.loads(x) for x in lines.splitlines()]
        assert len(steps) == st["steps"]
        assert all(_finite(step[key]) for key in DIAGNOSTICS for step in steps)
    config = (run_dir / "scale_only_s1234" / "config.yaml").read_text()
    assert "gndpo_subtract_mean: false" in config and "outlier_interval: 4" in config
    prompts = run_dir / f"outlier_prompts_d{st['outlier_difficulty']}.jsonl"
    assert f"outlier_train: {prompts}" in config
    first = json.loads(prompts.read_text().splitlines()[0])
    assert first["prompt"].count(" + ") + first["prompt"].count(" - ") == 4  # 4 operations


def test_demo_stability_refuses_options_it_does_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from megatron_gndpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--stability", "--methods", "opd"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "demo --stability runs its own methods and seeds" in err and "Traceback" not in err


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: this is its absence"
)
def test_demo_on_vllm_without_vllm_says_what_to_install(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``demo --engine vllm`` where vLLM is missing: one message naming the tier to install, no
    traceback, before any model is prepared (the run on the real engine: tests/test_vllm.py)."""
    from megatron_gndpo.cli import main

    assert main(["demo", "--quick", "--engine", "vllm", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "demo --engine vllm needs vLLM" in err and "install_vllm_cpu.sh" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "cache").exists()


def test_demo_on_vllm_refuses_what_it_does_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_gndpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--stability", "--engine", "vllm"])
    assert exit_info.value.code == 2
    assert "leave out --methods, --multimodal, --seed and --engine" in capsys.readouterr().err
    assert main(["demo", "--multimodal", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "runs the text task only" in err and "Traceback" not in err
