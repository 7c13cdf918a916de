"""``megatron-gndpo prune``: write a student checkpoint pruned from a teacher checkpoint.

    megatron-gndpo prune --teacher ckpt/smollm2-135m --out ckpt/student-10l --num-layers 10 \\
        --calib-data prompts.jsonl
    megatron-gndpo prune --teacher runs/demo/cache/teacher/checkpoint --out student \\
        --keep-layers 0,3 --tokenizer runs/demo/cache/tokenizer/tokenizer.model \\
        --calib-data builtin:chains
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_gndpo.cli_options import add_options, option
from megatron_gndpo.errors import UserError

# Calibration prompts used unless --calib-samples says otherwise: the greedy search costs about
# L^2/2 forwards of them, seconds for the demo's 4 layers on a CPU, about two hours for
# SmolLM2's 30 (8 prompts: 30 min; docs/PRUNING.md).
CALIB_SAMPLES = 32
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--keep-layers takes layer indices separated by commas (e.g. 0,3), got {text!r}"
        ) from None


_OPTIONS = (
    option("--ffn-hidden-size", "also cut each kept layer's FFN to this many neurons (the most "
           "active ones)", type=int, default=None),
    option("--importance", "kl: drop, one at a time, the layer whose removal moves the output "
           "least (greedy; default); cosine: Block Importance from one forward (faster on deep "
           "models)", choices=["kl", "cosine"], default="kl"),
    option("--calib-data", "calibration prompts (required): a .jsonl/.parquet prompt file or "
           "builtin:NAME; the teacher's greedy answers to them are the calibration text",
           required=True),
    option("--calib-prompt-key", "the field of a --calib-data record that holds its prompt "
           "(default: prompt)", default="prompt"),
    option("--calib-samples", f"calibration prompts used (the first N; default {CALIB_SAMPLES})",
           type=int, default=CALIB_SAMPLES),
    option("--calib-new-tokens", "length limit of the teacher's calibration answers (default 64)",
           type=int, default=64),
    option("--tokenizer", "data.tokenizer of the teacher (default: the tokenizer files beside "
           "the teacher checkpoint)", default=None),
    option("--model-config", "YAML file with the teacher's ModelConfig (or a whole run config), "
           "when no model_config.yaml is beside the checkpoint", default=None),
    option("--dtype", "measure and save in this dtype (default: as saved)",
           choices=["fp32", "bf16"], default=None),
    option("--overwrite", "replace a student prune wrote in --out before (its prune.json is "
           "there); nothing else is ever replaced", action="store_true"),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(
        parser,
        option("--teacher", "teacher checkpoint (root or iter_*)", required=True),
        option("--out", "new directory for the student", required=True, type=Path),
    )
    size = parser.add_mutually_exclusive_group(required=True)
    add_options(
        size,
        option("--num-layers", "layers the student keeps (searched)", type=int),
        option("--keep-layers", "the teacher layers to keep, e.g. 0,3", type=_layers),
    )
    add_options(parser, *_OPTIONS)


def tokenizer_spec(teacher: str, given: str | None) -> str:
    """``given``, else the teacher checkpoint's own tokenizer files (beside its root); a
    UserError naming ``--tokenizer`` when there are none."""
    if given is not None:
        return given
    from megatron_gndpo.checkpoint.dist import resolve

    step = resolve(teacher)
    base = Path(teacher) if step != Path(teacher) else step.parent
    if any((base / name).is_file() for name in _TOKENIZER_FILES):
        return str(base)  # a Hugging Face tokenizer, or a SentencePiece model (the demo's)
    raise UserError(
        f"no tokenizer files beside {base}: pass --tokenizer (the teacher's data.tokenizer: a "
        "SentencePiece .model file or a Hugging Face tokenizer directory)"
    )


def main(args: argparse.Namespace) -> int:
    from megatron_gndpo.compat import notices

    notices.quiet_known_notices()
    from megatron_gndpo.checkpoint.convert import read_model_config_file
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.data.datasets import PromptOptions, load_prompts
    from megatron_gndpo.data.tokenizer import load_tokenizer
    from megatron_gndpo.prune.run import (
        PruneError,
        check_output,
        check_shape,
        prune_checkpoint,
        teacher_architecture,
    )

    check_output(args.out, args.overwrite, args.teacher)  # before anything is loaded
    if args.calib_samples < 1 or args.calib_new_tokens < 1:
        raise PruneError("--calib-samples and --calib-new-tokens must be at least 1")
    model = None if args.model_config is None else read_model_config_file(args.model_config)
    check_shape(  # the architecture beside the checkpoint is enough: before any weight is read
        teacher_architecture(args.teacher, model), num_layers=args.num_layers or 0,
        keep_layers=args.keep_layers, ffn_hidden_size=args.ffn_hidden_size,
    )  # fmt: skip
    tokenizer = load_tokenizer(tokenizer_spec(args.teacher, args.tokenizer), setting="--tokenizer")
    examples = load_prompts(
        args.calib_data, prompt_key=args.calib_prompt_key,
        named_by=PromptOptions(file="--calib-data", prompt_key="--calib-prompt-key"),
    )  # fmt: skip
    prompts = [e.prompt for e in examples[: args.calib_samples]]
    cpu.enable_if_no_cuda()
    result = prune_checkpoint(  # in a one-process world of its own
        args.teacher, args.out, num_layers=args.num_layers or 0, tokenizer=tokenizer,
        prompts=prompts, ffn_hidden_size=args.ffn_hidden_size, keep_layers=args.keep_layers,
        importance=args.importance, max_new_tokens=args.calib_new_tokens,
        overwrite=args.overwrite, dtype=args.dtype, model=model,
    )  # fmt: skip
    m = result.model
    print(
        f"wrote {result.out} (step 0): {m.num_layers} layers {list(result.choice.keep)} of the "
        f"teacher's, FFN {m.ffn_hidden_size}, {result.student_parameters / 1e6:.1f}M of "
        f"{result.teacher_parameters / 1e6:.1f}M parameters; calibration KL from the teacher "
        f"{result.kl:.4f} nats/token over {result.calibration_tokens} tokens "
        f"({result.seconds:.0f} s); details in {result.out / 'prune.json'}"
    )
    return 0
