"""Convert a Hugging Face model directory to a megatron dist-checkpoint (model only, step 0).

    torchrun --nproc-per-node $((TP * PP)) tools/convert_hf_to_mcore.py \\
        --hf-dir Qwen2.5-1.5B --out ckpt/qwen2.5-1.5b --tp TP --pp PP

Same as ``megatron-gndpo convert hf-to-mcore``.
"""

from megatron_gndpo.checkpoint.convert_cli import hf_to_mcore_main

if __name__ == "__main__":  # dist-checkpointing's save starts a spawn Manager
    hf_to_mcore_main()
