"""Built-in rollout throughput (KV-cached megatron generation) vs transformers ``generate()``.

On a CUDA machine (docs/DESIGN.md's rollout peer: Qwen2.5-1.5B shape, batch 64, 128-token prompts,
256 new tokens, sampling):
    python benchmarks/rollout.py
Without a GPU it runs a tiny shape on the CPU, only to show the script works.
Prints generated tokens/s of both, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import add_shape_args, build_model, load_peer, sync, table

from megatron_gndpo.rollout.base import SamplingParams
from megatron_gndpo.rollout.builtin import MegatronGenerator


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, gpu=gpu)
    p.add_argument("--batch", type=int, default=64 if gpu else 8)
    p.add_argument("--prompt", type=int, default=128 if gpu else 16)
    p.add_argument("--new", type=int, default=256 if gpu else 16)
    p.add_argument("--out", default="rollout.json")
    args = p.parse_args()

    groups, model = build_model(args, args.prompt + args.new, gpu=gpu)
    generator = MegatronGenerator(
        model, groups, vocab_size=args.vocab, pad_id=0,
        max_sequence_length=args.prompt + args.new,
    )  # fmt: skip
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt)).tolist()
    # no stop token: every row generates the full budget, as the peer does
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)

    generator.generate(prompts[:2], params, seeds=[0, 1])  # warm-up
    sync()
    start = time.perf_counter()
    rollout = generator.generate(prompts, params, seeds=list(range(args.batch)))
    sync()
    seconds = time.perf_counter() - start
    generated = int(rollout.response_lengths.sum())
    rows = [("megatron_gndpo built-in (KV cache)", f"{generated / seconds:,.0f}")]
    results = {"shape": vars(args), "builtin_tokens_per_s": generated / seconds}
    peer = load_peer(args.peer) if gpu else None
    if peer is not None:
        shape = peer.Shape(hidden=args.hidden, layers=args.layers, heads=args.heads,
                           kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab)  # fmt: skip
        hf = peer.hf_generate(shape, batch=args.batch, prompt_len=args.prompt, new_tokens=args.new)
        results["peer_generate"] = hf
        rows.append(("transformers generate() (peer)", f"{hf['gen_tok_s']:,.0f}"))
    elif not gpu:
        print("no GPU: tiny CPU shape, numbers only show the script runs")
    print(table(rows, ("what", "generated tokens/s")))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
