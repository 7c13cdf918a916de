"""Megatron-Bridge's side of the CPU round trips (run with the Bridge venv's python, this
checkout on PYTHONPATH; see README.md; tests/test_bridge.py runs it).

    python bridge_side.py WORK make_hf FAMILY   # a tiny random qwen2/qwen3/llama in WORK/hf
    python bridge_side.py WORK import           # HF -> Bridge checkpoint WORK/bridge_ckpt
    python bridge_side.py WORK export CKPT OUT  # a megatron checkpoint -> HF via Bridge
    python bridge_side.py WORK prepare FAMILY   # make_hf then import, in one process

Several steps in one process (one Bridge import, ~10 s, instead of one per step), joined by ``+``:

    python bridge_side.py W1 prepare qwen2 + W2 prepare llama
"""

import os
import sys
import time

# Before the stub: megatron-core's TE-sensitive modules must see no Transformer Engine.
import megatron.core
import megatron.core.models.gpt.gpt_layer_specs
import megatron.core.models.hybrid.hybrid_layer_specs
import megatron.training.models.hybrid  # noqa: F401

STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_stub")
sys.path.insert(0, STUB)
import torch  # noqa: E402
import transformers  # noqa: E402

t0 = time.time()
from megatron.bridge import AutoBridge  # noqa: E402

sys.path.remove(STUB)  # spawned helper processes (dist-checkpointing's Manager) must not see it
print("bridge import", round(time.time() - t0, 1), "s", flush=True)

# Megatron-core's fusions that need a GPU (apex's fused wgrad, fused kernels).
FUSIONS = (
    "gradient_accumulation_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "cross_entropy_loss_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "bias_dropout_fusion",
)
# Tiny models of each family: 2 layers, hidden 64, 4 heads (2 KV groups), vocabulary 1000.
FAMILIES = {
    "qwen2": dict(rope_theta=1e6),
    "qwen3": dict(rope_theta=1e6, head_dim=16),
    "llama": dict(rope_theta=5e5, attention_bias=False, mlp_bias=False),
}


def _cpu_copy(ckpt):
    """A copy of a checkpoint whose run_config.yaml asks Bridge for megatron-core's local layers
    without fusions: its defaults (Transformer Engine layers, apex's fused wgrad) need a GPU."""
    import glob
    import shutil

    import yaml

    out = ckpt.rstrip("/") + "_cpu"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(ckpt, out)
    for path in glob.glob(f"{out}/iter_*/run_config.yaml"):
        with open(path) as f:
            d = yaml.safe_load(f)
        d["model"]["transformer_layer_spec"] = {
            "_target_": "megatron.bridge.models.gpt_provider.local_layer_spec",
            "_call_": False,
        }
        for k in FUSIONS:
            d["model"][k] = False
        with open(path, "w") as f:
            yaml.safe_dump(d, f, sort_keys=False)
    return out


def make_hf(root, family):
    cfg = transformers.AutoConfig.for_model(
        family,
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # away from the init's zeros and ones (norm weights, biases)
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m.save_pretrained(f"{root}/hf")
    # A word-level tokenizer of the model's vocabulary: Bridge's export saves the source's
    # tokenizer beside the weights, and for Llama transformers has no fallback without one.
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1000)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(f"{root}/hf")


def bridge_import(root):
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = AutoBridge.from_hf_pretrained(f"{root}/hf", torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = local_layer_spec  # no Transformer Engine on a CPU
    for flag in FUSIONS:
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    print("rows", tuple(model[0].embedding.word_embeddings.weight.shape), flush=True)
    bridge.save_megatron_model(model, f"{root}/bridge_ckpt", hf_tokenizer_path=None)


def run_step(root, what, *args):
    from megatron.core import parallel_state

    t0 = time.time()
    if what == "make_hf":
        make_hf(root, *args)
    elif what in ("import", "prepare"):  # prepare: make_hf first (one Bridge start, not two)
        if what == "prepare":
            make_hf(root, *args)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        bridge_import(root)
    elif what == "export":  # export_ckpt makes its own gloo world
        b = AutoBridge.from_hf_pretrained(f"{root}/hf", torch_dtype=torch.float32)
        b.export_ckpt(_cpu_copy(args[0]), args[1])
    else:
        sys.exit(f"bridge_side.py: unknown step {what!r}")
    print(what, root, round(time.time() - t0, 1), "s", flush=True)


def _steps(argv):
    """``W1 STEP ARGS + W2 STEP ARGS ...`` -> [(W1, STEP, ARGS), ...]"""
    steps, current = [], []
    for arg in [*argv, "+"]:
        if arg != "+":
            current.append(arg)
            continue
        if len(current) < 2:
            sys.exit("bridge_side.py: each step is WORK STEP [ARGS] (steps joined by '+')")
        steps.append((current[0], current[1], current[2:]))
        current = []
    return steps


def main():
    steps = _steps(sys.argv[1:])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    # Bridge would call torch.cuda.set_device and NCCL with no world
    if any(what in ("import", "prepare") for _, what, _ in steps):
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)

    from megatron_gndpo.compat import cpu

    cpu.enable()
    # Bridge's save reads the CUDA RNG unconditionally
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    for root, what, args in steps:
        run_step(root, what, *args)


if __name__ == "__main__":
    main()
