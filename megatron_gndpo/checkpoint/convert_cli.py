"""Command-line front ends of the conversions (``megatron-gndpo convert ...`` and ``tools/``).

    torchrun --nproc-per-node $((TP * PP)) -m megatron_gndpo.cli convert hf-to-mcore \\
        --hf-dir Qwen2.5-1.5B --out ckpt/qwen2.5-1.5b --tp TP --pp PP
    torchrun --nproc-per-node $((TP * EP * PP)) -m megatron_gndpo.cli convert hf-to-mcore \\
        --hf-dir Qwen3-30B-A3B --out ckpt/qwen3-30b-a3b --tp TP --ep EP --pp PP   # MoE
    megatron-gndpo convert mcore-to-hf --mcore-dir runs/x/checkpoints --out hf_out --family qwen2
    megatron-gndpo convert mcore-to-hf --mcore-dir runs/x/checkpoints --out hf_out \
        --fp8-out hf_out_fp8 --calib-data /data/train.jsonl      # + FP8 (needs modelopt)

Neither direction writes into a directory that holds anything unless ``--overwrite`` is given
(then the files it writes are replaced and the others kept), nor ever into a training run's
checkpoint directory (one with optimizer state, or a run's lock), which a later ``train``
would no longer resume from (:func:`check_output`).

hf-to-mcore: every rank builds and fills its own shard (a mixture-of-experts model's experts
split over ``--ep`` ranks, which come out of the data-parallel ranks: the world is a multiple
of TP x EP x PP); the checkpoint loads at any TP/PP/EP.
mcore-to-hf: one process; the architecture comes from the checkpoint's model_config.yaml
(written by hf-to-mcore and by training), for a checkpoint of Megatron-Bridge or Megatron-LM from
its step's run_config.yaml or saved args (``checkpoint/foreign_config.py``), unless
--model-config names a YAML file holding a ModelConfig or a whole run config (its ``model``
section is used). The weights keep the dtype
they were saved in unless ``--dtype`` casts them. With ``--fp8-out`` the export is then
quantized to FP8 by ModelOpt (``checkpoint/export_fp8.py``).

Vision-language models (``checkpoint/vlm_convert.py``) take the same commands: hf-to-mcore
converts an InternVL directory (``model_type: internvl``, transformers' native format) to a VLM
checkpoint with ``vision_config.yaml`` beside it; mcore-to-hf writes an InternVL directory when
that file is there (or ``--vision-config`` names one), ``--family`` then naming the language
model's family.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_gndpo.cli_options import add_options, option

if TYPE_CHECKING:
    from megatron_gndpo.config.schema import ModelConfig


# Both directions write into a directory that must not hold anything else (check_output).
_OVERWRITE = option(
    "--overwrite",
    "write into an output directory that is not empty: the files the conversion writes are "
    "replaced, the others kept (never allowed: a training run's checkpoints)",
    action="store_true",
)
_HF_TO_MCORE_OPTIONS = (
    option("--hf-dir", "Hugging Face model directory", required=True),
    option("--out", "checkpoint root to write", required=True),
    _OVERWRITE,
    option("--tp", "tensor-parallel size", type=int, default=1),
    option("--pp", "pipeline-parallel size", type=int, default=1),
    option("--ep", "expert-parallel size of a mixture-of-experts model (Qwen3-MoE): each rank "
           "holds num_experts / EP experts; the world size must divide by TP x EP x PP",
           type=int, default=1),
    option("--model-class", "megatron-core class the checkpoint is written for "
           "(model.model_class); a gpt checkpoint also loads into a hybrid run",
           choices=("gpt", "hybrid"), default="gpt"),
)  # fmt: skip
_MCORE_TO_HF_OPTIONS = (
    option("--mcore-dir", "checkpoint root or iter_* directory", required=True),
    option("--out", "Hugging Face directory to write", required=True),
    _OVERWRITE,
    option("--family", "HF model family, of the language model for a VLM (default: the source "
           "model's, if conversion saved it)", choices=["llama", "qwen2", "qwen3", "qwen3_moe"],
           default=None),
    option("--dtype", "dtype of the exported weights (default: the one the checkpoint's weights "
           "were saved in)", choices=["bf16", "fp16", "fp32"], default=None),
    option("--tokenizer-dir", "copy tokenizer files from here", default=None),
    option("--model-config", "YAML file with the ModelConfig (default: the checkpoint's "
           "model_config.yaml, or what Megatron-Bridge's run_config.yaml / Megatron-LM's saved "
           "args in the step say)", default=None),
    option("--vision-config", "YAML file with the VisionConfig: export a VLM as InternVL "
           "(default: when the checkpoint has vision_config.yaml beside it)", default=None),
)  # fmt: skip


def hf_to_mcore_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megatron-gndpo convert hf-to-mcore",
        description="Convert a Hugging Face model directory to a megatron dist-checkpoint "
        "(model only, step 0).",
    )
    add_options(parser, *_HF_TO_MCORE_OPTIONS)
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    check_output(args.out, overwrite=args.overwrite)

    import torch.distributed as dist

    from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore, read_hf_config
    from megatron_gndpo.checkpoint.vlm_convert import convert_vlm_hf_to_mcore, is_hf_vlm

    read_hf_config(args.hf_dir)  # a missing or damaged config.json: said before any start-up
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed
    from megatron_gndpo.parallel.groups import build_student_groups

    env = init_distributed()
    cpu.enable_if_no_cuda()
    try:
        layout = _layout(parser, env.world_size, args)
        groups = build_student_groups(layout)
        parallel = ParallelConfig(
            tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep
        )
        what = ""
        if is_hf_vlm(args.hf_dir) and args.ep > 1:
            parser.error("--ep applies to mixture-of-experts models; a VLM converts at --ep 1")
        if is_hf_vlm(args.hf_dir) and args.model_class != "gpt":
            parser.error("a VLM's language model is a GPTModel: leave out --model-class")
        if is_hf_vlm(args.hf_dir):
            model, vision = convert_vlm_hf_to_mcore(
                args.hf_dir, args.out, groups=groups, parallel=parallel
            )
            what = f"{vision.encoder} encoder of {vision.num_layers} layers + LM of "
        else:
            model = convert_hf_to_mcore(
                args.hf_dir, args.out, groups=groups, parallel=parallel,
                model_class=args.model_class,
            )  # fmt: skip
        if dist.get_rank() == 0:
            print(
                f"wrote {args.out} (step 0, {what}{model.num_layers} layers, hidden "
                f"{model.hidden_size}, saved at TP={args.tp} PP={args.pp} EP={args.ep})"
            )
    finally:
        shutdown_distributed()


def _layout(parser: argparse.ArgumentParser, world: int, args: argparse.Namespace) -> Any:
    """The conversion's ParallelLayout; a world that does not fit exits with the reason."""
    from megatron_gndpo.parallel.groups import ParallelLayout

    try:
        return ParallelLayout(world, tp=args.tp, pp=args.pp, ep=args.ep)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err} (started {world} processes)\n")


