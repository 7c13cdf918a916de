"""On-policy context distillation of SmolLM2-135M-Instruct on a CPU: the model teaches itself to
answer without three worked examples as it answers with them.

    megatron-gndpo convert hf-to-mcore --out runs/smollm2/model \\
        --hf-dir ~/.cache/megatron_gndpo/real/smollm2-135m-instruct
    python benchmarks/context_distill.py --out runs/context --seeds 2 --steps 24

The questions are the short-answer questions of ``examples/data/short_answers_*.jsonl``
(capitals, opposites, plurals, repeating a sentence), each asking for the answer alone ("Answer
with the city name only."). Asked plainly, the model answers in a sentence ("The capital of
Israel is Jerusalem."); shown three questions of the same kind with their short answers as
earlier turns of the conversation, it answers with the name alone. Every row of the data
written to ``OUT/data/`` holds the question (``prompt``: what the student sees) and, for the
teacher only, those three examples (``q1``/``a1`` ... ``q3``/``a3``, training questions of the
same kind, never the question itself).

Every method starts from the model itself and trains as many steps of 16 sequences (8 questions
x 2) with the same optimizer, on the same training questions and seeds
(``examples/smollm2_135m_context.yaml``):

- ``gndpo``: the trainer with ``teacher.weights=initial`` and ``teacher.context`` (the three
  examples as turns): the student samples its answer to the plain question; the model with the
  examples, frozen, scores every sampled token;
- ``sft``: supervised fine-tuning (``sft/``) on the teacher's greedy answers (the model with the
  examples) to the training questions, written once, put after the plain question: the same
  number of sequences a step.

Measured at step 0 and every ``--eval-interval`` steps on the 64 held-out questions, always
without the examples (the student's view): ``exact`` (the greedy answer is the reference alone,
case and punctuation aside: what the examples teach), ``task`` (the reference is somewhere in
the answer), ``eos`` (the answer ends with ``<|im_end|>`` within 24 tokens), ``length`` (response
tokens). The teacher's row: the same questions answered with the examples. Also the cost of the
teacher's longer rows: the trainer's ``time/teacher_logprobs`` against ``time/old_logprobs``.
Output: ``OUT/curves.jsonl`` (a line a run), ``OUT/teacher.json``, ``OUT/summary.md``,
``OUT/curves.png``. One CPU process (gloo, world size 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402  (the checkout's benchmarks/, on the path above)
from benchmarks.common import say_measured  # noqa: E402

EXAMPLE = ROOT / "examples" / "smollm2_135m_context.yaml"
SOURCES = {"train": "short_answers_train.jsonl", "eval": "short_answers_eval.jsonl"}
SHOTS = 3  # worked examples the teacher sees, as earlier turns
METHODS = ("gndpo", "sft")
MEASURES = ("exact", "task", "eos", "length")
SEED = 1234
MAX_NEW_TOKENS = 24


# ---------------------------------------------------------------------------------------------
# The data and how answers are scored


def words(text: str) -> list[str]:
    """Lower-case words of ``text``; punctuation, quotes and spacing dropped."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def scores(answer: str, reference: str) -> tuple[float, float]:
    """``(exact, task)``: the answer is the reference alone; the reference is in it."""
    said, wanted = words(answer), words(reference)
    n = len(wanted)
    inside = any(said[i : i + n] == wanted for i in range(len(said) - n + 1))
    return float(said == wanted), float(inside)


def write_data(out: Path) -> dict[str, Path]:
    """``OUT/data/{train,eval}.jsonl``: each question with three training questions of its
    kind and their short answers (never itself), drawn with a fixed seed."""
    source = ROOT / "examples" / "data"
    train = [json.loads(x) for x in (source / SOURCES["train"]).read_text().splitlines() if x]
    by_task: dict[str, list[dict[str, str]]] = {}
    for row in train:
        by_task.setdefault(row["task"], []).append(row)
    rng = random.Random(SEED)
    paths = {}
    (out / "data").mkdir(parents=True, exist_ok=True)
    for split, name in SOURCES.items():
        rows = [json.loads(x) for x in (source / name).read_text().splitlines() if x]
        with (out / "data" / f"{split}.jsonl").open("w") as f:
            for row in rows:
                others = [r for r in by_task[row["task"]] if r["prompt"] != row["prompt"]]
                shots = rng.sample(others, SHOTS)
                record = dict(row)
                for k, shot in enumerate(shots, 1):
                    record[f"q{k}"], record[f"a{k}"] = shot["prompt"], shot["reference"]
                f.write(json.dumps(record) + "\n")
        paths[split] = out / "data" / f"{split}.jsonl"
    return paths


