"""Student training step and teacher scoring throughput vs the transformers peer, same shape.

On a CUDA machine (Qwen2.5-1.5B shape of docs/DESIGN.md, 1.78B params untied, bf16, seq 4096):
    python benchmarks/train_step.py                       # prints a table, writes --out JSON
    python benchmarks/train_step.py --layers 4 --seq 2048 # smaller
Without a GPU it runs a tiny shape on the CPU, only to show the script works.

Measures, on one rank (TP=PP=1):
- student fwd+bwd (no optimizer) through megatron-core's local spec with the SDPA core attention
  and the fused log-prob head (what the update runs): tokens/s and peak GiB;
- teacher-style scoring (forward-only, log-probs included, no_grad): tokens/s;
- the peers from shared/bench/peer_step.py (transformers Qwen2 + SDPA), measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import add_shape_args, build_model, load_peer, median_seconds, peak_gib, table

from megatron_gndpo.models.logprob_head import TokenLogProbs


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, gpu=gpu)
    p.add_argument("--seq", type=int, default=4096 if gpu else 128)
    p.add_argument("--out", default="train_step.json")
    args = p.parse_args()

    _, model = build_model(args, args.seq, gpu=gpu)
    device = next(model.parameters()).device
    head = TokenLogProbs(vocab_size=args.vocab, chunk_tokens=4096)
    tokens = torch.randint(0, args.vocab, (1, args.seq), device=device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0)
    targets = torch.roll(tokens, -1, dims=1)

    def train_step() -> None:
        lp = model(tokens, positions, None, output_processor=head, output_processor_context=targets)
        lp.sum().backward()

    def score() -> None:
        with torch.no_grad():
            model(tokens, positions, None, output_processor=head, output_processor_context=targets)

    rows = []
    n_params = sum(q.numel() for q in model.parameters())
    t_train = median_seconds(train_step)
    rows.append(("megatron_gndpo student fwd+bwd", f"{args.seq / t_train:,.0f}",
                 _gib(peak_gib(train_step))))  # fmt: skip
    model.zero_grad(set_to_none=True)
    t_score = median_seconds(score)
    rows.append(
        ("megatron_gndpo scoring (no_grad)", f"{args.seq / t_score:,.0f}", _gib(peak_gib(score)))
    )
    results = {
        "params": n_params,
        "shape": vars(args),
        "device": _device(),
        "student_tokens_per_s": args.seq / t_train,
        "scoring_tokens_per_s": args.seq / t_score,
    }

    peer = load_peer(args.peer) if gpu else None
    if peer is not None:
        shape = peer.Shape(
            hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
            ffn=args.ffn, vocab=args.vocab, seq=args.seq,
        )  # fmt: skip
        hf_train, hf_fwd = peer.hf_train_step(shape), peer.hf_forward(shape)
        results["peer_train"], results["peer_forward"] = hf_train, hf_fwd
        rows.append(("transformers + SDPA fwd+bwd (peer)", f"{hf_train['tok_s']:,.0f}",
                     f"{hf_train.get('peak_gib', float('nan')):.1f}"))  # fmt: skip
        rows.append(("transformers forward no_grad (peer)", f"{hf_fwd['tok_s']:,.0f}",
                     f"{hf_fwd.get('peak_gib', float('nan')):.1f}"))  # fmt: skip
    elif gpu:
        print("peer_step.py not found (pass --peer): peers not measured")
    else:
        print("no GPU: tiny CPU shape, numbers only show the script runs")
    print(f"{n_params / 1e9:.2f}B params, seq {args.seq}, {_device()}")
    print(table(rows, ("what", "tokens/s", "peak GiB")))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
