"""Sampled-token log-probs: fused chunked path vs naive torch vs Megatron's cross entropy.

On a CUDA machine (the shape of docs/DESIGN.md's table, Qwen2.5-1.5B's output layer):
    python benchmarks/logprobs.py                    # T=16384, V=151936, H=1536, bf16
    python benchmarks/logprobs.py --chunk-tokens 4096
Without a GPU it runs a tiny shape on the CPU, only to show the script works.

Prints, for forward (under no_grad: teacher scoring, old log-probs) and forward+backward
(grads to hidden and weight: the student update), the median ms, the peak memory beyond the
inputs (GiB, CUDA only) and the max |difference| from the naive float32 path; and the matmul
floor 2·T·V·H / peak (×3 for forward+backward) at the bf16 peak measured in the same run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import median_seconds, sync

from megatron_gndpo.parallel.distributed import free_port
from megatron_gndpo.parallel.logprobs import vocab_parallel_logprobs


def median_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    return 1e3 * median_seconds(fn, warmup, iters)


def extra_peak_gib(fn: Callable[[], object]) -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (median_ms(lambda: a @ b, warmup=3, iters=10) / 1e3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no GPU found: tiny CPU shape, timings mean nothing")
        args.tokens, args.vocab, args.hidden, args.chunk_tokens = 512, 4096, 64, 128
    device = torch.device("cuda" if cuda else "cpu")
    # Megatron's cross entropy needs a process group: a world of one.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    T, V, H = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    weight = torch.randn(V, H, device=device, dtype=torch.bfloat16) / H**0.5
    targets = torch.randint(0, V, (T,), device=device)
    paths: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "naive: logits.float() -> log_softmax -> gather": lambda h, w: (
            torch.log_softmax((h @ w.t()).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        ),
        "megatron: logits.float() -> vocab_parallel_cross_entropy": lambda h, w: (
            -vocab_parallel_cross_entropy((h @ w.t()).float(), targets, tp_group=dist.group.WORLD)
        ),
        f"fused chunks of {args.chunk_tokens}, recompute": lambda h, w: vocab_parallel_logprobs(
            h, w, targets, chunk_tokens=args.chunk_tokens
        ),
    }
    with torch.no_grad():
        reference = next(iter(paths.values()))(hidden, weight)
    h_grad, w_grad = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def train(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        fn(h_grad, w_grad).sum().backward()
        h_grad.grad = w_grad.grad = None

    peak = matmul_peak_tflops(device, torch.bfloat16, n=8192 if cuda else 512)
    floor_ms = 2 * T * V * H / (peak * 1e12) * 1e3
    print(f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, torch {torch.__version__}")
    print(f"T={T} V={V} H={H} bf16, matmul peak {peak:.1f} TFLOP/s\n")
    print(f"{'path':58} {'fwd ms':>8} {'GiB':>6} {'fwd+bwd ms':>11} {'GiB':>6} {'max|Δ|':>8}")
    for name, fn in paths.items():
        with torch.no_grad():
            error = (fn(hidden, weight) - reference).abs().max().item()
            fwd_ms = median_ms(lambda fn=fn: fn(hidden, weight))
            fwd_gib = extra_peak_gib(lambda fn=fn: fn(hidden, weight))
        train_ms = median_ms(lambda fn=fn: train(fn))
        train_gib = extra_peak_gib(lambda fn=fn: train(fn))
        gib = [f"{g:6.2f}" if g is not None else f"{'-':>6}" for g in (fwd_gib, train_gib)]
        print(f"{name:58} {fwd_ms:8.1f} {gib[0]} {train_ms:11.1f} {gib[1]} {error:8.1e}")
    print(
        f"{'matmul floor (fwd: 1 matmul, fwd+bwd: 3)':58} {floor_ms:8.1f} {'':6} "
        f"{3 * floor_ms:11.1f}"
    )
    print("(fwd+bwd GiB include the weight and hidden gradients)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
