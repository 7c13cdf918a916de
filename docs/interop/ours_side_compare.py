import sys; import os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
from safetensors.torch import load_file
from tests.harness import run_distributed
W = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bridge_exp/w"
def job(rank, world):
    from megatron_gndpo.compat import cpu
    cpu.enable()
    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf
    convert_mcore_to_hf(f"{W}/ours_ckpt", f"{W}/ours_export")
if __name__ == "__main__":
    run_distributed(job, 1, timeout_s=300)
    src = load_file(f"{W}/hf/model.safetensors"); b = load_file(f"{W}/bridge_export/model.safetensors"); o = load_file(f"{W}/ours_export/model.safetensors")
    print("keys equal:", set(src) == set(b) == set(o), len(src))
    print("bridge export == source:", all(torch.equal(src[k], b[k]) for k in src), {str(t.dtype) for t in b.values()}, b["model.embed_tokens.weight"].shape)
    print("bridge export == our export:", all(torch.equal(o[k], b[k]) for k in src), {str(t.dtype) for t in o.values()})
