"""Command-line front ends of the conversions (``megatron-gndpo convert ...`` and ``tools/``).

    torchrun --nproc-per-node $((TP * PP)) -m megatron_gndpo.cli convert hf-to-mcore \\
        --hf-dir Qwen2.5-1.5B --out ckpt/qwen2.5-1.5b --tp TP --pp PP
    megatron-gndpo convert mcore-to-hf --mcore-dir runs/x/checkpoints --out hf_out --family qwen2

hf-to-mcore: every rank builds and fills its own shard; the checkpoint loads at any TP/PP.
mcore-to-hf: one process; the architecture comes from the checkpoint's model_config.yaml
(written by hf-to-mcore and by training) unless --model-config names a YAML file holding a
ModelConfig or a whole run config (its ``model`` section is used).
"""

from __future__ import annotations

import argparse


def hf_to_mcore_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megatron-gndpo convert hf-to-mcore",
        description="Convert a Hugging Face model directory to a megatron dist-checkpoint "
        "(model only, step 0).",
    )
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    parser.add_argument("--out", required=True, help="checkpoint root to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    env = init_distributed()
    cpu.enable_if_no_cuda()
    try:
        groups = build_student_groups(ParallelLayout(env.world_size, tp=args.tp, pp=args.pp))
        parallel = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp)
        model = convert_hf_to_mcore(args.hf_dir, args.out, groups=groups, parallel=parallel)
        if dist.get_rank() == 0:
            print(
                f"wrote {args.out} (step 0, {model.num_layers} layers, hidden "
                f"{model.hidden_size}, saved at TP={args.tp} PP={args.pp})"
            )
    finally:
        shutdown_distributed()


def mcore_to_hf_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megatron-gndpo convert mcore-to-hf",
        description="Convert a megatron dist-checkpoint (saved at any TP/PP) to a Hugging Face "
        "model directory.",
    )
    parser.add_argument("--mcore-dir", required=True, help="checkpoint root or iter_* directory")
    parser.add_argument("--out", required=True, help="Hugging Face directory to write")
    parser.add_argument(
        "--family",
        choices=["llama", "qwen2", "qwen3"],
        default=None,
        help="HF model family (default: the source model's, if conversion saved it)",
    )
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here")
    parser.add_argument("--model-config", default=None, help="YAML file with the ModelConfig")
    args = parser.parse_args(argv)

    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.loader import build, read_yaml
    from megatron_gndpo.config.schema import ModelConfig
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed

    model = None
    if args.model_config is not None:
        data = read_yaml(args.model_config)
        if isinstance(data.get("model"), dict):  # a whole run config: take its model section
            data = data["model"]
        model = build(ModelConfig, data, prefix="model.")
    init_distributed()
    cpu.enable_if_no_cuda()
    try:
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
