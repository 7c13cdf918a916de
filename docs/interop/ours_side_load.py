"""In our venv: the Bridge-written checkpoint loaded as our teacher; log-probs vs transformers."""
import sys, json
import os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
from tests.harness import run_distributed

W = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bridge_exp/w"

def job(rank, world):
    from megatron_gndpo.compat import cpu
    cpu.enable()
    from megatron_gndpo.checkpoint import hf_mapping
    from megatron_gndpo.checkpoint.convert import read_hf_config, convert_hf_to_mcore
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    model = hf_mapping.model_config_from_hf(read_hf_config(f"{W}/hf"))
    groups = build_student_groups(ParallelLayout(world), seed=1)
    net = build_teacher(model, ParallelConfig(), groups)
    meta = load_checkpoint(f"{W}/bridge_ckpt", net, vocab_size=model.vocab_size)
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = net(tokens, torch.arange(12).expand(2, -1), None)
    ours_bridge = logits[..., :1000].double().log_softmax(-1)
    # ours, from our own import, for comparison; also the checkpoint Bridge will export
    convert_hf_to_mcore(f"{W}/hf", f"{W}/ours_ckpt", groups=groups, parallel=ParallelConfig())
    net2 = build_teacher(model, ParallelConfig(), groups)
    load_checkpoint(f"{W}/ours_ckpt", net2, vocab_size=model.vocab_size)
    with torch.no_grad():
        ours = net2(tokens, torch.arange(12).expand(2, -1), None)[..., :1000].double().log_softmax(-1)
    return {"meta": meta, "rows": net.output_layer.weight.shape[0], "bridge": ours_bridge, "ours": ours, "tokens": tokens}

if __name__ == "__main__":
    import transformers
    out = run_distributed(job, 1, timeout_s=300)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(f"{W}/hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=out["tokens"]).logits.double().log_softmax(-1)
    print("meta", {k: out["meta"][k] for k in ("step", "verified", "foreign")}, "rows", out["rows"])
    print("Bridge ckpt as our teacher vs transformers: max |dlogp| =", (out["bridge"] - ref).abs().max().item())
    print("our import vs transformers:", (out["ours"] - ref).abs().max().item())
    print("Bridge-import vs our-import:", (out["bridge"] - out["ours"]).abs().max().item())
