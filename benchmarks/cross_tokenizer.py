"""A student with one tokenizer distilled from a teacher with another.

docs/methods/cross_tokenizer.md says how; docs/demo/CROSS_TOKENIZER.md holds the results.

    python benchmarks/cross_tokenizer.py --out runs/xtok --cache-dir runs/xtok/cache
    python benchmarks/cross_tokenizer.py --out runs/xtok --quick      # 40 steps, ~5 minutes

On the demo's chains task (``6 - 0 + 8 - 6 = ?`` worked step by step):

- the **teacher** is fine-tuned with the built-in *character* tokenizer (100 ids, one per
  character: a worked solution is ~50 tokens), the demo teacher's architecture (4 layers x 128);
- the **student** is the demo's default student with the demo's *SentencePiece* tokenizer
  (every number one piece: the same solution is ~23 tokens): half the layers of the demo's
  SentencePiece teacher, pruned (``demo/models.py``), as compression by distillation is done;
- the student is trained by GNDPO with ``teacher.cross_tokenizer=true``: each sampled response is
  decoded, re-encoded in characters after the teacher's ``Q: ...\\nA: `` template, aligned, and
  each span's teacher log-prob is shared by its student tokens.

For reference, the same student is also distilled by GNDPO from the demo's own SentencePiece
teacher (its parent, the same tokenizer, the ordinary path), same seeds and settings.

Measured every ``--eval-interval`` steps on the 128 held-out problems: greedy accuracy, and on
4 samples a problem at temperature 1 the per-span reverse KL to the cross-tokenizer teacher
(``eval/xtok/span_kl``, the mean over aligned spans of ``log p_S(span) - log p_T(span)``), its
sum per student token (``eval/xtok/kl_per_token``) and the sampled accuracy. Writes
``OUT/cross_tokenizer.json`` and ``OUT/cross_tokenizer.png``; ``--doc`` also writes the table of
docs/demo/CROSS_TOKENIZER.md. One CPU process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import git, host_info  # noqa: E402

# A character-level worked solution is ~50 tokens (+ EOS): the teacher's evaluation budget
# (the demo tokenizer's is 6 * difficulty + 12 = 30).
CHAR_NEW_TOKENS = 72
# What the result file keeps of each step's metrics (all of them are in each run's
# metrics.jsonl under OUT/).
KEPT = (
    "step", "eval/", "xtok/", "score/", "advantage/std", "loss", "grad_norm",
    "response_length/mean", "time/step", "time/cross_tokenizer", "time/teacher_logprobs",
)  # fmt: skip
SHOWN = ("eval/accuracy", "eval/sampled_accuracy", "eval/xtok/span_kl", "eval/xtok/kl_per_token",
         "eval/reverse_kl")  # fmt: skip


def char_teacher_recipe(quick: bool) -> Any:
    """The demo teacher's recipe on characters (its own cache entry)."""
    from megatron_gndpo.demo import models

    base = models.teacher_recipe(quick)
    return dataclasses.replace(base, name=f"{base.name}_char", steps=base.steps + 150)


