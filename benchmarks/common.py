"""Shared helpers of the benchmark scripts: timing, memory, a one-process megatron world, peers.

The peer baselines live in ``shared/bench/peer_step.py`` beside the checkout (or wherever
``--peer`` points); a benchmark imports it to measure the peer in the same run.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_gib(fn: Callable[[], object]) -> float | None:
    """Peak CUDA memory while ``fn`` runs (GiB, everything allocated); None on CPU."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def one_process_world(tp: int = 1, seed: int = 1234):  # type: ignore[no-untyped-def]
    """torch.distributed with one rank and the student's megatron groups (CPU compat if no GPU)."""
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.parallel.distributed import init_distributed
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    env = init_distributed()
    cpu.enable_if_no_cuda()
    return build_student_groups(ParallelLayout(env.world_size, tp=tp), seed=seed)


def load_peer(path: str | None) -> ModuleType | None:
    """``peer_step.py`` from ``path`` or ``../shared/bench`` beside the checkout; None if absent."""
    candidates = [Path(path)] if path else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "bench" / "peer_step.py")
    for candidate in candidates:
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location("peer_step", candidate)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["peer_step"] = module
            spec.loader.exec_module(module)
            return module
    return None


def add_shape_args(parser: Any, *, gpu: bool) -> None:
    """The model shape: Qwen2.5-1.5B (docs/DESIGN.md) on a GPU, a tiny one on the CPU."""
    parser.add_argument("--layers", type=int, default=28 if gpu else 2)
    parser.add_argument("--hidden", type=int, default=1536 if gpu else 64)
    parser.add_argument("--ffn", type=int, default=8960 if gpu else 128)
    parser.add_argument("--heads", type=int, default=12 if gpu else 4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936 if gpu else 512)
    parser.add_argument("--peer", default=None, help="path to peer_step.py")


def model_config(args: Any, max_positions: int, *, gpu: bool):  # type: ignore[no-untyped-def]
    """The Qwen2-like ModelConfig of the shape in ``args`` (bf16 on a GPU, fp32 on the CPU)."""
    from megatron_gndpo.config.schema import ModelConfig

    return ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.kv_heads, vocab_size=args.vocab,
        make_vocab_size_divisible_by=128, max_position_embeddings=max_positions,
        add_qkv_bias=True, params_dtype="bf16" if gpu else "fp32",
    )  # fmt: skip


def build_model(args: Any, max_positions: int, *, gpu: bool):  # type: ignore[no-untyped-def]
    """(groups, GPTModel) of the shape in ``args`` on a one-process world, on the GPU if any."""
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_gpt

    groups = one_process_world()
    model = build_gpt(model_config(args, max_positions, gpu=gpu), ParallelConfig(), groups)
    return groups, model.cuda() if gpu else model


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def write_hf_model(model: Any, model_cfg: Any, out: Path) -> None:
    """The megatron model as a Hugging Face Qwen2 directory (config.json + safetensors)."""
    from safetensors.torch import save_file

    from megatron_gndpo.checkpoint import hf_mapping

    state = {k: v for k, v in model.state_dict().items() if not hf_mapping.is_extra_state(k)}
    tensors = hf_mapping.megatron_to_hf(state, model_cfg, family="qwen2")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    config = hf_mapping.hf_config_from_model(model_cfg, "qwen2")
    (out / "config.json").write_text(json.dumps(config, indent=1))
