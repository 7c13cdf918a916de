"""An independent learning peer: TRL's on-policy distillation on the demo's models, beside ours.

    python benchmarks/learning_peer.py --out runs/peer --cache-dir runs/demo/cache
    python benchmarks/learning_peer.py --out runs/peer_quick --quick     # 1 seed, 40 steps

The demo's teacher and its pruned student (``megatron-gndpo demo`` prepares and caches them) are
exported to Hugging Face (``convert mcore-to-hf``, the vocabulary cut to the tokenizer's ids)
and the same student is distilled from the same teacher by each run, on the same prompts, batch
(16 prompts x 4 samples), lr (2e-4, constant, Adam, grad clip 1.0), steps and seeds:

- **ours**: ``megatron-gndpo``'s trainer with OPD (``algorithm.estimator=opd``: per-token
  score ``clamp(log p_T - log p_S, ±5)``, a policy-gradient step through GSPO's token form);
- **trl-iwopd**: TRL's ``IWOPDTrainer`` at ``iw_opd_gamma=0`` (trl 1.16, experimental): the
  same sampled-token estimator written by another team, the like-for-like peer of **ours**;
- **trl**: TRL's ``DistillationTrainer`` (its stable on-policy distillation: the student
  samples, the loss is the full-vocabulary reverse KL(p_S || p_T) at each sampled position,
  ``beta=1``), whose gradient is exactly the expectation over the sampled token of OPD's
  per-token estimator (docs/demo/RESULTS.md derives it): the same objective, estimated with
  less variance;
- **ours-vopd**: our vOPD over the full vocabulary (``vopd_top_k=0``), our estimator that uses
  the full distribution, beside **trl**.

Both are evaluated by the same measures every ``--eval-interval`` steps on the 128 held-out
problems: greedy accuracy, the accuracy of 4 samples a problem at temperature 1, and the
per-token reverse KL to the teacher on those samples. Ours evaluates inside its trainer
(``trainer.eval_samples``); TRL's runs are evaluated here with transformers (``HFEvaluator``),
whose step-0 numbers on the same exported student must equal ours (greedy: the same answers;
checked). The output is ``OUT/curves.jsonl`` (one line a run) and ``OUT/peer.md``: the mean
curves side by side with their seed spread and, at each evaluation, whether they differ beyond
noise.

What differs and cannot be made equal: the sampled tokens (each library draws its own), the
order of the prompts (each its own shuffle of the same set), and TRL's grad-norm clip (over its
own loss scale). One CPU process; the sizes of ``--quick`` run in ~5 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_gndpo.data.tokenizer import QA_PREFIX, QA_SUFFIX, SentencePieceTokenizer  # noqa: E402
from megatron_gndpo.rewards.verifiable import reward  # noqa: E402

MEASURES = ("eval/accuracy", "eval/sampled_accuracy", "eval/reverse_kl")
# The least spread a reverse-KL evaluation is given (a share of its value): the same student
# evaluated by both sides (their own 512 samples) differed by 0.6-5% at step 0.
KL_FLOOR = 0.05
EVAL_SAMPLES = 4


# ---------------------------------------------------------------------------------------------
# A transformers tokenizer that is the demo's SentencePiece model


def hf_tokenizer(model_file: Path) -> Any:
    """A ``PreTrainedTokenizer`` over the SentencePiece model, with a chat template that gives
    the ids ``SentencePieceTokenizer.apply_chat_template`` gives (checked by the caller)."""
    import sentencepiece as spm
    from transformers import PreTrainedTokenizer

    class SentencePieceHF(PreTrainedTokenizer):  # type: ignore[misc]
        model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

        def __init__(self, **kwargs: Any) -> None:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
            sp = self.sp
            super().__init__(
                bos_token=sp.id_to_piece(sp.bos_id()), eos_token=sp.id_to_piece(sp.eos_id()),
                pad_token=sp.id_to_piece(sp.pad_id()), unk_token=sp.id_to_piece(sp.unk_id()),
                padding_side="left", **kwargs,
            )  # fmt: skip

        @property
        def vocab_size(self) -> int:
            return int(self.sp.get_piece_size())

        def get_vocab(self) -> dict[str, int]:
            return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return list(self.sp.encode(text, out_type=str))

        def _convert_token_to_id(self, token: str) -> int:
            return int(self.sp.piece_to_id(token))

        def _convert_id_to_token(self, index: int) -> str:
            return str(self.sp.id_to_piece(index))

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return str(self.sp.decode_pieces(tokens))

    tok = SentencePieceHF()
    prefix, suffix = json.dumps(QA_PREFIX), json.dumps(QA_SUFFIX)
    tok.chat_template = (
        "{{ bos_token }}{{ " + prefix + " }}{{ messages[0]['content'] }}{{ " + suffix + " }}"
    )
    return tok


def check_same_ids(hf: Any, ours: SentencePieceTokenizer, prompts: Sequence[str]) -> None:
    """The peer must see exactly the token ids our trainer sees."""
    for prompt in prompts:
        theirs = hf.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )  # fmt: skip
        if list(theirs) != ours.apply_chat_template(prompt):
            raise SystemExit(f"the HF tokenizer's ids differ from ours on {prompt!r}")


# ---------------------------------------------------------------------------------------------
# The evaluation, with transformers


class HFEvaluator:
    """Greedy and sampled held-out accuracy and the per-token reverse KL to the teacher, as
    ``Trainer.evaluate`` measures them, for transformers models."""

    def __init__(self, tokenizer: SentencePieceTokenizer, problems: Sequence[Any],
                 teacher: Any, max_new_tokens: int, seed: int) -> None:  # fmt: skip
        self.tok, self.problems, self.teacher = tokenizer, list(problems), teacher
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.prompts = [tokenizer.apply_chat_template(p.prompt) for p in self.problems]

    def _generate(self, model: Any, samples: int, greedy: bool) -> tuple[torch.Tensor, int]:
        rows = [ids for ids in self.prompts for _ in range(samples)]
        width = max(map(len, rows))
        pad = self.tok.pad_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        torch.manual_seed(self.seed)  # the same draws at every evaluation of a run
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0,
                eos_token_id=self.tok.eos_id, pad_token_id=pad,
            )  # fmt: skip
        return out, width

    def _answers(self, out: torch.Tensor, width: int, samples: int) -> list[float]:
        scores = []
        for i, row in enumerate(out[:, width:].tolist()):
            ids = row[: row.index(self.tok.eos_id) + 1] if self.tok.eos_id in row else row
            problem = self.problems[i // samples]
            scores.append(float(reward(self.tok.decode(ids), str(problem.answer))))
        return scores

    def __call__(self, model: Any) -> dict[str, float]:
        model.eval()
        out, width = self._generate(model, 1, greedy=True)
        greedy = statistics.fmean(self._answers(out, width, 1))
        out, width = self._generate(model, EVAL_SAMPLES, greedy=False)
        sampled = statistics.fmean(self._answers(out, width, EVAL_SAMPLES))
        kl = self._reverse_kl(model, out, width)
        model.train()
        return {MEASURES[0]: greedy, MEASURES[1]: sampled, MEASURES[2]: kl}

    def _reverse_kl(self, model: Any, out: torch.Tensor, width: int) -> float:
        """Σ (log p_S - log p_T) over the sampled response tokens (up to EOS) / their count."""
        response = out[:, width:]
        is_eos = response == self.tok.eos_id
        seen = is_eos.cumsum(1)
        keep = (seen == 0) | (is_eos & (seen == 1))  # up to and including the first EOS
        attention = torch.ones_like(out)
        attention[:, :width] = (out[:, :width] != self.tok.pad_id).int()
        positions = (attention.cumsum(1) - 1).clamp(min=0)

        def logp(m: Any) -> torch.Tensor:
            with torch.no_grad():
                logits = m(input_ids=out, attention_mask=attention, position_ids=positions).logits
            lp = logits[:, width - 1 : -1].float().log_softmax(-1)
            return lp.gather(-1, response.unsqueeze(-1)).squeeze(-1)

        d = (logp(model) - logp(self.teacher))[keep]
        return float(d.sum() / max(int(keep.sum()), 1))


# ---------------------------------------------------------------------------------------------
# The runs


@dataclasses.dataclass(frozen=True)
class PeerSettings:
    steps: int
    seeds: tuple[int, ...]
    eval_interval: int
    prompts_per_step: int = 16
    samples_per_prompt: int = 4
    lr: float = 2e-4


def export_hf(prepared: Any, target: Path, vocab_size: int) -> Path:
    """A prepared demo model as a Hugging Face (Llama) directory, once, its vocabulary cut to
    the tokenizer's ``vocab_size`` ids: megatron pads the embedding (to a multiple of 64), and
    our samplers never draw the padding rows, so neither may the peer's."""
    from transformers import AutoModelForCausalLM

    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf

    if not (target / "config.json").is_file():
        padded = target.with_name(target.name + "_padded")
        convert_mcore_to_hf(prepared.checkpoint, padded, model=prepared.model, family="llama")
        model = AutoModelForCausalLM.from_pretrained(padded, dtype=torch.float32)
        model.resize_token_embeddings(vocab_size)
        model.save_pretrained(target)
    return target