def prepare(cache: Path, quick: bool) -> dict[str, Any]:
    """The SP task, the character teacher, the SP teacher and the SP student (cached)."""
    from megatron_gndpo.data.tokenizer import CharTokenizer
    from megatron_gndpo.demo import models
    from megatron_gndpo.parallel.world import one_process_world

    task = models.build_task(cache)
    char_task = dataclasses.replace(task, tokenizer=CharTokenizer())
    out: dict[str, Any] = {"task": task}
    with one_process_world(seed=0) as groups:
        started = time.perf_counter()
        out["char_teacher"] = models.prepare(
            cache, char_teacher_recipe(quick), groups, char_task, new_tokens=CHAR_NEW_TOKENS
        )
        out["sp_teacher"] = models.prepare(cache, models.teacher_recipe(quick), groups, task)
        out["student"] = models.prepare_pruned(cache, out["sp_teacher"], task, groups)
        out["prepare_seconds"] = time.perf_counter() - started
    for key in ("char_teacher", "sp_teacher", "student"):
        m = out[key]
        how = "cached" if m.cached else f"trained {m.sft_seconds:.0f} s"
        print(f"[xtok] {m.name}: held-out greedy {m.accuracy:.3f} ({how})", flush=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from megatron_gndpo.config.schema import TeacherConfig
    from megatron_gndpo.demo.run import method_config, run_method, settings
    from megatron_gndpo.parallel.world import distributed_world

    out_dir, cache = Path(args.out), Path(args.cache_dir or Path(args.out) / "cache")
    started = time.perf_counter()
    results: dict[str, Any] = {"runs": {}}
    with distributed_world(alone="the benchmark"):
        prepared = prepare(cache, args.quick)
        s = settings(args.quick)
        s = dataclasses.replace(s, steps=args.steps or s.steps, eval_samples=4)
        char = prepared["char_teacher"]
        runs = {
            "cross": TeacherConfig(model=char.model, load=str(char.checkpoint),
                                   tokenizer="builtin:char", cross_tokenizer=True),
            "same": None,  # the demo's SP teacher, the same tokenizer as the student
        }  # fmt: skip
        for name, teacher in runs.items():
            cfg = method_config(
                "gndpo", out_dir, cache, prepared["sp_teacher"], prepared["student"],
                prepared["task"], s, name=name,
            )  # fmt: skip
            if teacher is not None:
                cfg = dataclasses.replace(cfg, teacher=teacher)
            result = run_method(cfg)
            history = [{k: v for k, v in h.items() if k.startswith(KEPT)} for h in result.history]
            results["runs"][name] = {"history": history, "wall_seconds": result.wall_seconds}
    results |= {
        "teachers": {k: {"name": prepared[k].name, "accuracy": prepared[k].accuracy}
                     for k in ("char_teacher", "sp_teacher")},
        "student": {"name": prepared["student"].name, "accuracy": prepared["student"].accuracy},
        "settings": dataclasses.asdict(s), "wall_seconds": time.perf_counter() - started,
        "command": " ".join(sys.argv), "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain")), "host": host_info(),
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cross_tokenizer.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out_dir / "cross_tokenizer.png")
    return results


def _curve(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(h["step"]), float(h[key])) for h in history if key in h]
    return [p[0] for p in points], [p[1] for p in points]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cross = results["runs"]["cross"]["history"]
    same = results["runs"]["same"]["history"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for key, label in (("xtok/span_kl", "training rollouts"),
                       ("eval/xtok/span_kl", "held-out samples")):  # fmt: skip
        ax.plot(*_curve(cross, key), label=label, marker="." if "eval" in key else None)
    ax.set(title="per-span reverse KL to the character teacher", xlabel="step", ylabel="nats/span")
    ax.legend()
    ax = axes[1]
    ax.plot(*_curve(cross, "eval/xtok/kl_per_token"), marker=".", label="cross: char teacher")
    ax.plot(*_curve(same, "eval/reverse_kl"), marker=".", label="same: SP teacher (per token)")
    ax.set(title="held-out reverse KL per student token", xlabel="step", ylabel="nats/token")
    ax.legend()
    ax = axes[2]
    teachers = results["teachers"]
    for (name, history), key in zip(
        (("cross: char teacher", cross), ("same: SP teacher", same)),
        ("char_teacher", "sp_teacher"), strict=True,
    ):  # fmt: skip
        line = ax.plot(*_curve(history, "eval/accuracy"), marker=".", label=name)[0]
        ax.axhline(teachers[key]["accuracy"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set(title="held-out greedy accuracy (dotted: the teachers')", xlabel="step", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict[str, Any]) -> str:
    """The markdown table of the evaluations of both runs."""
    rows = ["| run | step | " + " | ".join(SHOWN) + " |", "|---" * (len(SHOWN) + 2) + "|"]
    for name, r in results["runs"].items():
        for h in r["history"]:
            if "eval/accuracy" not in h:
                continue
            cells = [f"{h[k]:.3f}" if k in h else "—" for k in SHOWN]
            rows.append(f"| {name} | {h['step']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default="runs/xtok")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="40 steps, the quick teachers")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each run")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="only redraw OUT/cross_tokenizer.png from OUT/cross_tokenizer.json",
    )
    args = parser.parse_args()
    if args.replot:
        results = json.loads((Path(args.out) / "cross_tokenizer.json").read_text())
        plot(results, Path(args.out) / "cross_tokenizer.png")
    else:
        results = run(args)
    print(table(results))


if __name__ == "__main__":
    main()