def mcore_to_hf_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megatron-gndpo convert mcore-to-hf",
        description="Convert a megatron dist-checkpoint (saved at any TP/PP) to a Hugging Face "
        "model directory.",
    )
    add_options(parser, *_MCORE_TO_HF_OPTIONS)
    _add_fp8_args(parser)
    args = parser.parse_args(argv)
    from megatron_gndpo.checkpoint.vlm_convert import is_vlm_checkpoint

    check_output(args.out, overwrite=args.overwrite, source=args.mcore_dir)
    if args.fp8_out is not None:
        check_output(
            args.fp8_out, overwrite=args.overwrite, source=args.mcore_dir, flag="--fp8-out"
        )
    vlm = args.vision_config is not None or is_vlm_checkpoint(args.mcore_dir)
    if vlm and args.fp8_out is not None:
        parser.error("--fp8-out is not supported for vision-language models")
    texts = _fp8_calibration_texts(parser, args)  # fail before the export, not after it

    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf, read_model_config_file
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed

    model = None if args.model_config is None else read_model_config_file(args.model_config)
    init_distributed()
    cpu.enable_if_no_cuda()
    try:
        if vlm:
            out = _vlm_mcore_to_hf(args, model)
        else:
            out = convert_mcore_to_hf(
                args.mcore_dir,
                args.out,
                model=model,
                family=args.family,
                dtype=args.dtype,
                tokenizer_dir=args.tokenizer_dir,
            )
    finally:
        shutdown_distributed()
    print(f"wrote {out}")
    if args.fp8_out is not None:
        from megatron_gndpo.checkpoint.export_fp8 import export_fp8, tokenize_calibration

        if not (out / "tokenizer_config.json").is_file():
            parser.exit(2, f"{parser.prog}: error: FP8 calibration needs the model's tokenizer "
                        f"and {out} has none: pass --tokenizer-dir\n")  # fmt: skip
        ids = tokenize_calibration(texts, out, max_tokens=args.calib_max_tokens)
        print(f"calibrating FP8 scales on {len(ids)} prompts ({sum(map(len, ids)):,} tokens)")
        print(f"wrote {export_fp8(out, args.fp8_out, ids)} (FP8, ModelOpt unified HF format)")


