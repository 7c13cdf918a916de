"""Qwen3-MoE <-> megatron conversion: the expert/router mapping, config refusals, and a round trip
through real expert-parallel models.

Tiny random ``Qwen3MoeForCausalLM`` models built in code (4 experts, top-2, hidden 64, no
downloads). The distributed test is one 4-rank launch: one model is converted at TP=2 x EP=2
(every rank fills its own 2 experts' TP shards), the other at PP=2 x EP=2 (a layout built beside
megatron's global state, as a teacher's is), each scored by a fresh megatron model loaded from
the saved checkpoint (log-probs against transformers', fp32), and exported back through a
TP=1/EP=1 model in the same job; transformers loads the export and every tensor is exact.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import hf_mapping, hf_moe
from megatron_gndpo.checkpoint.convert import check_layout
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.errors import UserError
from tests.forward import full_logprobs
from tests.harness import run_distributed

VOCAB = 96
EXPERTS = 4
_SEQ, _BATCH = 12, 2
# Two variants: every layer MoE with renormalised top-k weights (Qwen3-30B-A3B's setting), and
# a dense first layer (mlp_only_layers) with the plain top-k probabilities.
VARIANTS: dict[str, dict[str, Any]] = {
    "all_moe": dict(norm_topk_prob=True, mlp_only_layers=[]),
    "dense_first": dict(norm_topk_prob=False, mlp_only_layers=[0]),
}


def _hf_config(**overrides: Any) -> Any:
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=256,
        rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, dtype="float32",
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.Qwen3MoeConfig(**(kwargs | overrides))


def _tiny_hf_model(seed: int, **overrides: Any) -> Any:
    """A random Qwen3-MoE; every weight perturbed (norms, router) so none is trivial. The router
    moves most, so each token's top-2 is clear of ties that rounding could flip."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(_hf_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if name.endswith("mlp.gate.weight") else 0.05))
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logprobs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().log_softmax(-1)  # [b, s, V]


