"""Rollout, teacher scoring and the update on a real model, each beside transformers, in one run.

The model is the real-model tier's SmolLM2-135M-Instruct (``scripts/ci/fetch_real_models.sh``:
Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49,152, tied
embeddings), fp32, on the CPU:

    PYTHONPATH=. python benchmarks/real_model.py --vllm-python .venv-vllm/bin/python \\
        --out benchmarks/results/real-model-cpu-DATE.json

Three stages, every one ours beside its peer on the same weights (ours: the converted
megatron-core GPTModel, TP=PP=1, built from the fetched Hugging Face directory; transformers:
that directory, SDPA attention), ratios = our tokens/s over the peer's:

- rollout: the built-in generator (lean decoder, temperature 1, no stop token) against
  transformers ``generate()`` (sampling, exactly ``--new`` tokens) and vLLM (``vllm_peer.py``
  under ``--vllm-python``; skipped without it): batches of ``--rollout-batches`` copies of a
  ChatML prompt, generated tokens/s;
- teacher scoring: ``score_tokens`` (the trainer's forward-only pass, fused log-prob head)
  against transformers' forward under no_grad + ``log_softmax`` + ``gather``: rows of
  ``--seq`` tokens of real text, ``--score-batches`` rows;
- the update: our forward with the log-prob head + backward (no optimizer, as
  ``train_step.py``) against transformers' forward + ``log_softmax`` + ``gather`` + backward.

Runs are interleaved (repeat, batch, engine, the order rotating) so load from other processes
falls on all; medians of ``--repeats``. ``--profile DIR`` also writes one torch.profiler table
per engine and stage at the largest batch (``DIR/<stage>-<engine>.txt``), to explain a ratio
below 1. ``--wait-idle`` as in rollout.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import VLLMPeer, git, host_info, process_world, sync, table, wait_for_idle

from megatron_gndpo.checkpoint import hf_mapping
from megatron_gndpo.checkpoint.convert import HFCheckpoint, fill_from_hf, read_hf_config
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.engine.host_memory import reuse_freed_memory
from megatron_gndpo.engine.scoring import score_tokens
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.real.fetch import SMOLLM2_135M, fetch
from megatron_gndpo.rollout.base import SamplingParams
from megatron_gndpo.rollout.builtin import MegatronGenerator

Run = Callable[[int], int]  # batch size -> tokens processed
TEXT = (
    "The capital of France is Paris, which sits on the Seine. Rivers shaped where cities grew: "
    "water brought trade, food and defence. Name three colors: red, blue and green. "
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="default: the real-model tier's cache")
    p.add_argument("--rollout-batches", default="1,4,16")
    p.add_argument("--score-batches", default="1,4,8")
    p.add_argument("--seq", type=int, default=256, help="tokens per scored / trained row")
    p.add_argument("--new", type=int, default=64, help="tokens generated per rollout row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    p.add_argument("--vllm-python", default=None, help="an interpreter with vLLM (rollout peer)")
    p.add_argument("--stages", default="rollout,scoring,update")
    p.add_argument("--profile", default=None, help="write torch.profiler tables to this dir")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="FRACTION")
    p.add_argument("--wait-max", type=float, default=60.0)
    p.add_argument("--out", default="real_model.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with reuse_freed_memory():  # as the commands that build models run (engine/host_memory.py)
        _run(args)


def _run(args: argparse.Namespace) -> None:
    stages = args.stages.split(",")
    hf_dir = Path(args.model_dir) if args.model_dir else fetch(SMOLLM2_135M, log=lambda _: None)
    host_before = host_info()

    groups, model, cfg = _ours(hf_dir)
    hf = _transformers(hf_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about rivers and cities."}],
        add_generation_prompt=True, tokenize=True,
    )["input_ids"]  # fmt: skip
    text_ids = tokenizer.encode(TEXT * (args.seq // 20 + 1))[: args.seq]
    assert len(text_ids) == args.seq, "--seq is longer than the benchmark's text"
    vocab = cfg.vocab_size

    engines: dict[str, dict[str, Run]] = {}
    peer = None
    if "rollout" in stages:
        max_len = len(prompt) + args.new
        engines["rollout"] = {
            "built-in": _builtin_rollout(model, groups, vocab, prompt, args.new, max_len),
            "transformers generate()": _hf_rollout(hf, prompt, args.new),
        }
        peer = _vllm(args, hf_dir, max_len, max(_ints(args.rollout_batches)))
        if peer is not None:
            engines["rollout"]["vLLM"] = lambda b, peer=peer: peer.generate([prompt] * b)
    if "scoring" in stages:
        engines["scoring"] = {
            "ours (score_tokens)": _our_scoring(model, groups, vocab, text_ids),
            "transformers forward + gather": _hf_scoring(hf, text_ids),
        }
    if "update" in stages:
        engines["update"] = {
            "ours (fwd + log-prob head + bwd)": _our_update(model, vocab, text_ids),
            "transformers fwd + gather + bwd": _hf_update(hf, text_ids),
        }
    batches = {
        stage: _ints(args.rollout_batches if stage == "rollout" else args.score_batches)
        for stage in engines
    }
    samples = _measure(engines, batches, args)
    if peer is not None:
        peer.close()
    rows = _rows(samples)
    print(table(rows, ("stage", "batch", "engine", "tokens/s", "ours / it", "per repeat")))
    if args.profile:
        _profile(engines, batches, Path(args.profile))
    results = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "host_before": host_before, "host_after": host_info(),
        "vllm": peer.info if peer is not None else None,
        "model": str(hf_dir), "params": sum(t.numel() for t in model.parameters()),
        "settings": vars(args), "prompt_tokens": len(prompt),
        "tokens_per_s": samples, "table": rows,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


# ---------------------------------------------------------------------------------------------
# The two models


def _ours(hf_dir: Path) -> tuple[Any, Any, Any]:
    """(groups, GPTModel, ModelConfig): the fetched model converted in memory (the tensors
    ``convert hf-to-mcore`` writes), fp32, one process."""
    from megatron_gndpo.models.gpt import build_gpt

    cfg = hf_mapping.model_config_from_hf(read_hf_config(hf_dir))
    groups = process_world()
    model = build_gpt(cfg, ParallelConfig(), groups)
    with HFCheckpoint(hf_dir) as hf:
        fill_from_hf(model, hf, cfg, tp=1, tp_rank=0)
    return groups, model.eval(), cfg


def _transformers(hf_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


# ---------------------------------------------------------------------------------------------
# The stages: each returns a function of the batch size that runs once and counts its tokens


def _builtin_rollout(
    model: Any, groups: Any, vocab: int, prompt: list[int], new: int, max_len: int
) -> Run:
    generator = MegatronGenerator(model, groups, vocab_size=vocab, pad_id=2,
                                  max_sequence_length=max_len)  # fmt: skip
    params = SamplingParams(max_new_tokens=new, temperature=1.0)  # no stop token: all `new`

    def run(b: int) -> int:
        rollout = generator.generate([prompt] * b, params, seeds=list(range(b)))
        return int(rollout.response_lengths.sum())

    return run


def _hf_rollout(hf: Any, prompt: list[int], new: int) -> Run:
    def run(b: int) -> int:
        ids = torch.tensor([prompt] * b)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=2)  # fmt: skip
        return int(out[:, ids.shape[1] :].numel())

    return run


def _vllm(args: Any, hf_dir: Path, max_len: int, max_batch: int) -> VLLMPeer | None:
    if args.vllm_python is None:
        print("vLLM peer skipped: pass --vllm-python /path/to/venv/bin/python")
        return None
    peer = VLLMPeer(args.vllm_python, hf_dir, max_len=max_len, max_batch=max_batch,
                    threads=args.threads, new=args.new)  # fmt: skip
    print(f"vLLM peer ready: {peer.info}", flush=True)
    return peer


def _rows_of(text_ids: list[int], b: int) -> torch.Tensor:
    return torch.tensor([text_ids] * b)


def _our_scoring(model: Any, groups: Any, vocab: int, text_ids: list[int]) -> Run:
    head = TokenLogProbs(vocab)

    def run(b: int) -> int:
        tokens = _rows_of(text_ids, b)
        lengths = torch.full((b,), tokens.shape[1])
        with torch.no_grad():
            score_tokens(model, groups, tokens, lengths, head=head, token_budget=tokens.numel())
        return tokens.numel()

    return run


def _hf_scoring(hf: Any, text_ids: list[int]) -> Run:
    def run(b: int) -> int:
        tokens = _rows_of(text_ids, b)
        with torch.no_grad():
            logits = hf(input_ids=tokens).logits
            logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])
        return tokens.numel()

    return run


def _our_update(model: Any, vocab: int, text_ids: list[int]) -> Run:
    head = TokenLogProbs(vocab)

    def run(b: int) -> int:
        tokens = _rows_of(text_ids, b)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        targets = torch.roll(tokens, -1, dims=1)
        model.train()
        lp = model(tokens, positions, None, output_processor=head,
                   output_processor_context=targets)  # fmt: skip
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        model.eval()
        return tokens.numel()

    return run


def _hf_update(hf: Any, text_ids: list[int]) -> Run:
    def run(b: int) -> int:
        tokens = _rows_of(text_ids, b)
        hf.train()
        logits = hf(input_ids=tokens).logits
        lp = logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])
        lp.sum().backward()
        hf.zero_grad(set_to_none=True)
        hf.eval()
        return tokens.numel()

    return run


# ---------------------------------------------------------------------------------------------
# Timing, the table, profiles


def _measure(
    engines: dict[str, dict[str, Run]], batches: dict[str, list[int]], args: Any
) -> dict[str, dict[str, dict[int, list[float]]]]:
    """tokens/s of every run: samples[stage][engine][batch], interleaved, after a warm-up."""
    samples = {s: {e: {b: [] for b in batches[s]} for e in runs} for s, runs in engines.items()}
    for stage, runs in engines.items():
        for run in runs.values():
            run(min(batches[stage]))
    for r in range(args.repeats):
        for stage, runs in engines.items():
            names = list(runs)
            for b in batches[stage]:
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    wait_for_idle(args.wait_idle, args.wait_max)
                    sync()
                    start = time.perf_counter()
                    tokens = runs[name](b)
                    samples[stage][name][b].append(tokens / (time.perf_counter() - start))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    return samples


def _rows(samples: dict[str, dict[str, dict[int, list[float]]]]) -> list[tuple[str, ...]]:
    rows = []
    for stage, by_engine in samples.items():
        ours_name = next(iter(by_engine))
        for b in by_engine[ours_name]:
            ours = by_engine[ours_name][b]
            for name, per_batch in by_engine.items():
                ratio = paired = ""
                if name != ours_name:
                    ratio = f"{statistics.median(ours) / statistics.median(per_batch[b]):.2f}"
                    pairs = [x / y for x, y in zip(ours, per_batch[b], strict=True)]
                    wins = sum(q >= 1 for q in pairs)
                    paired = f"{statistics.median(pairs):.2f} ({wins}/{len(pairs)} >= 1)"
                tokens_s = f"{statistics.median(per_batch[b]):,.0f}"
                rows.append((stage, str(b), name, tokens_s, ratio, paired))
    return rows


def _profile(engines: dict[str, dict[str, Run]], batches: dict[str, list[int]], out: Path) -> None:
    """One profiled run of every engine at its stage's largest batch: the top ops by self CPU
    time, as a table per engine."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    for stage, runs in engines.items():
        for name, run in runs.items():
            if name == "vLLM":  # another process: nothing to see from here
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(max(batches[stage]))
            slug = "".join(c if c.isalnum() else "-" for c in name.split(" (")[0]).strip("-")
            text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (out / f"{stage}-{slug}.txt").write_text(text)
    print(f"profiles in {out}")


if __name__ == "__main__":
    main()
