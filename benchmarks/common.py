"""Shared helpers of the benchmark scripts: timing, memory, the process's megatron world, peers.

The peer baselines live in ``shared/bench/peer_step.py`` beside the checkout (or wherever
``--peer`` points); a benchmark imports it to measure the peer in the same run.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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


# A benchmark's world lasts as long as its process: entered once, never left.
_PROCESS_WORLD = contextlib.ExitStack()


def process_world(seed: int = 1234):  # type: ignore[no-untyped-def]
    """The package's one-process world (torch.distributed, CPU compat if no GPU, the student's
    megatron groups seeded with ``seed``) for the rest of this process; returns the groups."""
    from megatron_gndpo.parallel.world import one_process_world

    return _PROCESS_WORLD.enter_context(one_process_world(seed=seed))


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

    groups = process_world()
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


# ---------------------------------------------------------------------------------------------
# The vLLM peer (benchmarks/vllm_peer.py in an interpreter with vLLM) and the host's description

VLLM_PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")


class VLLMPeer:
    """benchmarks/vllm_peer.py in its own interpreter, one request line at a time."""

    def __init__(
        self, python: str, hf_dir: Path, *, max_len: int, max_batch: int, threads: int, new: int
    ) -> None:
        self.new = new
        env = os.environ | {
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": "",  # its own packages only
        }
        command = [python, str(VLLM_PEER_SCRIPT), "--model", str(hf_dir), "--max-model-len",
                   str(max_len), "--max-batch", str(max_batch)]  # fmt: skip
        self.log = Path(tempfile.mkstemp(prefix="vllm_peer_", suffix=".log")[1])
        with self.log.open("w") as log:  # vLLM's own output, for when it fails
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env)  # fmt: skip
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@peer "):
                return json.loads(line[len("@@peer ") :])  # type: ignore[no-any-return]
        code = self.proc.wait()
        tail = "\n".join(self.log.read_text().splitlines()[-15:])
        raise RuntimeError(
            f"the vLLM peer exited (code {code}) without answering; {self.log}:\n{tail}"
        )

    def generate(self, prompts: list[list[int]]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": self.new}) + "\n")
        self.proc.stdin.flush()
        return int(self._read()["generated"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def idle_fraction(seconds: float = 1.0) -> float:
    """How idle all CPUs were over ``seconds`` (/proc/stat; 1.0 where it cannot be read)."""

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = read()
        time.sleep(seconds)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_idle(fraction: float, max_seconds: float) -> float:
    """Wait until the CPUs were at least ``fraction`` idle over a second (at most
    ``max_seconds``); return the last idle fraction seen."""
    if fraction <= 0:
        return float("nan")
    deadline = time.monotonic() + max_seconds
    idle = idle_fraction()
    while idle < fraction and time.monotonic() < deadline:
        idle = idle_fraction()
    return idle


def git(*command: str) -> str:
    try:
        return subprocess.check_output(["git", *command], text=True,
                                       cwd=Path(__file__).parent).strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """The machine and versions a result file names (CPU, cores, GPU, Python, torch,
    transformers), with the load average now."""
    return {
        "cpu": cpu_name(), "cores": os.cpu_count(), "gpu": gpu_name(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": version("transformers"), "load_average": os.getloadavg(),
    }  # fmt: skip


def say_measured(name: str, seed: int, found: dict[str, Any]) -> None:
    """One line of a learning study's measures (its floats) as they come."""
    shown = " ".join(f"{k} {v:.3f}" for k, v in found.items() if isinstance(v, float))
    print(f"[{name} s{seed}] {shown}", flush=True)


def mean_curves(
    runs: Sequence[dict[str, Any]], measures: Sequence[str]
) -> dict[str, dict[int, dict[str, float]]]:
    """A learning study's curves (``runs``: one dict a run, with ``method`` and ``curve``: the
    measures at each evaluated ``step``): per method, per step, each measure's mean over the
    seeds and its standard deviation (``KEY_sd``, 0 for one seed)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        out[method] = {}
        for step in sorted({c["step"] for r in mine for c in r["curve"]}):
            at = [c for r in mine for c in r["curve"] if c["step"] == step]
            row: dict[str, float] = {}
            for key in measures:
                values = [c[key] for c in at]
                row[key] = statistics.fmean(values)
                row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
            out[method][step] = row
    return out


# for methods a study gives no colour (tab:* are the studies' own)
_SPARE_COLOURS = ("tab:cyan", "black", "gold", "teal", "navy", "magenta", "lime", "maroon")


def plot_curves(
    runs: Sequence[dict[str, Any]],
    measures: Sequence[str],
    panels: Sequence[tuple[str, str]],
    colours: dict[str, str],
    path: Path,
    *,
    reference: tuple[dict[str, float], str] | None = None,
) -> None:
    """One panel per ``(measure, title)`` of ``panels``: each run's curve faint, each method's
    mean over seeds bold (``colours`` by method); ``reference``: a dashed level per panel (its
    value by measure, and its label), e.g. the teacher's."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CPU box
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    curves = mean_curves(runs, measures)
    spare = iter(c for c in _SPARE_COLOURS if c not in colours.values())
    colours = {**{m: next(spare, "gray") for m in curves if m not in colours}, **colours}
    for ax, (key, title) in zip(axes, panels, strict=True):
        for r in runs:
            ax.plot([c["step"] for c in r["curve"]], [c[key] for c in r["curve"]],
                    color=colours.get(r["method"]), alpha=0.25, lw=1)  # fmt: skip
        for method, steps in curves.items():
            ax.plot(list(steps), [v[key] for v in steps.values()], color=colours.get(method),
                    lw=2, marker="o", ms=3, label=method)  # fmt: skip
        if reference is not None:
            ax.axhline(reference[0][key], color="black", ls="--", lw=1, label=reference[1])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
