"""Convert a megatron dist-checkpoint (saved at any TP/PP) to a Hugging Face model directory.

    python tools/convert_mcore_to_hf.py --mcore-dir ckpt/run --out hf_out --family qwen2

Same as ``megatron-gndpo convert mcore-to-hf``.
"""

from megatron_gndpo.checkpoint.convert_cli import mcore_to_hf_main

if __name__ == "__main__":
    mcore_to_hf_main()
