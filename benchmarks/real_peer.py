"""An independent peer on the real model: TRL's on-policy distillation of SmolLM2's pruned student,
measured by benchmarks/real_distill.py's own ``Evaluator``.

    PYTHONPATH=. python benchmarks/real_peer.py --out runs/real_peer \\
        --student runs/smollm2/student_24l \\
        --teacher-hf ~/.cache/megatron_gndpo/real/smollm2-135m-instruct \\
        --steps 24 --eval-interval 6 --seeds 2 --reference runs/smollm2/distill
    cat runs/real_peer/curves.jsonl >> runs/smollm2/distill/curves.jsonl   # beside ours

(the check of this module: ``--steps 2 --eval-interval 1 --seeds 1``. On 2 CPU cores shared
with two other runs it took 1,681 s: a training step 112 s, an evaluation 484 s; with the
checks before it (~5 min), 24 steps x 2 seeds at ``--eval-interval 6`` come to ~3 h there.)

The pruned student (an mcore checkpoint, ``megatron-gndpo prune``) is exported to Hugging Face
once (``convert mcore-to-hf``, into ``OUT/hf/``); the teacher is SmolLM2-135M-Instruct's own HF
files, the source of real_distill's mcore teacher. Before training, two checks: the tokenizer's
chat template gives TRL the ids ours gives (``learning_peer.check_same_ids``), and the exported
student's greedy answers to the first ``--check-greedy`` held-out questions equal our
``MegatronGenerator``'s on the mcore student (real_distill's greedy path). With ``--reference``
(a real_distill OUT), the teacher's greedy answers here are also compared with its
``teacher.json``.

The run, ``trl_gkd``: TRL's ``DistillationTrainer`` (trl 1.16), GKD at ``lmbda=1``: every step
the student samples its answers (one completion a row, each question given as 2 consecutive rows:
8 questions x 2 = 16 sequences, real_distill's batch) and the loss is the full-vocabulary
per-token divergence at every sampled position, averaged over the batch's tokens. ``beta=1``:
TRL's generalized JSD at beta 1 is the reverse KL(p_S || p_T), whose per-token value is what
real_distill's ``reverse_kl`` estimates from samples (and OPD/GNDPO minimise); beta 0 would be
the forward KL, mode-covering, another objective. The experimental ``GKDTrainer`` at
``lmbda=1`` is the same loss (its own warning says ``DistillationTrainer`` covers it) behind a
ChatML collator that wants assistant turns this data has not. Its optimizer is real_distill's:
Adam (AdamW, weight decay 0), lr 5e-5 constant, grad-norm clip 1.0; temperature 1, top-k/top-p
off, at most ``--max-new-tokens`` (48) new tokens, ``<|im_end|>`` ends an answer; the same
steps and seeds (1234, 1235, ...). The questions of each step: epochs of the training set, each
shuffled by the seed (``learning_peer._drawn_prompts``; ours draws its own order).

Measured at step 0, every ``--eval-interval`` steps and the last by real_distill's
``Evaluator`` itself: only its two model hooks are transformers here (:class:`HFGenerator`, the
greedy and sampled answers; :func:`token_logprobs`, the log-probs of the reverse KL), so task,
agreement (with the teacher's greedy answers, by this HF teacher), EOS rates, lengths and the
reverse KL are its code. Greedy measures must equal real_distill's at step 0; the sampled ones
differ by the sampler's draws (one torch stream for the batch, seeded by the evaluation's first
seed, not ours per prompt). ``OUT/curves.jsonl``: one line a run in real_distill's schema
(``method``, ``seed``, ``curve``, ``seconds``, ``response_tokens_per_step``, and
``ended_per_step``, ``eval_seconds``); a (method, seed) already there is kept, not run again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import learning_peer, real_distill  # noqa: E402
from benchmarks.common import say_measured  # noqa: E402
from megatron_gndpo.compress.evaluate import TeacherLogprobs  # noqa: E402
from megatron_gndpo.rollout.base import InPlaceGenerator, Rollout, SamplingParams  # noqa: E402

METHOD = "trl_gkd"
TRAIN_DATA = ROOT / "examples" / "data" / "short_answers_train.jsonl"
TEACHER_HF = Path("~/.cache/megatron_gndpo/real/smollm2-135m-instruct").expanduser()


# ---------------------------------------------------------------------------------------------
# real_distill's evaluator over transformers models


def rollout_from(out: torch.Tensor, width: int, prompts: Sequence[Sequence[int]], samples: int,
                 stops: Sequence[int], pad: int) -> Rollout:  # fmt: skip
    """``generate``'s output (``[N, width + T]``, prompts left-padded to ``width``, rows
    ``samples`` a prompt in order) as a :class:`Rollout`: each row its prompt then its response
    up to and including the first stop token (``finished``), right-padded with ``pad``."""
    rows, finished = [], []
    for i, response in enumerate(out[:, width:].tolist()):
        end = next((t for t, x in enumerate(response) if x in stops), None)
        finished.append(end is not None)
        rows.append(list(prompts[i // samples]) + response[: len(response) if end is None
                                                           else end + 1])  # fmt: skip
    lengths = [len(r) for r in rows]
    tokens = torch.full((len(rows), max(lengths)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return Rollout(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(prompts[i // samples]) for i in range(len(rows))]),
        lengths=torch.tensor(lengths), sampler_logprobs=torch.zeros(tokens.shape),
        prompt_index=torch.arange(len(rows)) // samples, finished=torch.tensor(finished),
    )  # fmt: skip


class HFGenerator(InPlaceGenerator):
    """The rollout generator protocol over a transformers causal LM (prompts left-padded, one
    batch). Greedy at temperature 0; else one torch stream for the batch, seeded by ``seeds[0]``
    on a forked RNG (the caller's draws are left as they were)."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], images: Any = None) -> Rollout:  # fmt: skip
        if images is not None:
            raise ValueError("HFGenerator is text only")
        k = params.samples_per_prompt
        rows = [list(p) for p in prompts for _ in range(k)]
        width = max(map(len, rows))
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        greedy = params.temperature == 0.0
        sampling = {} if greedy else {"temperature": params.temperature, "top_k": params.top_k,
                                      "top_p": params.top_p}  # fmt: skip
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(int(seeds[0]) if len(seeds) else 0)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                do_sample=not greedy, eos_token_id=list(params.stop_token_ids),
                pad_token_id=self.pad_id, **sampling,
            )  # fmt: skip
        return rollout_from(out, width, prompts, k, params.stop_token_ids, self.pad_id)