def export_models(cache_dir: Path, out: Path, quick: bool) -> tuple[Any, Any, Any, Path, Path]:
    """The demo's teacher and pruned student (prepared or reused) and their HF exports."""
    from megatron_gndpo.demo.run import prepare_models, settings
    from megatron_gndpo.parallel.world import distributed_world

    with distributed_world(alone="the benchmark"):
        teacher, student, task = prepare_models(cache_dir, settings(quick))
        vocab = task.tokenizer.vocab_size
        teacher_dir = export_hf(teacher, out / "hf" / "teacher", vocab)
        student_dir = export_hf(student, out / "hf" / "student", vocab)
    return teacher, student, task, teacher_dir, student_dir


# Our runs: the estimator each trains with (vOPD over the full vocabulary: its advantage is the
# sampled score plus the exact per-position KL, the analytic side TRL's loss takes whole).
OURS = {"ours": ("opd", {}), "ours-vopd": ("vopd", {"vopd_top_k": 0})}


def run_ours(cache_dir: Path, out: Path, teacher: Any, student: Any, task: Any,
             s: PeerSettings, quick: bool, who: str = "ours") -> list[dict[str, Any]]:  # fmt: skip
    """Our trainer with ``OURS[who]`` on each seed: its evaluations (step 0 and every
    interval)."""
    from megatron_gndpo.demo.run import method_config, run_method, settings
    from megatron_gndpo.parallel.world import distributed_world

    runs = []
    with distributed_world(alone="the benchmark"):
        for seed in s.seeds:
            base = dataclasses.replace(
                settings(quick, seed), steps=s.steps, eval_interval=s.eval_interval,
                prompts_per_step=s.prompts_per_step, samples_per_prompt=s.samples_per_prompt,
                lr=s.lr, eval_samples=EVAL_SAMPLES,
            )  # fmt: skip
            method, changes = OURS[who]
            cfg = method_config(
                method, out / who, cache_dir, teacher, student, task, base, f"{method}_s{seed}"
            )
            cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, **changes))
            started = time.perf_counter()
            run = run_method(cfg)
            curve = [{"step": h["step"], **{k: h[k] for k in MEASURES}}
                     for h in run.history if MEASURES[0] in h]  # fmt: skip
            runs.append({"who": who, "seed": seed, "curve": curve,
                         "seconds": time.perf_counter() - started})  # fmt: skip
    return runs