# ---------------------------------------------------------------------------------------------
# Measuring a model


@dataclasses.dataclass
class Evaluator:
    """The held-out measures of the module docstring, for any model: greedy answers to the
    questions' ``ids`` (the student's prompts, or the teacher's with its examples)."""

    tokenizer: Any
    references: list[str]
    ids: list[list[int]]

    def __call__(self, model: Any, groups: Any) -> dict[str, float]:
        from megatron_gndpo.rollout.builtin import MegatronGenerator
        from megatron_gndpo.rollout.greedy import greedy_answers

        tok = self.tokenizer
        answers = greedy_answers(
            MegatronGenerator.for_model(model, groups, tok), self.ids,
            max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(tok.eos_id,),
        )  # fmt: skip
        texts = [tok.decode([t for t in a.response if t != tok.eos_id]) for a in answers]
        found = [scores(t, r) for t, r in zip(texts, self.references, strict=True)]
        return {
            "exact": statistics.fmean(e for e, _ in found),
            "task": statistics.fmean(t for _, t in found),
            "eos": statistics.fmean(float(a.finished) for a in answers),
            "length": statistics.fmean(len(a.response) for a in answers),
            "examples": texts[:4],  # type: ignore[dict-item]
        }


def prompt_ids(path: Path, cfg: Any, tokenizer: Any, teacher: bool) -> list[list[int]]:
    """Each row's prompt ids: the student's plain question, or (``teacher``) the teacher's
    conversation with its examples (``teacher.context``)."""
    from megatron_gndpo.data.datasets import load_prompts
    from megatron_gndpo.data.prompt_sets import context_fields
    from megatron_gndpo.teacher.context import prompt_ids as teacher_prompt

    rows = load_prompts(str(path), fields=context_fields(cfg))
    if not teacher:
        return [tokenizer.apply_chat_template(r.prompt) for r in rows]
    return [teacher_prompt(tokenizer, cfg.teacher.context, r) for r in rows]


def references(path: Path) -> list[str]:
    return [json.loads(x)["reference"] for x in path.read_text().splitlines() if x]


# ---------------------------------------------------------------------------------------------
# The runs


@dataclasses.dataclass(frozen=True)
class Settings:
    model: Path
    out: Path
    data: dict[str, Path]
    steps: int
    eval_interval: int
    overrides: tuple[str, ...]


def run_config(s: Settings, method: str, seed: int) -> Any:
    from megatron_gndpo.config.loader import load_config

    ours = [
        f"checkpoint.init={s.model}", f"data.tokenizer={s.model}", f"data.train={s.data['train']}",
        f"trainer.steps={s.steps}", f"trainer.seed={seed}",
        f"logging.run_dir={s.out / f'{method}_s{seed}'}", "trainer.eval_interval=0",
        "checkpoint.save_interval=0", "data.eval=null",
    ]  # fmt: skip
    given = {o.split("=", 1)[0] for o in s.overrides}  # the user's own value wins
    kept = [o for o in ours if o.split("=", 1)[0] not in given]
    return load_config(EXAMPLE, kept + list(s.overrides))


def run_gndpo(s: Settings, seed: int, evaluate: Evaluator) -> dict[str, Any]:
    """Context distillation through the trainer, evaluated at step 0 and every interval."""
    from megatron_gndpo.checks import validate
    from megatron_gndpo.trainer import Trainer

    cfg = run_config(s, "gndpo", seed)
    validate(cfg, 1)
    shutil.rmtree(cfg.logging.run_dir, ignore_errors=True)  # a fresh run, never a resume
    started, curve, times = time.perf_counter(), [], []
    try:
        trainer = Trainer(cfg)
        c = trainer.c
        curve.append({"step": 0, **evaluate(c.student, c.student_groups)})
        say_measured("gndpo", seed, curve[-1])
        for step in range(1, s.steps + 1):
            m = trainer.step()
            times.append({k: m[k] for k in ("time/teacher_logprobs", "time/old_logprobs")})
            if step % s.eval_interval == 0 or step == s.steps:
                curve.append({"step": step, **evaluate(c.student, c.student_groups)})
                say_measured("gndpo", seed, curve[-1])
        c.logger.close()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    cost = {k: statistics.fmean(t[k] for t in times) for k in times[0]}
    return {"method": "gndpo", "seed": seed, "curve": curve,
            "seconds": time.perf_counter() - started, "cost": cost}  # fmt: skip


