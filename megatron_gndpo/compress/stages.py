"""The stages of ``compress``, one function each, narrated by :func:`run`:

    teacher   a Hugging Face teacher converted to a megatron checkpoint   OUT/teacher
    prune     the student: the teacher's layers kept by importance          OUT/pruned
    baseline  the teacher and the pruned student measured (step 0)         OUT/stages/baseline.json
    warmup    sequence-level KD: SFT on the teacher's greedy answers       OUT/warmup
    distill   on-policy distillation through the Trainer                   OUT/distill

A stage is complete when ``OUT/stages/NAME.json`` (its result: measurements, wall time) is
there; it is written last, so a stage cut short leaves none and runs again from its start (its
directory removed first), and a finished one is skipped on a rerun. Every model runs in this
process (one rank: TP=1/PP=1), on the CPU or one GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.compress.evaluate import (
    Answers,
    Evaluator,
    TeacherLogprobs,
    greedy_answers,
    measured_teacher,
    teacher_scorer,
)
from megatron_gndpo.compress.recipe import STAGES_DIR, Plan, trainer_config
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.logging import progress
from megatron_gndpo.parallel.world import distributed_world, one_process_world

Result = dict[str, Any]


def run(p: Plan) -> dict[str, Result]:
    """Every stage in order (each skipped when complete); their results by name."""
    results: dict[str, Result] = {}
    with distributed_world(alone="compress"):
        if p.teacher_kind == "hf":
            results["teacher"] = _stage(p, "teacher", lambda: convert_teacher(p))
        results["prune"] = _stage(p, "prune", lambda: prune(p))
        results["baseline"] = _stage(p, "baseline", lambda: baseline(p))
        evaluator = _evaluator(p, Answers(**results["baseline"]["teacher_answers"]))
        start = p.stage_dir("pruned")
        if p.request.warmup_steps:
            results["warmup"] = _stage(p, "warmup", lambda: warmup(p, evaluator))
            start = p.stage_dir("warmup")
        results["distill"] = _stage(p, "distill", lambda: distill(p, evaluator, start))
    return results


def _stage(p: Plan, name: str, work: Callable[[], Result]) -> Result:
    done = p.out / STAGES_DIR / f"{name}.json"
    if done.is_file():
        say(f"{name}: complete in {p.out}, skipped (delete {done} to run it again)")
        return dict(json.loads(done.read_text()))
    say(f"{name}: running")
    began = time.perf_counter()
    result = work() | {"seconds": time.perf_counter() - began}
    done.parent.mkdir(exist_ok=True)
    partial = done.with_suffix(".tmp")
    partial.write_text(json.dumps(result) + "\n")
    os.replace(partial, done)  # complete or absent, never half written
    say(f"{name}: done in {result['seconds']:.0f} s")
    return result


def _fresh(directory: Path) -> Path:
    """The stage's own directory, emptied of what a run cut short left there."""
    shutil.rmtree(directory, ignore_errors=True)
    return directory


def _tokenizer(p: Plan) -> Any:
    from megatron_gndpo.data.tokenizer import load_tokenizer

    return load_tokenizer(p.tokenizer, setting="--tokenizer")