# ---------------------------------------------------------------------------------------------
# Mapping units (no megatron processes)


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {name: _tiny_hf_model(i, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_to_megatron_to_hf_is_identity(hf_models: dict[str, Any], variant: str) -> None:
    hf_model = hf_models[variant]
    model = hf_mapping.model_config_from_hf(hf_model.config.to_dict())
    # transformers 5 holds the experts fused; the mapping takes (and gives) checkpoint names
    state = hf_moe.split_fused_experts(hf_model.state_dict().items())
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in state
    mcore = hf_mapping.hf_to_megatron(hf_model.state_dict(), model, padded_vocab=128)
    fc1 = mcore["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (64, 64)  # [gate; up] of expert 3
    assert torch.equal(fc1[32:], state["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(mcore["decoder.layers.1.mlp.router.weight"],
                       state["model.layers.1.mlp.gate.weight"])  # fmt: skip
    dense = variant == "dense_first"
    assert ("decoder.layers.0.mlp.linear_fc1.weight" in mcore) == dense
    assert ("decoder.layers.0.mlp.router.weight" in mcore) == (not dense)
    back = hf_mapping.megatron_to_hf(mcore, model, family="qwen3_moe")
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_saved_checkpoint_names_are_the_mapping(hf_models: dict[str, Any], tmp_path: Path) -> None:
    """save_pretrained writes per-expert names (transformers' conversion on save): exactly the
    names the mapping expects, so HFCheckpoint reads a real export."""
    from safetensors import safe_open

    hf_models["dense_first"].save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    model = hf_mapping.model_config_from_hf(config)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == hf_mapping.expected_hf_names(model)
    hf_mapping.check_hf_names(names, model)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_config_round_trip(hf_models: dict[str, Any], variant: str) -> None:
    import transformers

    model = hf_mapping.model_config_from_hf(hf_models[variant].config.to_dict())
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (4, 2, 32)
    assert model.qk_layernorm and not model.add_qkv_bias and model.hf_family == "qwen3_moe"
    assert model.moe_router_pre_softmax and model.moe_aux_loss_coeff == 0.001
    norm = VARIANTS[variant]["norm_topk_prob"]
    assert model.moe_norm_topk_prob == norm
    assert model.moe_softmax_before_topk == (not norm)  # megatron's order for the same weights
    assert model.moe_layer_pattern == ((0, 1) if variant == "dense_first" else ())
    ours = hf_mapping.hf_config_from_model(model, "qwen3_moe")
    assert ours["mlp_only_layers"] == VARIANTS[variant]["mlp_only_layers"]
    assert hf_mapping.model_config_from_hf(ours) == model
    rebuilt = transformers.AutoConfig.for_model(**ours)
    assert type(rebuilt) is transformers.Qwen3MoeConfig
    assert hf_mapping.model_config_from_hf(rebuilt.to_dict()) == model


def test_expert_names_follow_the_expert_parallel_rank() -> None:
    from megatron_gndpo.parallel.groups import ParallelLayout

    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert hf_moe.global_expert_name(name, 2) == name.replace("experts.1.", "experts.3.")
    # Transformer Engine's grouped experts (the GPU spec) name local expert j weight{j}
    te = "decoder.layers.1.mlp.experts.linear_fc1.weight1"
    assert hf_moe.global_expert_name(te, 2) == name.replace("experts.1.linear_fc2",
                                                            "experts.3.linear_fc1")  # fmt: skip
    router = "decoder.layers.1.mlp.router.weight"
    assert hf_moe.global_expert_name(router, 2) == router
    assert hf_moe.expert_index(name) == 1 and hf_moe.expert_index("output_layer.weight") is None
    model = ModelConfig(num_experts=8)
    # tp-cp-ep-dp-pp: with TP=2, EP=2 over 8 ranks, ranks 2 and 3 are EP rank 1 (experts 4..7)
    layout = ParallelLayout(8, tp=2, ep=2)
    assert [hf_mapping.expert_offset(model, layout, r) for r in range(8)] == [0, 0, 4, 4] * 2
    assert hf_mapping.expert_offset(ModelConfig(), layout, 3) == 0  # dense


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shared_expert_intermediate_size": 64}, "unsupported shared expert"),
        ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok=1 with norm"),
        ({"decoder_sparse_step": 3}, "makes no layer an MoE layer.*dense model it is"),
        ({"mlp_only_layers": [0, 1]}, r"no layer an MoE layer .*mlp_only_layers=\[0, 1\]"),
        ({"mlp_only_layers": [5]}, r"mlp_only_layers names layers \[5\]"),
        ({"num_experts": None}, "no num_experts"),
        ({"moe_intermediate_size": None}, "no 'moe_intermediate_size'"),
        ({"attention_bias": True}, "attention_bias=true for qwen3_moe"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
    ],
)  # fmt: skip
def test_unsupported_qwen3_moe_configs_are_named(change: dict[str, Any], message: str) -> None:
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": VOCAB,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip
    with pytest.raises(ValueError, match=message) as err:
        hf_mapping.model_config_from_hf(config | change)
    assert isinstance(err.value, UserError)  # the CLI prints it without a traceback


def test_models_that_are_not_qwen3_moe_are_refused() -> None:
    moe = hf_mapping.model_config_from_hf(_hf_config().to_dict())
    with pytest.raises(ValueError, match="num_experts is not set"):
        hf_mapping.hf_config_from_model(dataclasses.replace(moe, num_experts=None), "qwen3_moe")
    with pytest.raises(ValueError, match=r"num_experts=4 .*use family qwen3_moe"):
        hf_mapping.hf_config_from_model(moe, "qwen3")
    shared = dataclasses.replace(moe, moe_shared_expert_ffn_hidden_size=32,
                                 moe_router_score_function="sigmoid")  # fmt: skip
    with pytest.raises(ValueError, match=r"no shared expert.*router is a softmax"):
        hf_mapping.hf_config_from_model(shared, "qwen3_moe")
    with pytest.raises(ValueError, match=r"qwen2.*mixture-of-experts.*supports qwen3_moe"):
        hf_mapping.model_config_from_hf(
            {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": VOCAB,
             "num_experts": 4}
        )  # fmt: skip


def test_a_vllm_engine_needs_a_qwen3_moe_student() -> None:
    """rollout.engine=vllm syncs the student as Qwen3-MoE: what that cannot hold is a config
    error before anything is built, not a failure at the first sync."""
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import ConfigError, load_config

    example = Path(__file__).parents[1] / "examples" / "tiny_cpu_moe.yaml"
    vllm = ["rollout.engine=vllm", "model.qk_layernorm=true"]
    validate(load_config(example, vllm), 2)
    with pytest.raises(ConfigError, match=r"as qwen3_moe, and .*no shared expert.*builtin"):
        validate(load_config(example, [*vllm, "model.moe_shared_expert_ffn_hidden_size=32"]), 2)
    with pytest.raises(ConfigError, match=r"qk_layernorm=false \(Qwen3-MoE has QK-norm\)"):
        validate(load_config(example, ["rollout.engine=vllm"]), 2)


def test_layouts_that_cannot_hold_the_experts_are_refused() -> None:
    moe = hf_mapping.model_config_from_hf(_hf_config().to_dict())
    check_layout(moe, ParallelConfig(tensor_parallel=2, expert_parallel=4))
    with pytest.raises(ValueError, match="EP=3 does not divide the 4 experts"):
        check_layout(moe, ParallelConfig(expert_parallel=3))
    with pytest.raises(ValueError, match="EP=2 needs a mixture-of-experts model"):
        check_layout(ModelConfig(), ParallelConfig(expert_parallel=2))
    odd = dataclasses.replace(moe, moe_ffn_hidden_size=33)
    with pytest.raises(ValueError, match="TP=2 does not divide the expert FFN width 33"):
        check_layout(odd, ParallelConfig(tensor_parallel=2))


def test_convert_cli_refuses_a_bad_ep(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_gndpo.checkpoint.convert_cli import hf_to_mcore_main

    with pytest.raises(SystemExit):
        hf_to_mcore_main(["--hf-dir", "x", "--out", "y", "--ep", "0"])
    assert "--ep must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Real models: TP=2 x EP=2 import, TP=1/EP=1 export, in one 4-rank launch


# Where each variant is converted: (TP, PP, EP).
LAYOUTS = {"all_moe": (2, 1, 2), "dense_first": (1, 2, 2)}


def _import_and_export(rank: int, world: int, root: str, tokens: torch.Tensor) -> Any:
    from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups

    student = build_student_groups(ParallelLayout(world, tp=2, ep=2), seed=1234)
    pp2ep2 = build_groups(ParallelLayout(world, pp=2, ep=2), name="pp2ep2")
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        tp, pp, ep = LAYOUTS[variant]
        groups = student if pp == 1 else pp2ep2
        parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
        ckpt = Path(root) / f"mcore_{variant}"
        model = convert_hf_to_mcore(Path(root) / f"hf_{variant}", ckpt, groups=groups,
                                    parallel=parallel)  # fmt: skip
        # Score with a fresh model loaded from disk: the saved checkpoint is what is tested.
        net = build_gpt(model, parallel, groups)
        net.eval()
        load_checkpoint(ckpt, net)
        experts = {n for n, _ in net.named_parameters() if ".local_experts." in n}
        logprobs = full_logprobs(net, groups, tokens, hidden=model.hidden_size, vocab=VOCAB)
        out[variant] = {"logprobs": logprobs, "experts": len(experts)}
    # Export in the same job: every rank loads a TP=1/EP=1 model (all experts) from the
    # TP/PP/EP checkpoint; rank 0 writes. Config and family come from beside the checkpoint.
    for variant in VARIANTS:
        convert_mcore_to_hf(Path(root) / f"mcore_{variant}", Path(root) / f"export_{variant}",
                            dtype="fp32")  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_qwen3_moe_tp2_ep2_pp2_ep2_and_back(tmp_path: Path) -> None:
    import transformers

    tokens = _tokens()
    originals, expected = {}, {}
    for i, (variant, overrides) in enumerate(VARIANTS.items()):
        hf_model = _tiny_hf_model(10 + i, **overrides)
        hf_model.save_pretrained(tmp_path / f"hf_{variant}")
        originals[variant] = hf_model
        expected[variant] = _hf_logprobs(hf_model, tokens)

    results = run_distributed(_import_and_export, 4, args=(str(tmp_path), tokens), timeout_s=300)
    for variant in VARIANTS:
        tp, pp, ep = LAYOUTS[variant]
        # MoE layers on this rank's stage: all_moe 2 (PP=1); dense_first 0 or 1 (layer 1, PP=2)
        for rank, by_variant in enumerate(results):
            r = by_variant[variant]
            moe_layers = 2 if pp == 1 else rank // 2
            assert r["experts"] == moe_layers * 2 * 2, (variant, rank)  # 2 of 4, fc1 + fc2
            if r["logprobs"] is None:  # a first pipeline stage
                continue
            diff = (r["logprobs"] - expected[variant]).abs().max().item()
            print(f"measured {variant} rank {rank} (TP={tp} PP={pp} EP={ep}): log-prob diff "
                  f"vs transformers {diff:.2e}")  # fmt: skip
            assert diff < 1e-4, f"{variant}: log-probs differ from HF by {diff}"
        assert sum(r[variant]["logprobs"] is not None for r in results) == 4 // pp
        out = tmp_path / f"export_{variant}"
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and config["num_experts"] == EXPERTS
        assert config["eos_token_id"] == 2 and config["torch_dtype"] == "float32"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(loaded) is transformers.Qwen3MoeForCausalLM
        original, exported = originals[variant].state_dict(), loaded.state_dict()
        assert set(exported) == set(original), variant
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), f"{variant}: {name} changed"
        diff = (_hf_logprobs(loaded, tokens) - expected[variant]).abs().max().item()
        assert diff == 0.0, f"{variant}: exported model's log-probs differ by {diff}"