def token_logprobs(model: Any) -> TeacherLogprobs:
    """``(tokens [B, S] right-padded, lengths [B]) -> [B, S]``: ``log p(tokens[b, t] |
    tokens[b, :t])`` for ``1 <= t < lengths[b]``, 0 at t = 0 and at padding (``score_tokens``'
    layout), in float32."""

    def score(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
        with torch.no_grad():
            logits = model(input_ids=tokens, attention_mask=mask.long()).logits
        lp = logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        out[:, 1:] = lp
        return out.masked_fill(~mask, 0.0)

    return score


class HFEvaluator(real_distill.Evaluator):
    """real_distill's :class:`~benchmarks.real_distill.Evaluator`, its student's log-probs from
    a transformers model (``net``) instead of megatron's ``score_tokens``."""

    def reverse_kl(self, net: Any, groups: Any, rollout: Any,
                   teacher: TeacherLogprobs) -> float:  # fmt: skip
        from megatron_gndpo.algorithms.metrics import sampled_eval_metrics

        student = token_logprobs(net)(rollout.tokens, rollout.lengths)
        found = sampled_eval_metrics(
            teacher(rollout.tokens, rollout.lengths), student, rollout.response_mask, None
        )
        return found["eval/reverse_kl"]

    def measure(self, model: Any, teacher: Any) -> dict[str, float]:
        """The measures of the transformers ``model`` against the transformers ``teacher``."""
        generator = HFGenerator(model, self.tok.pad_id)
        return self(model, None, generator, token_logprobs(teacher))


# ---------------------------------------------------------------------------------------------
# The models and the checks


@contextlib.contextmanager
def megatron_world() -> Iterator[Any]:
    """``one_process_world``'s groups, and this process's environment as it was once it ends:
    the world leaves torchrun's variables behind, from which TRL (accelerate) would wrap the
    student in a one-process DDP."""
    from megatron_gndpo.parallel.world import one_process_world

    environ = dict(os.environ)
    try:
        with one_process_world(seed=real_distill.SEED, alone="the benchmark") as groups:
            yield groups
    finally:
        os.environ.clear()
        os.environ.update(environ)


def export_student(mcore: Path, target: Path) -> Path:
    """The mcore student as a Hugging Face (Llama) directory, once (its vocabulary, 49,152, is
    already a multiple of megatron's padding: nothing to cut)."""
    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf

    if not (target / "config.json").is_file():
        with megatron_world():
            convert_mcore_to_hf(mcore, target, family="llama", dtype="fp32", tokenizer_dir=mcore)
    return target


def teacher_answers(teacher_dir: Path, tok: Any, questions: Sequence[Any],
                    max_new_tokens: int) -> real_distill.Answers:  # fmt: skip
    """The HF teacher's greedy answers to the held-out questions (agreement's reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    ids = [tok.apply_chat_template(q.prompt) for q in questions]
    return real_distill.greedy_answers(HFGenerator(model, tok.pad_id), ids, tok, max_new_tokens)


def greedy_mismatches(ours: real_distill.Answers, theirs: real_distill.Answers) -> list[int]:
    """The questions whose greedy answers differ (text, ending or length)."""
    rows = (
        zip(*dataclasses.astuple(ours), strict=True),
        zip(*dataclasses.astuple(theirs), strict=True),
    )
    return [i for i, (a, b) in enumerate(zip(*rows, strict=True)) if a != b]


def check_greedy(mcore: Path, hf_dir: Path, tok: Any, questions: Sequence[Any],
                 max_new_tokens: int) -> int:  # fmt: skip
    """The exported student's greedy answers (transformers) to ``questions`` equal the mcore
    student's by our MegatronGenerator (real_distill's greedy path); exits when they do not."""
    from transformers import AutoModelForCausalLM

    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    ids = [tok.apply_chat_template(q.prompt) for q in questions]
    with megatron_world() as groups:
        net = load_model(mcore, groups, frozen=True)
        generator = MegatronGenerator.for_model(net, groups, tok)
        ours = real_distill.greedy_answers(generator, ids, tok, max_new_tokens)
        del net
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    theirs = real_distill.greedy_answers(HFGenerator(model, tok.pad_id), ids, tok, max_new_tokens)
    wrong = greedy_mismatches(ours, theirs)
    if wrong:
        pairs = [(ours.texts[i], theirs.texts[i]) for i in wrong]
        raise SystemExit(f"the exported student's greedy answers differ from megatron's on "
                         f"questions {wrong}: {pairs}")  # fmt: skip
    return len(ids)


# ---------------------------------------------------------------------------------------------
# The run


def run_peer(teacher_dir: Path, student_dir: Path, hf_tok: Any, prompts: list[str],
             evaluate: HFEvaluator, s: learning_peer.PeerSettings, seed: int, out: Path,
             max_new_tokens: int) -> dict[str, Any]:  # fmt: skip
    """TRL's DistillationTrainer at beta 1 on one seed, measured by ``evaluate``: a line of
    real_distill's curves.jsonl."""
    started = time.perf_counter()

    def evaluator(teacher: Any) -> Any:
        def measure(model: Any) -> dict[str, float]:
            found = evaluate.measure(model, teacher)
            say_measured(METHOD, seed, found)
            return found

        return measure

    # logged every step (each step's sampled lengths); no gradient checkpointing (TRL's default:
    # the same gradients, recomputed; slower on a CPU)
    changes = {"logging_steps": 1, "gradient_checkpointing": False}
    run = learning_peer.train_peer("trl", teacher_dir, student_dir, hf_tok, prompts, s, seed, out,
                                   max_new_tokens, evaluator, changes)  # fmt: skip
    steps = [x for x in run["logs"] if "completions/mean_length" in x]
    rows = s.prompts_per_step * s.samples_per_prompt
    return {"method": METHOD, "seed": seed, "curve": run["curve"],
            "seconds": time.perf_counter() - started,
            "response_tokens_per_step": statistics.fmean(
                x["completions/mean_length"] * rows for x in steps) if steps else 0.0,
            "ended_per_step": [1.0 - x["completions/clipped_ratio"] for x in steps],
            "eval_seconds": run["eval_seconds"], "train_seconds": run["seconds"]}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/real_peer"))
    parser.add_argument(
        "--student", type=Path, default=Path("runs/smollm2/student_24l"),
        help="the pruned student, mcore (exported to OUT/hf/NAME once)",
    )  # fmt: skip
    parser.add_argument("--teacher-hf", type=Path, default=TEACHER_HF)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-interval", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="real_distill's rollout.max_response_length")  # fmt: skip
    parser.add_argument(
        "--check-greedy", type=int, default=8,
        help="held-out questions whose greedy answers must equal megatron's",
    )  # fmt: skip
    parser.add_argument(
        "--reference", type=Path, default=None,
        help="a real_distill OUT: its teacher.json's greedy answers checked",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from megatron_gndpo.compat import notices
    from megatron_gndpo.data.tokenizer import load_tokenizer

    notices.quiet_known_notices()
    args.out.mkdir(parents=True, exist_ok=True)
    student_dir = export_student(args.student, args.out / "hf" / args.student.name)
    tok = load_tokenizer(str(args.teacher_hf))
    hf_tok = AutoTokenizer.from_pretrained(str(args.teacher_hf))
    hf_tok.padding_side = "left"
    prompts = [q.prompt for q in real_distill.load_questions(TRAIN_DATA)]
    learning_peer.check_same_ids(hf_tok, tok, prompts)
    questions = real_distill.load_questions(real_distill.EVAL_DATA)
    if args.check_greedy:
        started = time.perf_counter()
        n = check_greedy(args.student, student_dir, tok, questions[: args.check_greedy],
                         args.max_new_tokens)  # fmt: skip
        print(f"greedy answers of the exported student = megatron's on {n} questions "
              f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
    answers = teacher_answers(args.teacher_hf, tok, questions, args.max_new_tokens)
    if args.reference is not None:
        theirs = real_distill.Answers(**json.loads((args.reference / "teacher.json").read_text())
                                      ["answers"])  # fmt: skip
        wrong = greedy_mismatches(theirs, answers)
        print(f"teacher's greedy answers = {args.reference}/teacher.json's on "
              f"{len(questions) - len(wrong)} of {len(questions)} questions"
              + (f"; differ on {wrong}" if wrong else ""))  # fmt: skip
    evaluate = HFEvaluator(
        tok,
        questions,
        answers,
        max_new_tokens=args.max_new_tokens,
        token_budget=0,
        samples=real_distill.EVAL_SAMPLES,
        seed=real_distill.SEED,
    )
    s = learning_peer.PeerSettings(
        steps=args.steps, eval_interval=args.eval_interval, prompts_per_step=8,
        samples_per_prompt=2, lr=5e-5,
        seeds=tuple(range(real_distill.SEED, real_distill.SEED + args.seeds)),
    )  # fmt: skip
    curves = args.out / "curves.jsonl"
    runs = [json.loads(x) for x in curves.read_text().splitlines()] if curves.is_file() else []
    for seed in s.seeds:
        if any(r["method"] == METHOD and r["seed"] == seed for r in runs):
            print(f"[{METHOD} s{seed}] kept from {curves}")
            continue
        run = run_peer(args.teacher_hf, student_dir, hf_tok, prompts, evaluate, s, seed,
                       args.out, args.max_new_tokens)  # fmt: skip
        runs.append(run)
        with curves.open("a") as f:
            f.write(json.dumps(run) + "\n")
        evals = run["eval_seconds"]
        print(f"[{METHOD} s{seed}] {run['seconds']:.0f} s: training "
              f"{(run['train_seconds'] - sum(evals[1:])) / args.steps:.1f} s a step, "
              f"evaluation {statistics.fmean(evals):.1f} s each ({len(evals)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
