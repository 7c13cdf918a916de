"""Built-in rollout throughput beside transformers ``generate()`` and vLLM, in one run.

On the CPU (the default shape is issue 23's: a random Qwen2-like model, hidden 512, 4 layers,
8 heads of 64, 2 KV heads, FFN 1536, vocab 4096, fp32, 2 threads, prompt 32, 128 new tokens,
temperature 1, batches 1, 8 and 32, medians of 6 runs):
    python benchmarks/rollout.py --vllm-python /path/to/vllm-venv/bin/python
On a CUDA machine (docs/DESIGN.md's rollout peer: Qwen2.5-1.5B shape, bf16, batch 64,
128-token prompts, 256 new tokens):
    python benchmarks/rollout.py

Every engine runs the same weights: the megatron model is built from a seed and written as a
Hugging Face model, which transformers loads in this process and vLLM in its own
(``benchmarks/vllm_peer.py`` under ``--vllm-python``, an interpreter with vLLM; skipped when
none is given and this one has no vLLM). Runs are interleaved (repeat, batch, engine; the engine
order rotates) so that load from other processes falls on all of them; the table gives medians
of generated tokens/s and the ratios. The built-in is measured twice: the lean decoder (the
default) and megatron's static inference path (``decoder="megatron"``, the path before it), with
the median decode-step time early and late in each run (a step's cost should not grow with the
cached length). On a shared machine ``--wait-idle 0.9`` starts each sample only after a second
in which the CPUs were 90% idle (or after ``--wait-max`` seconds). Writes every sample, the idle
fraction before it, the host and the versions to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    VLLMPeer,
    add_shape_args,
    build_model,
    cpu_name,
    git,
    gpu_name,
    model_config,
    sync,
    table,
    version,
    wait_for_idle,
    write_hf_model,
)

from megatron_gndpo.rollout.base import SamplingParams
from megatron_gndpo.rollout.builtin import MegatronGenerator


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, gpu=gpu)
    if not gpu:  # issue 23's CPU shape (16.3M parameters), not the tiny one of the other scripts
        p.set_defaults(layers=4, hidden=512, ffn=1536, heads=8, kv_heads=2, vocab=4096)
    p.add_argument("--batches", default="64" if gpu else "1,8,32")
    p.add_argument("--prompt", type=int, default=128 if gpu else 32)
    p.add_argument("--new", type=int, default=256 if gpu else 128)
    p.add_argument("--repeats", type=int, default=3 if gpu else 6)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every engine")
    p.add_argument("--vllm-python", default=None, help="an interpreter with vLLM (the peer)")
    p.add_argument("--no-static", action="store_true", help="skip megatron's static path")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="before each sample, wait (up to --wait-max s) until the CPUs were at "
        "least this idle over one second (a shared machine)",
    )
    p.add_argument("--wait-max", type=float, default=120.0)
    p.add_argument("--out", default="rollout.json")
    args = p.parse_args()
    if not gpu:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt + args.new
    load_before = os.getloadavg()

    torch.manual_seed(1234)
    groups, model = build_model(args, max_len, gpu=gpu)
    model_cfg = model_config(args, max_len, gpu=gpu)
    hf_dir = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    write_hf_model(model, model_cfg, hf_dir)

    engines: dict[str, Callable[[list[list[int]]], int]] = {}
    steps: dict[str, list[float]] = {}
    lean = _builtin(model, groups, args, max_len, "lean", steps)
    engines["built-in"] = lean
    if not args.no_static:
        engines["built-in, megatron static path"] = _builtin(
            model, groups, args, max_len, "megatron", steps
        )
    engines["transformers generate()"] = _transformers(hf_dir, args, gpu)
    peer = _start_vllm(args, hf_dir, max_len, max(batches))
    if peer is not None:
        engines["vLLM"] = peer.generate

    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(1, args.vocab, (b, args.prompt), generator=g).tolist()
               for b in batches}  # fmt: skip
    samples: dict[str, dict[int, list[float]]] = {e: {b: [] for b in batches} for e in engines}
    idle_before: dict[str, dict[int, list[float]]] = {e: {b: [] for b in batches} for e in engines}
    step_times: dict[str, dict[int, dict[str, list[float]]]] = {}
    for b in batches:  # warm-up
        for run in engines.values():
            run(prompts[b][: min(b, 2)])
    names = list(engines)
    for r in range(args.repeats):
        for b in batches:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                steps.clear()
                idle_before[name][b].append(wait_for_idle(args.wait_idle, args.wait_max))
                sync()
                start = time.perf_counter()
                generated = engines[name](prompts[b])
                sync()
                seconds = time.perf_counter() - start
                if generated != b * args.new:
                    raise RuntimeError(f"{name} generated {generated} tokens, not {b * args.new}")
                samples[name][b].append(generated / seconds)
                decode = steps.get("decode", [])[1:]  # the first forward of a run is a prefill
                if name.startswith("built-in") and decode:
                    per = step_times.setdefault(name, {}).setdefault(b, {"early": [], "late": []})
                    per["early"] += decode[:16]
                    per["late"] += decode[-16:]
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    if peer is not None:
        peer.close()
    load_after = os.getloadavg()

    medians = {e: {b: statistics.median(v) for b, v in s.items()} for e, s in samples.items()}
    rows = []
    for b in batches:
        ours = medians["built-in"][b]
        for name in engines:
            ratio = paired = ""
            if name != "built-in":
                ratio = f"{ours / medians[name][b]:.2f}"
                # each repeat's pair ran back to back: less exposed to load that comes and goes
                ours_and_its = zip(samples["built-in"][b], samples[name][b], strict=True)
                pairs = [x / y for x, y in ours_and_its]
                wins = sum(p >= 1 for p in pairs)
                paired = f"{statistics.median(pairs):.2f} ({wins}/{len(pairs)} >= 1)"
            growth = ""
            if name in step_times:
                early = statistics.median(step_times[name][b]["early"]) * 1e3
                late = statistics.median(step_times[name][b]["late"]) * 1e3
                growth = f"{early:.2f} -> {late:.2f}"
            rows.append((str(b), name, f"{medians[name][b]:,.0f}", ratio, paired, growth))
    header = (
        "batch",
        "engine",
        "tokens/s",
        "built-in / it",
        "per repeat",
        "decode step ms (early -> late)",
    )
    print(table(rows, header))
    print(f"load average before {load_before}, after {load_after} (other processes share the CPU)")
    if args.wait_idle > 0:
        seen = [x for per in idle_before.values() for v in per.values() for x in v]
        quiet = sum(x >= args.wait_idle for x in seen)
        print(f"{quiet} of {len(seen)} samples started after a second at >= {args.wait_idle:.0%} "
              f"idle CPUs (median idle before a sample {statistics.median(seen):.0%})")  # fmt: skip
    results = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "gpu": gpu_name(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "transformers": version("transformers"), "vllm": peer.info if peer else None,
                 "load_average_before": load_before, "load_average_after": load_after},
        "shape": vars(args),
        "tokens_per_s": samples,
        "idle_before_sample": idle_before,
        "median_tokens_per_s": medians,
        "decode_step_s": step_times,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


def _builtin(
    model: Any, groups: Any, args: Any, max_len: int, decoder: str, steps: dict[str, list[float]]
) -> Callable[[list[list[int]]], int]:
    generator = MegatronGenerator(model, groups, vocab_size=args.vocab, pad_id=0,
                                  max_sequence_length=max_len, decoder=decoder)  # fmt: skip
    # time each decode forward: step cost early vs late in the run (wrapping the instance)
    if decoder == "lean":
        decoder_ = generator._lean_decoder()
        assert decoder_ is not None, "the lean decoder does not cover this model"
        decoder_.decode = _timed(decoder_.decode, steps)  # type: ignore[method-assign]
    else:
        generator._forward_last = _timed(generator._forward_last, steps)  # type: ignore[method-assign]
    # no stop token: every row generates the whole budget, as the peers do
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)

    def run(prompts: list[list[int]]) -> int:
        rollout = generator.generate(prompts, params, seeds=list(range(len(prompts))))
        return int(rollout.response_lengths.sum())

    return run


def _timed(fn: Callable[..., Any], steps: dict[str, list[float]]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = fn(*a, **k)
        sync()
        steps.setdefault("decode", []).append(time.perf_counter() - start)
        return out

    return wrapper


def _transformers(hf_dir: Path, args: Any, gpu: bool) -> Callable[[list[list[int]]], int]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if gpu else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to("cuda" if gpu else "cpu").eval()
    device = next(hf.parameters()).device

    def run(prompts: list[list[int]]) -> int:
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new,
                              min_new_tokens=args.new, pad_token_id=0)  # fmt: skip
        return int(out[:, ids.shape[1] :].numel())

    return run


def _start_vllm(args: Any, hf_dir: Path, max_len: int, max_batch: int) -> VLLMPeer | None:
    python = args.vllm_python
    if python is None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            print("vLLM peer skipped: no vLLM here; pass --vllm-python /path/to/venv/bin/python")
            return None
        python = sys.executable
    peer = VLLMPeer(python, hf_dir, max_len=max_len, max_batch=max_batch, threads=args.threads,
                     new=args.new)  # fmt: skip
    print(f"vLLM peer ready: {peer.info}", flush=True)
    return peer


if __name__ == "__main__":
    main()