def run_sft(s: Settings, seed: int, evaluate: Evaluator, data: list[dict[str, Any]],
            tokenizer: Any) -> dict[str, Any]:  # fmt: skip
    """SFT on the teacher's answers after the plain questions, as many sequences a step as a
    trainer step samples, the trainer's optimizer."""
    from megatron_gndpo.checkpoint.convert import saved_model
    from megatron_gndpo.checkpoint.dist import resolve
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.engine.scoring import sequence_multiple
    from megatron_gndpo.parallel.world import one_process_world
    from megatron_gndpo.sft import SFTSequence, build_sft_model, micro_batch
    from megatron_gndpo.sft import run_sft as sft

    cfg = run_config(s, "sft", seed)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    sequences = [SFTSequence(tuple(d["tokens"]), d["prompt_length"]) for d in data]
    started, curve = time.perf_counter(), []
    with one_process_world(seed=seed) as groups:
        m = build_sft_model(
            saved_model(s.model).model, ParallelConfig(), groups, cfg.optimizer,
            vocab_size=tokenizer.vocab_size, steps=s.steps, seed=seed, init=resolve(s.model),
        )  # fmt: skip

        def measure(step: int, metrics: dict[str, float] | None = None) -> None:
            if step == 0 or step % s.eval_interval == 0 or step == s.steps:
                curve.append({"step": step, **evaluate(m.model, groups)})
                say_measured("sft", seed, curve[-1])

        measure(0)
        multiple = sequence_multiple(m.model)
        sft(
            m, sequences, lambda batch: micro_batch(batch, tokenizer.pad_id, multiple),
            steps=s.steps, batch_size=rows, micro_batch_size=cfg.trainer.micro_batch_size,
            seed=seed, on_step=measure,
        )  # fmt: skip
    return {"method": "sft", "seed": seed, "curve": curve,
            "seconds": time.perf_counter() - started}  # fmt: skip


def prepare(s: Settings, tokenizer: Any, cfg: Any) -> dict[str, Any]:
    """Once (cached in ``OUT/teacher.json``): the teacher (the model with the examples) on the
    held-out questions, and its greedy answers to the training questions: SFT's data, each put
    after the plain question."""
    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.parallel.world import one_process_world
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.rollout.greedy import greedy_answers

    path = s.out / "teacher.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    started = time.perf_counter()
    teacher = Evaluator(
        tokenizer, references(s.data["eval"]), prompt_ids(s.data["eval"], cfg, tokenizer, True)
    )
    plain = prompt_ids(s.data["train"], cfg, tokenizer, False)
    with_examples = prompt_ids(s.data["train"], cfg, tokenizer, True)
    with one_process_world(seed=SEED) as groups:
        model = load_model(s.model, groups, frozen=True)
        found = teacher(model, groups)
        answers = greedy_answers(
            MegatronGenerator.for_model(model, groups, tokenizer), with_examples,
            max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(tokenizer.eos_id,),
        )  # fmt: skip
    sequences = [
        {"tokens": [*p, *a.response], "prompt_length": len(p)}
        for p, a in zip(plain, answers, strict=True)
        if a.response
    ]
    refs = references(s.data["train"])
    texts = [tokenizer.decode([t for t in a.response if t != tokenizer.eos_id]) for a in answers]
    train_scores = [scores(t, r) for t, r in zip(texts, refs, strict=True)]
    found |= {
        "sft_data": sequences,
        "sft_exact": statistics.fmean(e for e, _ in train_scores),
        "sft_eos": statistics.fmean(float(a.finished) for a in answers),
        "seconds": time.perf_counter() - started,
    }
    path.write_text(json.dumps(found) + "\n")
    return found


# ---------------------------------------------------------------------------------------------
# The report