def _vlm_mcore_to_hf(args: argparse.Namespace, model: ModelConfig | None) -> Path:
    from megatron_gndpo.checkpoint.vlm_convert import convert_vlm_mcore_to_hf
    from megatron_gndpo.config.loader import build, read_yaml
    from megatron_gndpo.config.vision import VisionConfig

    vision = None
    if args.vision_config is not None:
        vision = build(VisionConfig, read_yaml(args.vision_config), prefix="vision.")
    return convert_vlm_mcore_to_hf(
        args.mcore_dir,
        args.out,
        model=model,
        vision=vision,
        family=args.family,
        dtype=args.dtype,
        tokenizer_dir=args.tokenizer_dir,
    )


def check_output(
    out: str | Path, *, overwrite: bool, source: str | Path | None = None, flag: str = "--out"
) -> None:
    """Refuse an output directory whose content the conversion would damage: a training run's
    checkpoint directory (steps with optimizer state, or a run's lock file), the source itself,
    and, without ``overwrite``, any directory that is not empty. A ConversionError naming it."""
    from megatron_gndpo.checkpoint.dist import step_dir, training_steps
    from megatron_gndpo.errors import ConversionError
    from megatron_gndpo.job.runlock import LOCK_FILE

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{flag} {out} is a file, not a directory; choose a directory")
    if not out.is_dir():
        return
    trained = training_steps(out)
    if trained or (out / LOCK_FILE).exists():
        what = (
            f"holds a training run's checkpoints (newest {step_dir(out, trained[-1]).name})"
            if trained
            else "belongs to a training run (its lock file is there)"
        )
        raise ConversionError(
            f"{flag} {out} {what}: a conversion never writes there (it would replace its "
            f"latest, model_config.yaml and train state, and the run would not resume); "
            f"choose a new directory"
        )
    if source is not None and out.resolve() in (
        Path(source).resolve(),
        Path(source).resolve().parent,
    ):
        raise ConversionError(f"{flag} {out} is the checkpoint being converted; choose another")
    entries = sorted(p.name for p in out.iterdir())
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (
            f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        )
        raise ConversionError(
            f"{flag} {out} is not empty (it holds {shown}): choose a new or empty directory, or "
            "pass --overwrite to replace the files the conversion writes (the others are kept)"
        )


def _add_fp8_args(parser: argparse.ArgumentParser) -> None:
    from megatron_gndpo.checkpoint.export_fp8 import (
        DEFAULT_CALIBRATION_SAMPLES,
        DEFAULT_CALIBRATION_TOKENS,
    )

    fp8 = parser.add_argument_group(
        "FP8 export (needs the modelopt extra)",
        "Also quantize the exported model to FP8 with NVIDIA ModelOpt (static per-tensor scales "
        "calibrated on a few prompts) into a directory vLLM loads. Runs on a GPU when visible.",
    )
    add_options(
        fp8,
        option("--fp8-out", "write the FP8 model to this directory", default=None),
        option("--calib-data", "calibration prompts: a .txt file (one per line), .jsonl, "
               ".parquet or builtin:NAME", default=None),
        option("--calib-key", "prompt column of .jsonl/.parquet", default="prompt"),
        option("--calib-samples", f"prompts to calibrate on (default "
               f"{DEFAULT_CALIBRATION_SAMPLES})", type=int, default=DEFAULT_CALIBRATION_SAMPLES),
        option("--calib-max-tokens", f"tokens kept per prompt (default "
               f"{DEFAULT_CALIBRATION_TOKENS})", type=int, default=DEFAULT_CALIBRATION_TOKENS),
    )  # fmt: skip


def _fp8_calibration_texts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The calibration prompts of ``--fp8-out`` (none without it); exits with the reason when
    ModelOpt is missing or the prompts cannot be read."""
    if args.fp8_out is None:
        return []
    from megatron_gndpo.checkpoint.export_fp8 import calibration_texts, require_modelopt
    from megatron_gndpo.config.extras import MissingExtraError

    try:
        require_modelopt()
    except MissingExtraError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.calib_data is None:
        parser.error("--fp8-out needs --calib-data (prompts to calibrate the FP8 scales on)")
    try:
        return calibration_texts(args.calib_data, key=args.calib_key, limit=args.calib_samples)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
