"""Student training step and teacher scoring throughput vs the transformers peer, same shape.

On a CUDA machine (Qwen2.5-1.5B shape of docs/DESIGN.md, 1.78B params untied, bf16, seq 4096):
    python benchmarks/train_step.py                       # prints a table, writes --out JSON
    python benchmarks/train_step.py --layers 4 --seq 2048 # smaller
On the CPU (issue 23's shape: a Qwen2-like model, hidden 512, 4 layers, 8 heads of 64, 2 KV
heads, FFN 1536, vocab 4096, fp32, 2 threads, seq 512):
    python benchmarks/train_step.py --out benchmarks/results/train-step-cpu-DATE.json

Measures, on one rank (TP=PP=1):
- student fwd+bwd (no optimizer) through megatron-core's local spec with the SDPA core attention
  and the fused log-prob head (what the update runs): tokens/s and peak GiB;
- teacher-style scoring (forward-only, log-probs included, no_grad): tokens/s;
- the transformers peer (Qwen2 + SDPA: ``loss.backward()`` of its own cross entropy, and a
  no_grad forward to logits), measured in the same run: on a GPU shared/bench/peer_step.py's (its
  own random weights), on the CPU the same weights as ours, written as a Hugging Face model.
  Ratios: ours over the peer's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    add_shape_args,
    build_model,
    load_peer,
    model_config,
    peak_gib,
    sync,
    table,
    write_hf_model,
)

from megatron_gndpo.models.logprob_head import TokenLogProbs


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, gpu=gpu)
    if not gpu:  # issue 23's CPU shape (16.3M parameters), as benchmarks/rollout.py
        p.set_defaults(layers=4, hidden=512, ffn=1536, heads=8, kv_heads=2, vocab=4096)
    p.add_argument("--seq", type=int, default=4096 if gpu else 512)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (the peer's too)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    p.add_argument("--out", default="train_step.json")
    args = p.parse_args()
    if not gpu:
        torch.set_num_threads(args.threads)

    _, model = build_model(args, args.seq, gpu=gpu)
    device = next(model.parameters()).device
    head = TokenLogProbs(vocab_size=args.vocab, chunk_tokens=4096)
    tokens = torch.randint(0, args.vocab, (1, args.seq), device=device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0)
    targets = torch.roll(tokens, -1, dims=1)

    def train_step() -> None:
        lp = model(tokens, positions, None, output_processor=head, output_processor_context=targets)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)

    def score() -> None:
        with torch.no_grad():
            model(tokens, positions, None, output_processor=head, output_processor_context=targets)

    n_params = sum(q.numel() for q in model.parameters())
    results: dict[str, Any] = {"params": n_params, "shape": vars(args), "device": _device()}
    timed: dict[str, Callable[[], None]] = {"train": train_step, "score": score}
    if not gpu:  # the peer beside ours, the runs interleaved (load from others falls on both)
        timed["peer_train"], timed["peer_score"] = _cpu_peer(model, args)
    seconds = _interleaved_medians(timed, rounds=args.repeats)
    results["student_tokens_per_s"] = args.seq / seconds["train"]
    results["scoring_tokens_per_s"] = args.seq / seconds["score"]
    rows = [
        ("megatron_gndpo student fwd+bwd", f"{results['student_tokens_per_s']:,.0f}",
         _gib(peak_gib(train_step))),
        ("megatron_gndpo scoring (no_grad)", f"{results['scoring_tokens_per_s']:,.0f}",
         _gib(peak_gib(score))),
    ]  # fmt: skip
    model.zero_grad(set_to_none=True)
    if gpu:
        peer = _gpu_peer(args)
    else:
        peer = (
            {"tok_s": args.seq / seconds["peer_train"]},
            {"tok_s": args.seq / seconds["peer_score"]},
        )
    if peer is not None:
        hf_train, hf_fwd = peer
        results["peer_train"], results["peer_forward"] = hf_train, hf_fwd
        results["ratio_train"] = results["student_tokens_per_s"] / hf_train["tok_s"]
        results["ratio_scoring"] = results["scoring_tokens_per_s"] / hf_fwd["tok_s"]
        rows.append(("transformers + SDPA fwd+bwd (peer)", f"{hf_train['tok_s']:,.0f}",
                     _gib(hf_train.get("peak_gib"))))  # fmt: skip
        rows.append(("transformers forward no_grad (peer)", f"{hf_fwd['tok_s']:,.0f}",
                     _gib(hf_fwd.get("peak_gib"))))  # fmt: skip
        rows.append(("ours / peer, fwd+bwd", f"{results['ratio_train']:.2f}", ""))
        rows.append(("ours / peer, scoring", f"{results['ratio_scoring']:.2f}", ""))
    else:
        print("peer_step.py not found (pass --peer): peers not measured")
    results["load_average_after"] = os.getloadavg()
    print(f"{n_params / 1e9:.2f}B params, seq {args.seq}, {_device()}")
    print(table(rows, ("what", "tokens/s", "peak GiB")))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)


def _gpu_peer(args: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    peer = load_peer(args.peer)
    if peer is None:
        return None
    shape = peer.Shape(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        ffn=args.ffn, vocab=args.vocab, seq=args.seq,
    )  # fmt: skip
    return peer.hf_train_step(shape), peer.hf_forward(shape)


def _cpu_peer(model: Any, args: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """transformers' Qwen2 with our weights on the CPU: the step and the forward peer_step.py
    times on a GPU (``loss.backward()`` of its cross entropy; logits under no_grad)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        write_hf_model(model, model_config(args, args.seq, gpu=False), Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                  attn_implementation="sdpa")  # fmt: skip
    ids = torch.randint(0, args.vocab, (1, args.seq))

    def step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()
        hf.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            hf(input_ids=ids)

    return step, forward


def _interleaved_medians(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn, round after round (after a warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