def _evaluator(p: Plan, teacher: Answers) -> Evaluator:
    cfg = p.config
    return Evaluator(
        _tokenizer(p), p.questions, teacher, max_new_tokens=cfg.rollout.max_response_length,
        token_budget=cfg.trainer.scoring_token_budget, samples=p.request.eval_samples,
        seed=cfg.trainer.seed,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# teacher, prune, baseline


def convert_teacher(p: Plan) -> Result:
    """The Hugging Face teacher as a model-only megatron checkpoint (``convert hf-to-mcore``)."""
    from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore

    out = _fresh(p.teacher_checkpoint)
    with one_process_world(seed=0) as groups:
        model = convert_hf_to_mcore(p.request.teacher, out, groups=groups,
                                    parallel=ParallelConfig())  # fmt: skip
    return {"checkpoint": str(out), "num_layers": model.num_layers}


def prune(p: Plan) -> Result:
    """The student: the teacher's layers ``--layers``/``--keep-layers`` kept (``prune``),
    calibrated on the teacher's greedy answers to the training prompts."""
    from megatron_gndpo.prune.run import prune_checkpoint

    r = p.request
    result = prune_checkpoint(
        p.teacher_checkpoint, _fresh(p.stage_dir("pruned")), num_layers=r.layers or 0,
        tokenizer=_tokenizer(p), prompts=p.train_prompts[: r.calib_samples],
        keep_layers=r.keep_layers, importance=r.importance,
        max_new_tokens=p.config.rollout.max_response_length,
    )  # fmt: skip
    say(f"prune: kept the teacher's layers {list(result.choice.keep)}: "
        f"{result.student_parameters / 1e6:.1f}M of {result.teacher_parameters / 1e6:.1f}M "
        f"parameters, calibration KL {result.kl:.4f}")  # fmt: skip
    return result.describe() | {"checkpoint": str(result.out)}


def baseline(p: Plan) -> Result:
    """The teacher's greedy answers to the held-out questions (what agreement compares with),
    the teacher measured as every student is, and the pruned student at step 0."""
    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    tok, cfg = _tokenizer(p), p.config
    with one_process_world(seed=cfg.trainer.seed) as groups:
        teacher = load_model(p.teacher_checkpoint, groups, frozen=True)
        generator = MegatronGenerator.for_model(teacher, groups, tok)
        ids = [tok.apply_chat_template(q.prompt) for q in p.questions]
        answers = greedy_answers(generator, ids, tok, cfg.rollout.max_response_length)
        evaluate = _evaluator(p, answers)
        score = teacher_scorer(teacher, groups, tok.vocab_size, cfg.trainer.scoring_token_budget)
        measured = evaluate(teacher, groups, generator, score)
        say(f"teacher: {_line(measured)}")
        student = load_model(p.stage_dir("pruned"), groups, frozen=True)
        start = _measure(evaluate, student, groups, tok, score, 0, "pruned")
    return {"teacher_answers": dataclasses.asdict(answers), "teacher": measured, "curve": [start]}


def _measure(evaluate: Evaluator, net: Any, groups: Any, tok: Any, teacher: TeacherLogprobs,
             step: int, stage: str) -> Result:  # fmt: skip
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    found = evaluate(net, groups, MegatronGenerator.for_model(net, groups, tok), teacher)
    say(f"step {step} ({stage}): {_line(found)}")
    return {"step": step, "stage": stage, **found}


def _line(found: Result) -> str:
    return (f"task {found['task']:.3f}, agreement {found['agreement']:.3f}, reverse KL "
            f"{found['reverse_kl']:.3f}, greedy EOS {found['greedy_eos']:.2f}, greedy length "
            f"{found['greedy_length']:.1f}")  # fmt: skip


def _due(step: int, last: int, interval: int) -> bool:
    return step % interval == 0 or step == last


# ---------------------------------------------------------------------------------------------
# warm-up and distillation


class _Rows(Sequence[Any]):
    """``n`` rows of which only those made are held: the ones a seeded run reads."""

    def __init__(self, n: int, made: dict[int, Any]) -> None:
        self.n, self.made = n, made

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if i not in self.made:
            raise IndexError(f"row {i} was not made: only the rows the steps draw are")
        return self.made[i]


def warmup(p: Plan, evaluate: Evaluator) -> Result:
    """Sequence-level KD (Kim & Rush 2016): SFT of the pruned student on the teacher's greedy
    answers to the training prompts, as many sequences a step as a trainer step samples and
    with the trainer's optimizer; saved as a checkpoint ``checkpoint.init`` loads."""
    from megatron_gndpo.checkpoint.convert import describe_checkpoints, saved_model
    from megatron_gndpo.checkpoint.dist import resolve, save_checkpoint
    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.engine.scoring import sequence_multiple
    from megatron_gndpo.rollout import greedy
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.sft import SFTSequence, build_sft_model, drawn_rows, micro_batch, run_sft

    r, cfg, tok = p.request, p.config, _tokenizer(p)
    steps, seed = r.warmup_steps, cfg.trainer.seed
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    # the teacher answers only the prompts the warm-up's steps read (a few steps of a large
    # training set need a few batches of answers, not one for every prompt)
    rows = drawn_rows(len(p.train_prompts), steps=steps, batch_size=batch, seed=seed)
    out = _fresh(p.stage_dir("warmup"))
    pruned = p.stage_dir("pruned")
    model_cfg = dataclasses.replace(saved_model(pruned).model, params_dtype=cfg.model.params_dtype)
    curve = []
    with one_process_world(seed=seed) as groups:
        teacher = load_model(p.teacher_checkpoint, groups, frozen=True)
        answers = greedy.greedy_answers(
            MegatronGenerator.for_model(teacher, groups, tok),
            [tok.apply_chat_template(p.train_prompts[i]) for i in rows],
            max_new_tokens=cfg.rollout.max_response_length, stop_token_ids=(tok.eos_id,),
        )  # fmt: skip
        made = {i: SFTSequence(tuple(a.ids), a.prompt_length)
                for i, a in zip(rows, answers, strict=True)}  # fmt: skip
        sequences = _Rows(len(p.train_prompts), made)
        score = teacher_scorer(teacher, groups, tok.vocab_size, cfg.trainer.scoring_token_budget)
        m = build_sft_model(model_cfg, ParallelConfig(), groups, cfg.optimizer,
                            vocab_size=tok.vocab_size, steps=steps, seed=seed,
                            init=resolve(pruned))  # fmt: skip
        bar = progress(steps, "warm-up", True)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            bar.update(1)
            if _due(step, steps, r.eval_interval):
                curve.append(_measure(evaluate, m.model, groups, tok, score, step, "warmup")
                             | {"sft_loss": metrics["loss"]})  # fmt: skip

        multiple = sequence_multiple(m.model)
        run_sft(
            m, sequences, lambda batch: micro_batch(batch, tok.pad_id, multiple), steps=steps,
            batch_size=batch, micro_batch_size=cfg.trainer.micro_batch_size, seed=seed,
            on_step=on_step,
        )  # fmt: skip
        bar.close()
        out.mkdir(parents=True)
        save_checkpoint(out, steps, m.model, model_config=model_cfg, tokenizer=p.tokenizer)
        describe_checkpoints(out, model_cfg)  # the distillation reads its architecture
    return {"checkpoint": str(out), "curve": curve, "sequences": len(rows),
            "teacher_eos": sum(a.finished for a in answers) / len(answers)}  # fmt: skip


def distill(p: Plan, evaluate: Evaluator, start: Path) -> Result:
    """On-policy distillation of the student at ``start`` through the Trainer for ``--steps``,
    evaluated every ``--eval-interval`` steps and at the end; the last step is saved."""
    from megatron.core import parallel_state

    from megatron_gndpo.checkpoint.convert import saved_model
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import save_dir, save_resolved
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.trainer import Trainer

    r = p.request
    run_dir = _fresh(p.stage_dir("distill"))
    cfg = trainer_config(
        r, student=start, teacher=p.teacher_checkpoint, tokenizer=p.tokenizer,
        student_model=saved_model(start).model, teacher_model=saved_model(
            p.teacher_checkpoint).model, run_dir=run_dir,
    )  # fmt: skip
    validate(cfg, 1)
    save_resolved(cfg, run_dir)
    offset = r.warmup_steps  # the curve counts on from the warm-up's steps
    curve, ended = [], []
    try:
        trainer = Trainer(cfg)
        c = trainer.c
        generator = MegatronGenerator.for_model(c.student, c.student_groups, c.tokenizer)

        teacher = measured_teacher(c, cfg, p.teacher_checkpoint)

        with progress(r.steps, "distill", True) as bar:
            for step in range(1, r.steps + 1):
                metrics = trainer.step()
                bar.update(1)
                ended.append(metrics["finished/frac"])  # the share of samples that ended
                if _due(offset + step, offset + r.steps, r.eval_interval):
                    found = evaluate(c.student, c.student_groups, generator, teacher)
                    curve.append({"step": offset + step, "stage": "distill", **found})
                    say(f"step {offset + step} (distill): {_line(found)}")
        c.logger.close()
    finally:
        parallel_state.destroy_model_parallel()
    return {"checkpoint": str(save_dir(cfg)), "curve": curve, "ended_per_step": ended,
            "estimator": cfg.algorithm.estimator}  # fmt: skip


def say(message: str) -> None:
    print(f"[compress] {message}", flush=True)
