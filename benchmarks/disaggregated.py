"""Step time of colocated vs disaggregated rollouts (rollout.disaggregate), same ranks.

    python benchmarks/disaggregated.py                      # CPU: 2 ranks, the tiny example
    python benchmarks/disaggregated.py --ranks 8 --config examples/X.yaml -- model.foo=1

Runs the same config through ``torchrun -m megatron_gndpo.cli train`` three times on the same
number of ranks W: colocated (every rank samples and trains), disaggregated synchronous (the
last R ranks sample, staleness 0) and disaggregated one-step-off (staleness 1), and prints the
median ``time/step`` over the steps after the first (start-up and first compilation excluded),
with the pipeline's own numbers: how long the trainer waited for its batch (``async/wait_s``)
and how long the rollout ranks generated it (``async/generate_s``). Writes the table as JSON
with ``--out``. The disaggregated runs need a layout that fits W - R trainer ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import table

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, ranks: int, overrides: list[str], run_dir: Path) -> list[dict[str, float]]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "-m", "megatron_gndpo.cli", "train", "-c", config, f"logging.run_dir={run_dir}",
        "checkpoint.save_interval=0", *overrides,
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, cwd=ROOT, env=env, capture_output=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def median(history: list[dict[str, float]], key: str) -> float:
    values = [h[key] for h in history[1:] if key in h]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "tiny_cpu.yaml"))
    p.add_argument("--ranks", type=int, default=2, help="W: the job's ranks in every run")
    p.add_argument("--rollout-ranks", type=int, default=1, help="R: of those, rollout ranks")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    base = [f"trainer.steps={args.steps}", *args.overrides]
    apart = f"rollout.disaggregate.ranks={args.rollout_ranks}"
    runs = {
        f"colocated ({args.ranks} ranks)": base,
        f"disaggregated {args.ranks - args.rollout_ranks}+{args.rollout_ranks}, staleness 0": [
            *base, apart,
        ],
        f"disaggregated {args.ranks - args.rollout_ranks}+{args.rollout_ranks}, staleness 1": [
            *base, apart, "rollout.disaggregate.staleness=1",
        ],
    }  # fmt: skip
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(runs.items()):
            history = run(args.config, args.ranks, overrides, Path(tmp) / str(i))
            step = median(history, "time/step")
            numbers = {
                "time/step": step,
                "time/rollout": median(history, "time/rollout"),
                "async/wait_s": median(history, "async/wait_s"),
                "async/generate_s": median(history, "async/generate_s"),
                "time/update": median(history, "time/update"),
            }
            out[name] = numbers
            rows.append((name, *(f"{v:.3f}" for v in numbers.values())))
    base_step = next(iter(out.values()))["time/step"]
    header = ("run", "time/step s", "rollout s", "waited s", "generated s", "update s")
    print(table(rows, header))
    for name, numbers in out.items():
        print(f"{name}: {base_step / numbers['time/step']:.2f}x the colocated step rate")
    if args.out is not None:
        record = {"args": vars(args) | {"out": str(args.out)}, **out}
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