def mean_curves(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per method, per evaluated step: each measure's mean over seeds (and ``KEY_sd``)."""
    return common.mean_curves(runs, MEASURES)


def markdown(runs: Sequence[dict[str, Any]], teacher: dict[str, Any]) -> str:
    lines = [
        f"Teacher (the model with the three examples), greedy on the held-out questions: exact "
        f"{teacher['exact']:.3f}, task {teacher['task']:.3f}, EOS {teacher['eos']:.2f}, length "
        f"{teacher['length']:.1f}. SFT's data (its answers to the training questions): exact "
        f"{teacher['sft_exact']:.3f}, EOS {teacher['sft_eos']:.2f}.",
        "",
        "| method | step | exact | task | EOS | length |",
        "|---|---|---|---|---|---|",
    ]
    for method, steps in mean_curves(runs).items():
        for step, r in steps.items():
            cells = [f"{r[k]:.3f} ± {r[k + '_sd']:.3f}" for k in ("exact", "task", "eos")]
            lines.append(f"| {method} | {step} | {' | '.join(cells)} | {r['length']:.1f} |")
    lines += ["", "Mean ± sd over seeds. Wall time per run: " + ", ".join(
        f"{r['method']} s{r['seed']} {r['seconds']:.0f} s" for r in runs
    ) + "."]  # fmt: skip
    costs = [r["cost"] for r in runs if "cost" in r]
    if costs:
        t = statistics.fmean(c["time/teacher_logprobs"] for c in costs)
        o = statistics.fmean(c["time/old_logprobs"] for c in costs)
        lines.append(
            f"The teacher's pass over its longer rows: {t:.2f} s a step against the student's "
            f"{o:.2f} s over its own ({t / o:.2f}x), mean over the GNDPO runs' steps."
        )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], teacher: dict[str, Any], path: Path) -> None:
    panels = (("exact", "answer alone (exact)"), ("task", "answer anywhere"),
              ("length", "answer length (tokens)"))  # fmt: skip
    colours = {"gndpo": "tab:blue", "sft": "tab:green"}
    common.plot_curves(
        runs, MEASURES, panels, colours, path, reference=(teacher, "with the examples")
    )


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/context"),
        help="results; a (method, seed) already in OUT/curves.jsonl is kept, not run again",
    )  # fmt: skip
    parser.add_argument("--model", type=Path, default=Path("runs/smollm2/model"),
                        help="SmolLM2-135M-Instruct converted by convert hf-to-mcore")  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-interval", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--data-only", action="store_true", help="write OUT/data/ and stop")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the example config")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS):
        parser.error(f"--methods takes {', '.join(METHODS)}, got {args.methods!r}")
    data = write_data(args.out)
    if args.data_only:
        print(f"wrote {data['train']} and {data['eval']}")
        return 0
    if not (args.model / "latest").is_file():
        parser.error(
            f"--model {args.model} holds no checkpoint; convert the model first: megatron-gndpo "
            "convert hf-to-mcore --out runs/smollm2/model --hf-dir "
            "~/.cache/megatron_gndpo/real/smollm2-135m-instruct"
        )

    from megatron_gndpo.compat import notices
    from megatron_gndpo.data.tokenizer import load_tokenizer
    from megatron_gndpo.parallel.world import distributed_world

    notices.quiet_known_notices()
    s = Settings(args.model, args.out, data, args.steps, args.eval_interval, tuple(args.overrides))
    tokenizer = load_tokenizer(str(args.model))
    cfg = run_config(s, "gndpo", SEED)
    student_view = Evaluator(
        tokenizer, references(data["eval"]), prompt_ids(data["eval"], cfg, tokenizer, False)
    )
    curves = args.out / "curves.jsonl"
    done = [json.loads(x) for x in curves.read_text().splitlines()] if curves.is_file() else []
    with distributed_world(alone="the benchmark"):
        teacher = prepare(s, tokenizer, cfg)
        say_measured("teacher", SEED, teacher)
        for seed in range(SEED, SEED + args.seeds):
            for method in methods:
                if any((r["method"], r["seed"]) == (method, seed) for r in done):
                    continue
                if method == "gndpo":
                    run = run_gndpo(s, seed, student_view)
                else:
                    run = run_sft(s, seed, student_view, teacher["sft_data"], tokenizer)
                done.append(run)
                with curves.open("a") as f:
                    f.write(json.dumps(run) + "\n")
    runs = [r for r in done if r["method"] in methods]
    (args.out / "summary.md").write_text(markdown(runs, teacher))
    plot(runs, teacher, args.out / "curves.png")
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