def _drawn_prompts(prompts: Sequence[str], s: PeerSettings, seed: int) -> list[str]:
    """The prompts of every step, in order: epochs of the prompt set, each shuffled by seed."""
    order = random.Random(seed)
    needed = s.steps * s.prompts_per_step
    drawn: list[str] = []
    while len(drawn) < needed:
        epoch = list(prompts)
        order.shuffle(epoch)
        drawn += epoch
    return drawn[:needed]


def _common_args(s: PeerSettings, seed: int, out: Path) -> dict[str, Any]:
    """What every TRL trainer here takes alike: our optimizer, batch, steps and seed."""
    return dict(
        output_dir=str(out), max_steps=s.steps, learning_rate=s.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, seed=seed, data_seed=seed,
        per_device_train_batch_size=s.prompts_per_step * s.samples_per_prompt,
        gradient_accumulation_steps=1, temperature=1.0, top_p=1.0, top_k=0,
        disable_dropout=True, use_cpu=True, bf16=False, fp16=False, report_to="none",
        save_strategy="no", logging_steps=s.eval_interval, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip


def _distillation_trainer(student: Any, teacher: Any, hf_tok: Any, prompts: list[str],
                          s: PeerSettings, common: dict[str, Any], length: int,
                          callback: Any) -> Any:  # fmt: skip
    """trl.DistillationTrainer: one completion per row, so each prompt is given as
    ``samples_per_prompt`` consecutive rows (16 prompts x 4 rows = one batch of 64)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    rows = [[{"role": "user", "content": p}] for p in prompts
            for _ in range(s.samples_per_prompt)]  # fmt: skip
    args = DistillationConfig(
        **common, beta=1.0, max_completion_length=length, shuffle_dataset=False
    )
    return DistillationTrainer(
        model=student, teacher_model=teacher, args=args,
        train_dataset=Dataset.from_dict({"prompt": rows}), processing_class=hf_tok,
        callbacks=[callback],
    )  # fmt: skip


def _iwopd_trainer(student: Any, teacher: Any, hf_tok: Any, prompts: list[str],
                   s: PeerSettings, common: dict[str, Any], length: int,
                   callback: Any) -> Any:  # fmt: skip
    """trl.experimental.iw_opd.IWOPDTrainer at ``iw_opd_gamma=0``: A = log p_T - log p_S of
    each sampled token, loss -log p_S * A averaged over the tokens: our OPD's estimator (no
    clamp; ours clamps at ±5, which these runs hardly reach). Two things around it, both
    documented: (1) it reloads the teacher's tokenizer by path (AutoTokenizer) to check it
    equals the student's, and the demo's SentencePiece tokenizer has no HF files, so it is
    handed the same object; (2) trl 1.16 divides its loss by transformers' count of label
    tokens in the prompt-only rows, which is 0 (loss -inf, gradients NaN), so the loss gets the
    trainer's own token mean instead (exact with one process and no accumulation)."""
    from unittest import mock

    from datasets import Dataset
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
    from trl.experimental.iw_opd import iw_opd_trainer as iw_module

    class TokenMean(IWOPDTrainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:  # fmt: skip
            return super().compute_loss(model, inputs, return_outputs, None)

    args = IWOPDConfig(
        **common, distillation_objective="iw_opd", iw_opd_gamma=0.0, lmbda=1.0,
        num_generations=s.samples_per_prompt, max_completion_length=length, max_length=256,
    )  # fmt: skip
    teacher.config._name_or_path = "demo-teacher"  # only read to reload its tokenizer
    same = mock.Mock(from_pretrained=mock.Mock(return_value=hf_tok))
    with mock.patch.object(iw_module, "AutoTokenizer", same):
        return TokenMean(
            model=student, teacher_model=teacher, args=args,
            train_dataset=Dataset.from_dict(
                {"messages": [[{"role": "user", "content": p}] for p in prompts]}
            ),
            processing_class=hf_tok, callbacks=[callback],
        )  # fmt: skip


PEERS = {"trl": _distillation_trainer, "trl-iwopd": _iwopd_trainer}


def train_peer(peer: str, teacher_dir: Path, student_dir: Path, hf_tok: Any,
               prompts: Sequence[str], s: PeerSettings, seed: int, out: Path,
               max_new_tokens: int, evaluator: Callable[[Any], Callable[[Any], dict[str, float]]],
               changes: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """TRL's trainer ``peer`` (``PEERS``) from the exported models, one seed.

    ``evaluator(teacher)`` measures the student at step 0, every ``s.eval_interval`` steps and
    at the last, in eval mode and on a forked RNG (the training draws do not depend on how often
    it measures). ``changes``: TrainingArguments over ``_common_args``'. Returns the ``curve``,
    the ``seconds`` of training (its evaluations included), each evaluation's seconds
    (``eval_seconds``) and TRL's logged metrics (``logs``, one dict a log)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    evaluate = evaluator(teacher)
    curve: list[dict[str, Any]] = []
    evals: list[float] = []
    logged: list[dict[str, Any]] = []

    def measure(step: int, model: Any) -> None:
        started, training = time.perf_counter(), model.training
        model.eval()
        with torch.random.fork_rng(devices=[]):
            curve.append({"step": step, **evaluate(model)})
        model.train(training)
        evals.append(time.perf_counter() - started)

    class Record(TrainerCallback):  # type: ignore[misc]
        """The evaluations, into the curve, and TRL's logs."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % s.eval_interval == 0 or state.global_step == s.steps:
                measure(state.global_step, kw["model"])

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:  # fmt: skip
            if logs:
                logged.append({"step": state.global_step, **logs})

    measure(0, student)
    common = {**_common_args(s, seed, out / peer / f"s{seed}"), **(changes or {})}
    trainer = PEERS[peer](student, teacher, hf_tok, _drawn_prompts(prompts, s, seed), s, common,
                          max_new_tokens, Record())  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    return {"curve": curve, "seconds": time.perf_counter() - started, "eval_seconds": evals,
            "logs": logged}  # fmt: skip


def run_trl(teacher_dir: Path, student_dir: Path, task: Any, s: PeerSettings,
            out: Path, max_new_tokens: int, peer: str = "trl") -> list[dict[str, Any]]:  # fmt: skip
    """TRL's trainer ``peer`` (``PEERS``) on each seed, evaluated every interval by
    ``HFEvaluator``."""
    from megatron_gndpo.data.tasks import chains

    tok = task.tokenizer
    hf_tok = hf_tokenizer(Path(tok._path))
    prompts = [p.prompt for p in chains.split("train", task.difficulty)]
    check_same_ids(hf_tok, tok, prompts[:64])
    runs = []
    for seed in s.seeds:

        def evaluator(teacher: Any, seed: int = seed) -> HFEvaluator:
            return HFEvaluator(tok, task.eval, teacher, max_new_tokens, seed)

        run = train_peer(peer, teacher_dir, student_dir, hf_tok, prompts, s, seed, out,
                         max_new_tokens, evaluator)  # fmt: skip
        runs.append({"who": peer, "seed": seed, "curve": run["curve"],
                     "seconds": run["seconds"]})  # fmt: skip
    return runs


# ---------------------------------------------------------------------------------------------
# The comparison


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def compare(
    runs: Sequence[dict[str, Any]], problems: int, peer: str = "trl", ours: str = "ours"
) -> list[dict[str, Any]]:
    """At each evaluated step and measure: both sides' mean and sd over seeds, and whether they
    differ beyond noise (two standard errors of the difference of the means; an accuracy's
    per-seed spread at least its binomial error over ``problems``)."""
    rows = []
    steps = sorted({c["step"] for r in runs for c in r["curve"]})
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for key in MEASURES:
            sides = {}
            for who in (ours, peer):
                values = [c[key] for r in runs if r["who"] == who for c in r["curve"]
                          if c["step"] == step]  # fmt: skip
                if values:
                    sides[who] = (*_mean_sd(values), len(values))
            if len(sides) < 2:
                continue
            (m1, s1, n1), (m2, s2, n2) = sides[ours], sides[peer]
            if key != "eval/reverse_kl":  # an accuracy: at least its measurement's error
                s1 = max(s1, math.sqrt(m1 * (1 - m1) / problems))
                s2 = max(s2, math.sqrt(m2 * (1 - m2) / problems))
            else:  # one evaluation's 512 samples: measured 3-8% apart between evaluators
                s1, s2 = max(s1, KL_FLOOR * m1), max(s2, KL_FLOOR * m2)
            noise = 2.0 * math.sqrt(s1**2 / n1 + s2**2 / n2)
            row[key] = {"ours": (m1, s1), "peer": (m2, s2), "noise": noise,
                        "apart": abs(m1 - m2) > max(noise, 1.0 / problems)}  # fmt: skip
        rows.append(row)
    return rows


PEER_NAMES = {
    "trl": "TRL's DistillationTrainer (full-vocabulary reverse KL)",
    "trl-iwopd": "TRL's IW-OPD at gamma 0 (the sampled-token estimator, OPD's own)",
}


OUR_NAMES = {"ours": "Ours (OPD)", "ours-vopd": "Ours (vOPD, full vocabulary)"}
# The pairs compared: each peer with the run of ours that estimates the same thing, and
# TRL's full-vocabulary loss with our full-vocabulary vOPD.
PAIRS = (("ours", "trl-iwopd"), ("ours", "trl"), ("ours-vopd", "trl"))


def markdown(rows: Sequence[dict[str, Any]], s: PeerSettings, seconds: dict[str, float],
             peer: str = "trl", ours: str = "ours") -> str:  # fmt: skip
    lines = [
        f"{OUR_NAMES[ours]} vs {PEER_NAMES[peer]}, {s.steps} steps of {s.prompts_per_step} x "
        f"{s.samples_per_prompt}, lr {s.lr:g}, seeds {', '.join(map(str, s.seeds))}; mean ± sd "
        "over seeds; `*`: the two differ beyond noise.",
        "",
        "| step | greedy ours | greedy peer | sampled ours | sampled peer | reverse KL ours "
        "| reverse KL peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        for key in MEASURES:
            if key not in row:
                cells += ["-", "-"]
                continue
            r, mark = row[key], "*" if row[key]["apart"] else ""
            cells += [f"{r['ours'][0]:.3f} ± {r['ours'][1]:.3f}{mark}",
                      f"{r['peer'][0]:.3f} ± {r['peer'][1]:.3f}{mark}"]  # fmt: skip
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    apart = sum(1 for row in rows for k in MEASURES if k in row and row[k]["apart"])
    total = sum(1 for row in rows for k in MEASURES if k in row)
    walls = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    lines += ["", f"Beyond noise at {apart} of {total} (step, measure) points. Wall time, "
              f"all seeds: {walls}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/peer"))
    parser.add_argument("--cache-dir", type=Path, default=Path("runs/demo/cache"))
    parser.add_argument("--quick", action="store_true", help="the demo's --quick models, 1 seed")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument(
        "--who", default="ours,trl-iwopd,trl,ours-vopd",
        help="which runs: ours, ours-vopd and the peers trl, trl-iwopd",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from megatron_gndpo.compat import notices
    from megatron_gndpo.demo import models
    from megatron_gndpo.demo.run import SEED

    notices.quiet_known_notices()
    count = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    s = PeerSettings(
        steps=args.steps or (40 if args.quick else 100),
        seeds=tuple(range(SEED, SEED + count)), eval_interval=args.eval_interval,
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    teacher, student, task, teacher_dir, student_dir = export_models(
        args.cache_dir, args.out, args.quick
    )
    who = args.who.split(",")
    curves = args.out / "curves.jsonl"
    runs = [json.loads(x) for x in curves.read_text().splitlines()] if curves.is_file() else []
    runs = [r for r in runs if r["who"] not in who]  # the runs asked for are run again
    for side in who:
        if side in OURS:
            runs += run_ours(args.cache_dir, args.out, teacher, student, task, s, args.quick, side)
        else:
            runs += run_trl(teacher_dir, student_dir, task, s, args.out,
                            models.max_new_tokens(task.difficulty), side)  # fmt: skip
        curves.write_text("".join(json.dumps(r) + "\n" for r in runs))
    parts = []
    for ours, peer in PAIRS:
        if any(r["who"] == peer for r in runs) and any(r["who"] == ours for r in runs):
            rows = compare(runs, len(task.eval), peer, ours)
            seconds = {w: sum(r["seconds"] for r in runs if r["who"] == w) for w in (ours, peer)}
            parts.append(markdown(rows, s, seconds, peer, ours))
    text = "\n".join(parts)
    (args.out / "peer.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
