"""``megatron-gndpo compress``: a teacher made into a smaller student and distilled on-policy.

    megatron-gndpo compress --teacher ~/.cache/megatron_gndpo/real/smollm2-135m-instruct \\
        --out runs/compress --layers 10 --warmup-steps 4 --steps 24 --eval-interval 6 \\
        algorithm.estimator=topk_kd algorithm.divergence.kind=mixed

Stages (:mod:`.stages`): convert the teacher (a Hugging Face directory; a megatron checkpoint is
used as it is), prune it (``prune``: ``--layers`` or ``--keep-layers``, calibrated on the
training prompts), measure the teacher and the pruned student, warm the student up with
sequence-level KD (``--warmup-steps``), distil it on-policy through the trainer (``--steps``,
the base config ``--config`` with the dotted overrides), evaluating every ``--eval-interval``
steps; then the report (``report.md``, ``curves.jsonl``, ``curves.png``). A rerun of the same
command skips the finished stages.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_gndpo.cli_options import add_options, option

DEFAULT_CONFIG = Path("examples/compress_smollm2.yaml")
DEFAULT_EVAL = Path("examples/data/short_answers_eval.jsonl")
# Calibration prompts of the pruning unless --calib-samples says otherwise (prune's own default
# is 32; with --importance cosine a few are enough, and the teacher writes each one's answer).
CALIB_SAMPLES = 16


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--keep-layers takes layer indices separated by commas (e.g. 0,3), got {text!r}"
        ) from None


_OPTIONS = (
    option("--importance", "how prune chooses the layers: cosine (Block Importance from one "
           "forward; default, fast) or kl (greedy: the layer whose removal moves the output "
           "least, one at a time; slow on deep models)", choices=["cosine", "kl"],
           default="cosine"),
    option("--calib-samples", f"training prompts the pruning calibrates on (the first N; "
           f"default {CALIB_SAMPLES})", type=int, default=CALIB_SAMPLES),
    option("--warmup-steps", "steps of sequence-level KD before the distillation: SFT on the "
           "teacher's greedy answers to the training prompts (default 0: none)", type=int,
           default=0),
    option("--steps", "on-policy distillation steps (default 24)", type=int, default=24),
    option("--eval-interval", "evaluate every N steps (and at step 0 and the end; default 6)",
           type=int, default=6),
    option("--eval", "held-out questions: .jsonl with prompt, reference and task fields "
           f"(default {DEFAULT_EVAL})", type=Path, default=DEFAULT_EVAL, dest="eval_file",
           metavar="FILE"),
    option("--eval-samples", "samples per held-out question for the reverse KL (default 2)",
           type=int, default=2),
    option("--config", "base trainer config (default examples/compress_smollm2.yaml); each "
           "model's architecture is taken from its checkpoint", type=Path,
           default=DEFAULT_CONFIG),
    option("--tokenizer", "the teacher's tokenizer (default: the Hugging Face teacher's own, or "
           "the tokenizer files beside a megatron teacher)", default=None),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(
        parser,
        option("--teacher", "a Hugging Face model directory (converted into OUT/teacher) or a "
               "megatron checkpoint (root or iter_*, used as it is)", required=True, type=Path),
        option("--out", "the run's directory: every stage's output and the report; a rerun "
               "resumes, skipping the finished stages", required=True, type=Path),
    )  # fmt: skip
    size = parser.add_mutually_exclusive_group(required=True)
    add_options(
        size,
        option("--layers", "layers the student keeps (chosen by --importance)", type=int),
        option("--keep-layers", "the teacher layers to keep, e.g. 0,3,7", type=_layers),
    )
    add_options(parser, *_OPTIONS)
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value",
        help="dotted overrides of the base config (e.g. algorithm.estimator=topk_kd)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from megatron_gndpo.compat import notices
    from megatron_gndpo.compress import recipe, report, stages
    from megatron_gndpo.job.runlock import locked

    request = recipe.Request(
        teacher=args.teacher, out=args.out, layers=args.layers, keep_layers=args.keep_layers,
        importance=args.importance, calib_samples=args.calib_samples,
        warmup_steps=args.warmup_steps, steps=args.steps, eval_interval=args.eval_interval,
        eval_file=args.eval_file, eval_samples=args.eval_samples, config=args.config,
        overrides=tuple(args.overrides), tokenizer=args.tokenizer,
    )  # fmt: skip
    plan = recipe.plan(request)  # every check before a model is loaded
    recipe.record(request)
    notices.log_to(args.out / notices.NOTICES_FILE)
    with locked([args.out], "compress"):  # one run a directory
        results = stages.run(plan)
        path = report.write_report(plan, results)
    print(f"report written to {path} (curves: {args.out / 'curves.png'}); the distilled "
          f"student: {results['distill']['checkpoint']}")  # fmt: skip
    return 0
