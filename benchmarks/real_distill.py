"""Compress SmolLM2-135M-Instruct into a 10-layer student on a CPU: GNDPO vs OPD vs sequence KD.

    megatron-gndpo convert hf-to-mcore --out runs/smollm2/teacher \\
        --hf-dir ~/.cache/megatron_gndpo/real/smollm2-135m-instruct
    megatron-gndpo prune --teacher runs/smollm2/teacher --out runs/smollm2/student_10l \\
        --num-layers 10 --importance kl --calib-data examples/data/short_answers_train.jsonl \\
        --calib-new-tokens 32 --calib-samples 8
    python benchmarks/real_distill.py --out runs/smollm2/distill --seeds 2 --steps 24
    python benchmarks/real_distill.py --out runs/smollm2/starts --methods none \\
        --starts kl=runs/smollm2/student_10l,third=runs/smollm2/student_third

Every method starts from the same pruned student (``checkpoint.init`` of the example config
``examples/smollm2_135m_to_10l.yaml``, or ``--student``) and trains as many steps of 16
sequences (8 prompts x 2) with the same optimizer, on the same training questions and seeds:

- ``gndpo``, ``opd``: the trainer on that config with ``algorithm.estimator`` gndpo / opd: the
  student samples its answers, the teacher scores every sampled token.
- ``tropd``, ``vopd``: the trainer's TrOPD (the sampled-token score where the teacher supports
  the student's token, a forward KL to the teacher's top-20 where it does not) and vOPD (the
  score plus the exact top-k KL as a control variate), at their defaults (docs/methods/).
- ``kd``: sequence-level knowledge distillation (Kim & Rush 2016): the teacher's greedy answers
  to the training questions (its mode, as their beam search approximates it), written once, are
  the data of supervised fine-tuning (``sft/``), 16 sequences a step;
- ``kd_sampled``: the same with the teacher's samples at temperature 1 (2 per question, drawn
  once) instead: the distribution OPD matches, but SmolLM2-135M's samples are mostly wrong;
- ``kd_gndpo``: ``kd`` for the first ``--kd-steps`` steps, then GNDPO from that model for the
  rest (the same steps and sequences in all): KD teaches the answers' form (they end), on-policy
  distillation the rest, as Minitron-style recipes follow distillation with a second stage;
  ``kd_tropd`` the same with TrOPD as the second stage.

All of them are measured by one :class:`Evaluator` at step 0 and every ``--eval-interval`` steps
on the 64 held-out questions (``examples/data/short_answers_eval.jsonl``):

- ``agreement``: the student's greedy answer equals the teacher's greedy answer (lower case,
  punctuation and spacing aside);
- ``task``: the student's greedy answer is right (:func:`task_score`);
- ``reverse_kl``: the per-token KL(student || teacher) on 2 samples per question at temperature
  1, the same seeds at every evaluation (the trainer's ``eval/reverse_kl``);
- ``greedy_eos`` / ``sampled_eos``: the share of answers that end with ``<|im_end|>`` within the
  length limit, and their mean lengths (``greedy_length`` / ``sampled_length``, in tokens).

``--starts NAME=DIR,...`` measures pruned students without training them (``--methods none``):
how the choice of layers compares before any distillation. The output: ``OUT/curves.jsonl``
(one line a run), ``OUT/teacher.json`` (the teacher's own answers and scores, and the KD data),
``OUT/summary.md`` and ``OUT/curves.png``. One CPU process (gloo, world size 1). Every answer,
the teacher's included, is cut at the example's ``rollout.max_response_length`` (24 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.checkpoint.load import load_model
from megatron_gndpo.compress.answers import (  # noqa: F401  (the study's names for them)
    Question,
    first_sentence,
    load_questions,
    task_score,
    words,
)
from megatron_gndpo.compress.evaluate import (
    MEASURES,
    Answers,
    Evaluator,
    greedy_answers,
    measured_teacher,
    rollout_answers,
    sampling,
    teacher_scorer,
)
from megatron_gndpo.parallel.world import one_process_world
from megatron_gndpo.rollout.builtin import MegatronGenerator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402  (the checkout's benchmarks/, on the path above)
from benchmarks.common import say_measured  # noqa: E402

EXAMPLE = ROOT / "examples" / "smollm2_135m_to_10l.yaml"
EVAL_DATA = ROOT / "examples" / "data" / "short_answers_eval.jsonl"
_TOPK = "algorithm.estimator=topk_kd"
# The on-policy methods this study runs: the trainer's config overrides for each.
ON_POLICY: dict[str, tuple[str, ...]] = {
    "gndpo": ("algorithm.estimator=gndpo",),
    "opd": ("algorithm.estimator=opd",),
    "tropd": ("algorithm.estimator=tropd",),
    "vopd": ("algorithm.estimator=vopd",),
    # GNDPO with each answer weighted alike (not each token): is the drift the aggregation's?
    "gndpo_seqmean": ("algorithm.estimator=gndpo", "algorithm.aggregation=seq-mean-token-mean"),
    # GNDPO to the teacher sharpened to temperature 0.5 (its greedy answer is what is measured;
    # its samples at temperature 1 are mostly wrong): the evaluation's KL is to the teacher at 1
    "gndpo_sharp": ("algorithm.estimator=gndpo", "teacher.temperature=0.5"),
    # the divergences on the teacher's top-k (docs/methods/divergences.md), alone (GKD with
    # lmbda = 1, NeMo-RL's distillation) or beside GNDPO's sampled-token policy gradient
    "forward": (_TOPK, "algorithm.divergence.kind=forward"),
    "mixed": (_TOPK, "algorithm.divergence.kind=mixed"),
    "reverse_topk": (_TOPK, "algorithm.divergence.kind=reverse"),
    "gndpo_forward": (_TOPK, "algorithm.divergence.kind=forward",
                      "algorithm.divergence.policy_gradient=gndpo"),
    "gndpo_mixed": (_TOPK, "algorithm.divergence.kind=mixed",
                    "algorithm.divergence.policy_gradient=gndpo"),
    # the forward KL to the teacher cooled to temperature 0.3 on the student's own answers: close
    # to DAgger (the teacher's next token at every state the student visits), the on-policy
    # counterpart of KD on the teacher's greedy answers
    "forward_cold": (_TOPK, "algorithm.divergence.kind=forward", "teacher.temperature=0.3"),
    "gndpo_forward_cold": (_TOPK, "algorithm.divergence.kind=forward", "teacher.temperature=0.3",
                           "algorithm.divergence.policy_gradient=gndpo"),
    # RLVR: GRPO on the task's own reward (the reference in the first sentence), no teacher
    "rlvr": ("algorithm.estimator=grpo", "data.answer_key=reference",
             "data.answer_match=first_sentence"),
}  # fmt: skip
# the example's recipe at a fifth of the learning rate: after KD, a smaller step from its plateau
ON_POLICY["gndpo_forward_cold_lr1e5"] = (*ON_POLICY["gndpo_forward_cold"], "optimizer.lr=1e-5")
# KD for --kd-steps, then the on-policy method after "kd_"
KD_THEN = tuple(f"kd_{m}" for m in ON_POLICY)
METHODS = (*ON_POLICY, "kd", "kd_sampled", *KD_THEN)
EVAL_SAMPLES = 2  # samples per held-out question for the reverse KL (128 in all)
KD_SAMPLES = 2  # teacher answers per training question: the rows a trainer step samples
SEED = 1234


# ---------------------------------------------------------------------------------------------
# The questions, how answers are scored and the held-out measures: the package's own
# (megatron_gndpo/compress/, which `megatron-gndpo compress` reports with).


# ---------------------------------------------------------------------------------------------
# The models and the runs


@dataclasses.dataclass(frozen=True)
class Settings:
    teacher: Path
    student: Path
    tokenizer: Path
    out: Path
    steps: int
    eval_interval: int
    seeds: tuple[int, ...]
    kd_steps: int  # kd_gndpo's and kd_tropd's KD part
    overrides: tuple[str, ...]  # dotted overrides of the example config, for every method


def method_overrides(method: str) -> tuple[str, ...]:
    """The trainer's overrides for a study method: its on-policy part's, or none (KD's runs read
    only the optimizer of the config)."""
    return ON_POLICY.get(method.removeprefix("kd_"), ())


def run_config(s: Settings, method: str, seed: int) -> Any:
    """The example config at ``s``'s paths, for ``method`` (gndpo/opd) or KD's optimizer; each
    model's depth and width are its own checkpoint's (a student pruned to another depth than
    the example's needs no ``model.num_layers`` override)."""
    from megatron_gndpo.config.loader import load_config

    ours = [
        *_architecture("model", s.student), *_architecture("teacher.model", s.teacher),
        f"checkpoint.init={s.student}", f"teacher.load={s.teacher}",
        f"data.tokenizer={s.tokenizer}", f"trainer.steps={s.steps}", f"trainer.seed={seed}",
        *method_overrides(method),
        f"logging.run_dir={s.out / f'{method}_s{seed}'}", "trainer.eval_interval=0",
        "checkpoint.save_interval=0", "data.eval=null",
    ]  # fmt: skip
    given = {o.split("=", 1)[0] for o in s.overrides}  # the user's own value wins
    return load_config(EXAMPLE, [o for o in ours if o.split("=", 1)[0] not in given]
                       + list(s.overrides))  # fmt: skip


def _architecture(section: str, checkpoint: Path) -> list[str]:
    """Overrides of ``section`` giving the depth and width the checkpoint was saved with."""
    from megatron_gndpo.checkpoint.convert import saved_model

    model = saved_model(checkpoint).model
    return [f"{section}.num_layers={model.num_layers}",
            f"{section}.ffn_hidden_size={model.ffn_hidden_size}"]  # fmt: skip


def kd_data(rollout: Any, tokenizer: Any, questions: Sequence[Question]) -> dict[str, Any]:
    """The teacher's answers of ``rollout`` as SFT sequences (prompt ids + response ids, its
    ``<|im_end|>`` included when it wrote one), with how good they are."""
    starts = rollout.prompt_lengths.tolist()
    answers = rollout_answers(rollout, tokenizer)
    asked = [questions[int(i)] for i in rollout.prompt_index.tolist()]
    return {
        "sequences": [{"tokens": rollout.tokens[i, :n].tolist(), "prompt_length": int(starts[i])}
                      for i, n in enumerate(rollout.lengths.tolist())],
        "task": statistics.fmean(
            task_score(q.task, t, q.reference) for q, t in zip(asked, answers.texts, strict=True)
        ),
        "eos": statistics.fmean(map(float, answers.finished)),
        "length": statistics.fmean(answers.lengths),
    }  # fmt: skip


def prepare(s: Settings, tokenizer: Any, max_new_tokens: int) -> dict[str, Any]:
    """Once (cached in ``OUT/teacher.json``): the teacher's greedy answers to the held-out
    questions and their scores, and KD's data: its greedy answers to the training questions
    (``kd``) and ``KD_SAMPLES`` samples of each at temperature 1 (``kd_sampled``)."""
    from megatron_gndpo import seeding

    path = s.out / "teacher.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    started = time.perf_counter()
    questions = load_questions(EVAL_DATA)
    train = load_questions(run_config(s, "kd", SEED).data.train)
    train_ids = [tokenizer.apply_chat_template(q.prompt) for q in train]
    with one_process_world(seed=SEED) as groups:
        teacher = load_model(s.teacher, groups, frozen=True)
        generator = MegatronGenerator.for_model(teacher, groups, tokenizer)
        ids = [tokenizer.apply_chat_template(q.prompt) for q in questions]
        answers = greedy_answers(generator, ids, tokenizer, max_new_tokens)
        greedy = generator.generate(
            train_ids, sampling(max_new_tokens, tokenizer.eos_id, 0.0), seeds=[0] * len(train)
        )
        sampled = generator.generate(
            train_ids, sampling(max_new_tokens, tokenizer.eos_id, 1.0, KD_SAMPLES),
            seeds=seeding.prompt_seeds(SEED, 0, 0, len(train)),
        )  # fmt: skip
    by_task: dict[str, list[float]] = {}
    for q, t in zip(questions, answers.texts, strict=True):
        by_task.setdefault(q.task, []).append(task_score(q.task, t, q.reference))
    found = {
        "answers": dataclasses.asdict(answers),
        "task": statistics.fmean(x for v in by_task.values() for x in v),
        "task_by_kind": {k: statistics.fmean(v) for k, v in by_task.items()},
        "greedy_eos": statistics.fmean(map(float, answers.finished)),
        "greedy_length": statistics.fmean(answers.lengths),
        "kd": kd_data(greedy, tokenizer, train),
        "kd_sampled": kd_data(sampled, tokenizer, train),
        "seconds": time.perf_counter() - started,
    }
    path.write_text(json.dumps(found) + "\n")
    return found


def run_trainer(s: Settings, method: str, seed: int, evaluate: Evaluator, *,
                offset: int = 0) -> dict[str, Any]:  # fmt: skip
    """An on-policy method through the trainer; evaluated at step 0 and every
    ``s.eval_interval``.

    ``offset``: steps already made from ``s.student`` (a KD_THEN method's KD part, measured
    there): the curve counts from it and the start is not measured again."""
    from megatron_gndpo.checks import validate
    from megatron_gndpo.trainer import Trainer

    cfg = run_config(s, method, seed)
    validate(cfg, 1)
    shutil.rmtree(cfg.logging.run_dir, ignore_errors=True)  # a fresh run, never a resume
    started = time.perf_counter()
    curve, trained, ended = [], [], []
    try:
        trainer = Trainer(cfg)
        c = trainer.c
        generator = MegatronGenerator.for_model(c.student, c.student_groups, c.tokenizer)

        teacher = measured_teacher(c, cfg, s.teacher)

        def measure(step: int) -> None:
            curve.append({"step": step, **evaluate(c.student, c.student_groups, generator,
                                                   teacher)})  # fmt: skip
            say_measured(method, seed, curve[-1])

        if not offset:
            measure(0)
        for step in range(offset + 1, offset + s.steps + 1):
            metrics = trainer.step()
            trained.append(metrics["tokens/step"])  # the response tokens sampled and trained on
            ended.append(metrics["finished/frac"])  # the share of the step's samples that ended
            if step % s.eval_interval == 0 or step == offset + s.steps:
                measure(step)
        c.logger.close()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return {"method": method, "seed": seed, "curve": curve,
            "seconds": time.perf_counter() - started,
            "response_tokens_per_step": statistics.fmean(trained),
            "ended_per_step": ended}  # fmt: skip


def run_kd(s: Settings, method: str, seed: int, evaluate: Evaluator, data: list[dict[str, Any]],
           tokenizer: Any, save: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Sequence-level KD: SFT of the student on the teacher's answers ``data`` (sft/),
    as many sequences a step as a trainer step samples, the trainer's optimizer; evaluated like
    the trainer's runs. ``save``: a checkpoint root the trained student is written to (a model
    the trainer's ``checkpoint.init`` loads)."""
    from megatron_gndpo.checkpoint.convert import describe_checkpoints, saved_model
    from megatron_gndpo.checkpoint.dist import resolve, save_checkpoint
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.engine.scoring import sequence_multiple
    from megatron_gndpo.sft import SFTSequence, build_sft_model, micro_batch, run_sft

    cfg = run_config(s, method, seed)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    sequences = [SFTSequence(tuple(d["tokens"]), d["prompt_length"]) for d in data]
    started = time.perf_counter()
    curve = []
    model_cfg = saved_model(s.student).model
    with one_process_world(seed=seed) as groups:
        m = build_sft_model(
            model_cfg, ParallelConfig(), groups,
            cfg.optimizer, vocab_size=tokenizer.vocab_size, steps=s.steps, seed=seed,
            init=resolve(s.student),
        )  # fmt: skip
        budget = cfg.trainer.scoring_token_budget
        teacher = teacher_scorer(load_model(s.teacher, groups, frozen=True), groups,
                                 tokenizer.vocab_size, budget)  # fmt: skip
        generator = MegatronGenerator.for_model(m.model, groups, tokenizer)

        def measure(step: int, metrics: dict[str, float] | None = None) -> None:
            if step == 0 or step % s.eval_interval == 0 or step == s.steps:
                curve.append({"step": step, **evaluate(m.model, groups, generator, teacher)})
                say_measured(method, seed, curve[-1])

        measure(0)
        multiple = sequence_multiple(m.model)
        run_sft(
            m, sequences, lambda batch: micro_batch(batch, tokenizer.pad_id, multiple),
            steps=s.steps, batch_size=rows, micro_batch_size=cfg.trainer.micro_batch_size,
            seed=seed, on_step=measure,
        )  # fmt: skip
        if save is not None:
            shutil.rmtree(save, ignore_errors=True)
            save_checkpoint(save, s.steps, m.model, model_config=model_cfg,
                            tokenizer=str(s.tokenizer))  # fmt: skip
            describe_checkpoints(save, model_cfg)  # the next stage reads its architecture
    per_sequence = statistics.fmean(len(q.tokens) - q.prompt_length for q in sequences)
    return {"method": method, "seed": seed, "curve": curve,
            "seconds": time.perf_counter() - started,
            "response_tokens_per_step": per_sequence * rows}  # fmt: skip


def run_kd_then(s: Settings, method: str, seed: int, evaluate: Evaluator,
                data: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:  # fmt: skip
    """``kd`` for ``s.kd_steps`` steps, then the on-policy method ``method`` names after ``kd_``
    (``kd_gndpo``: GNDPO) for the rest, from the model KD wrote."""
    if not 0 < s.kd_steps < s.steps:
        raise ValueError(f"{method} needs 0 < --kd-steps < --steps; got {s.kd_steps}, {s.steps}")
    saved = s.out / f"{method}_s{seed}_kd"
    # KD's own settings (the on-policy method's overrides, e.g. its learning rate, are its own)
    kd = run_kd(dataclasses.replace(s, steps=s.kd_steps), "kd", seed, evaluate, data,
                tokenizer, save=saved)  # fmt: skip
    rest = dataclasses.replace(s, student=saved, steps=s.steps - s.kd_steps)
    on = run_trainer(rest, method, seed, evaluate, offset=s.kd_steps)
    shutil.rmtree(saved, ignore_errors=True)
    tokens = (kd["response_tokens_per_step"] * s.kd_steps
              + on["response_tokens_per_step"] * rest.steps) / s.steps  # fmt: skip
    return {"method": method, "seed": seed, "curve": kd["curve"] + on["curve"],
            "seconds": kd["seconds"] + on["seconds"], "response_tokens_per_step": tokens,
            "kd_steps": s.kd_steps, "ended_per_step": on["ended_per_step"]}  # fmt: skip


def measure_starts(s: Settings, starts: dict[str, Path], evaluate: Evaluator,
                   tokenizer: Any, budget: int) -> list[dict[str, Any]]:  # fmt: skip
    """Each pruned student of ``starts`` measured as it is (step 0 of a run from it)."""
    out = []
    with one_process_world(seed=SEED) as groups:
        teacher = teacher_scorer(load_model(s.teacher, groups, frozen=True), groups,
                                 tokenizer.vocab_size, budget)  # fmt: skip
        for name, path in starts.items():
            started = time.perf_counter()
            net = load_model(path, groups, frozen=True)
            found = evaluate(net, groups, MegatronGenerator.for_model(net, groups, tokenizer),
                             teacher)  # fmt: skip
            prune = path / "prune.json"
            layers = json.loads(prune.read_text())["keep_layers"] if prune.is_file() else None
            out.append({"start": name, "dir": str(path), "keep_layers": layers, **found,
                        "seconds": time.perf_counter() - started})  # fmt: skip
            say_measured(name, SEED, found)
            del net
    return out


# ---------------------------------------------------------------------------------------------
# The report


def mean_curves(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per method, per evaluated step: each measure's mean over seeds (and ``KEY_sd``)."""
    return common.mean_curves(runs, MEASURES)


def markdown(runs: Sequence[dict[str, Any]], teacher: dict[str, Any]) -> str:
    curves = mean_curves(runs)
    lines = [
        f"Teacher (SmolLM2-135M-Instruct, 30 layers), greedy on the held-out questions: task "
        f"{teacher['task']:.3f} ("
        + ", ".join(f"{k} {v:.2f}" for k, v in teacher["task_by_kind"].items())
        + f"), EOS {teacher['greedy_eos']:.2f}, length {teacher['greedy_length']:.1f}. KD data "
        + "; ".join(
            f"{m}: task {teacher[m]['task']:.3f}, EOS {teacher[m]['eos']:.2f}, length "
            f"{teacher[m]['length']:.1f}"
            for m in ("kd", "kd_sampled")
        )
        + " (on the training questions).",
        "",
        "| method | step | reverse KL | agreement | task | greedy EOS | sampled EOS | greedy len "
        "| sampled len |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, steps in curves.items():
        for step, r in steps.items():
            cells = [f"{r[k]:.3f} ± {r[k + '_sd']:.3f}" if k != "greedy_length" and
                     k != "sampled_length" else f"{r[k]:.1f}" for k in MEASURES]  # fmt: skip
            lines.append(f"| {method} | {step} | " + " | ".join(cells) + " |")
    tokens = {m: statistics.fmean(r["response_tokens_per_step"] for r in runs if r["method"] == m)
              for m in curves}  # fmt: skip
    lines += ["", "Mean ± sd over seeds " + ", ".join(
        f"{m}: {sorted({r['seed'] for r in runs if r['method'] == m})}" for m in curves
    ) + ". Wall time per run: " + ", ".join(
        f"{r['method']} s{r['seed']} {r['seconds']:.0f} s" for r in runs
    ) + ". Response tokens trained on per step: " + ", ".join(
        f"{m} {n:.0f}" for m, n in tokens.items()
    ) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    panels = (("reverse_kl", "held-out reverse KL (nats/token)"),
              ("agreement", "greedy answer = teacher's"), ("task", "task score (greedy)"),
              ("greedy_eos", "greedy answers ending in <|im_end|>"))  # fmt: skip
    colours = {"gndpo": "tab:blue", "opd": "tab:orange", "kd": "tab:green",
               "kd_sampled": "tab:olive", "kd_gndpo": "tab:purple",
               "tropd": "tab:red", "vopd": "tab:brown", "kd_tropd": "tab:pink"}  # fmt: skip
    common.plot_curves(runs, MEASURES, panels, colours, path)


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/smollm2/distill"),
        help="results directory; a (method, seed) already in OUT/curves.jsonl is kept, not run "
        "again (delete the file for a fresh study)",
    )  # fmt: skip
    parser.add_argument("--teacher", type=Path, default=None, help="default: the example's")
    parser.add_argument("--student", type=Path, default=None, help="default: the example's")
    parser.add_argument("--methods", default="gndpo,opd,kd,kd_sampled",
                        help="or none (with --starts)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-interval", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--kd-steps", type=int, default=None,
                        help="KD steps of kd_gndpo/kd_tropd (default: steps // 4)")  # fmt: skip
    parser.add_argument("--starts", default="", help="NAME=DIR,... pruned students to measure")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the example config")
    args = parser.parse_args(argv)

    from megatron_gndpo.compat import notices
    from megatron_gndpo.config.loader import load_config
    from megatron_gndpo.data.tokenizer import load_tokenizer
    from megatron_gndpo.parallel.world import distributed_world

    notices.quiet_known_notices()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    example = load_config(EXAMPLE, list(args.overrides))
    s = Settings(
        teacher=args.teacher or Path(str(example.teacher.load)),
        student=args.student or Path(str(example.checkpoint.init)),
        tokenizer=Path(str(example.data.tokenizer)), out=args.out, steps=args.steps,
        eval_interval=args.eval_interval, seeds=tuple(range(SEED, SEED + args.seeds)),
        overrides=tuple(args.overrides),
        kd_steps=args.kd_steps if args.kd_steps is not None else max(args.steps // 4, 1),
    )  # fmt: skip
    methods = [m for m in args.methods.split(",") if m and m != "none"]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)} or none")
    if set(methods) & set(KD_THEN) and not 0 < s.kd_steps < s.steps:
        parser.error(f"{'/'.join(KD_THEN)} need 0 < --kd-steps < --steps; got --kd-steps "
                     f"{s.kd_steps} and --steps {s.steps}")  # fmt: skip
    s.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(s.tokenizer))
    max_new, budget = example.rollout.max_response_length, example.trainer.scoring_token_budget
    with distributed_world(alone="the benchmark"):
        teacher = prepare(s, tokenizer, max_new)
        answers = Answers(**teacher["answers"])
        evaluate = Evaluator(
            tokenizer,
            load_questions(EVAL_DATA),
            answers,
            max_new_tokens=max_new,
            token_budget=budget,
            samples=EVAL_SAMPLES,
            seed=SEED,
        )
        if args.starts:
            pairs = (x.split("=", 1) for x in args.starts.split(","))
            starts = {name: Path(path) for name, path in pairs}
            found = measure_starts(s, starts, evaluate, tokenizer, budget)
            (s.out / "starts.json").write_text(json.dumps(found, indent=2) + "\n")
        curves = s.out / "curves.jsonl"  # the runs already made are kept, not run again
        runs = [json.loads(x) for x in curves.read_text().splitlines()] if curves.is_file() else []
        for seed in s.seeds:  # seed by seed: a cut-short study still compares the methods
            for method in methods:
                if any(r["method"] == method and r["seed"] == seed for r in runs):
                    print(f"[{method} s{seed}] kept from {curves}")
                    continue
                if method in KD_THEN:
                    data = teacher["kd"]["sequences"]
                    run = run_kd_then(s, method, seed, evaluate, data, tokenizer)
                elif method.startswith("kd"):
                    data = teacher[method]["sequences"]
                    run = run_kd(s, method, seed, evaluate, data, tokenizer)
                else:
                    run = run_trainer(s, method, seed, evaluate)
                runs.append(run)
                with curves.open("a") as f:
                    f.write(json.dumps(run) + "\n")
    if runs:
        (s.out / "summary.md").write_text(markdown(runs, teacher))
        plot(runs, s.out / "curves.png")
        print((s.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
