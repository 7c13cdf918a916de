"""Checkpoints of the other tools: the architecture read from Megatron-Bridge's run_config.yaml
and Megatron-LM's saved args (checkpoint/foreign_config.py), what a resume pointed at one of
their steps says, and the tokenizer arguments we write for Megatron-LM (checkpoint/interop.py).

The Bridge files are built here in the layout Bridge 0.6.2 writes (``save_megatron_model``:
``ConfigContainer.to_yaml``, every ``GPTModelProvider`` field; a few of its ~400 are kept, with
the values it wrote for a tiny Llama). The same export against a checkpoint the real Bridge wrote
is in tests/test_bridge.py (the Bridge tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_gndpo.checkpoint import foreign_config, interop
from megatron_gndpo.checkpoint.foreign_config import ForeignConfigError
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from tests.harness import run_distributed
from tests.tiny import tiny_model

# A Qwen3-like model: QK-norm, grouped queries, explicit head size, tied, bf16.
QWEN3 = ModelConfig(
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    kv_channels=16, vocab_size=1000, make_vocab_size_divisible_by=8, max_position_embeddings=256,
    rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True, tie_embeddings=True,
    params_dtype="bf16",
)  # fmt: skip
# Its run_config.yaml model section, as Bridge writes one (objects as _target_ / _call_).
BRIDGE_QWEN3: dict[str, Any] = {
    "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
    "activation_func": {"_call_": False, "_target_": "torch.nn.functional.silu"},
    "add_bias_linear": False, "add_qkv_bias": False,
    "attention_backend": {"_args_": [5], "_call_": True, "_name_": "auto",
                          "_target_": "megatron.core.transformer.enums.AttnBackend"},
    "ffn_hidden_size": 96, "gated_linear_unit": True, "hf_model_id": None, "hidden_size": 64,
    "init_method_std": 0.02, "kv_channels": 16, "layernorm_epsilon": 1.0e-06,
    "layernorm_zero_centered_gamma": False, "make_vocab_size_divisible_by": 8,
    "multi_latent_attention": False, "normalization": "RMSNorm", "num_attention_heads": 4,
    "num_layers": 2, "num_moe_experts": None, "num_query_groups": 2,
    "params_dtype": {"_call_": False, "_target_": "torch.bfloat16"},
    "position_embedding_type": "rope", "qk_layernorm": True, "rope_scaling": False,
    "rope_scaling_factor": 1.0, "rotary_base": 1000000.0, "rotary_interleaved": False,
    "rotary_percent": 1.0, "seq_length": 256, "share_embeddings_and_output_weights": True,
    "should_pad_vocab": False, "softmax_type": "vanilla", "tensor_model_parallel_size": 1,
    "transformer_impl": "transformer_engine", "vocab_size": 1000, "window_size": None,
}  # fmt: skip
# Megatron-LM's args of a Llama-3.1-like run (--use-rope-scaling, no --vocab-size: the tokenizer
# gave the padded row count); what Megatron-LM's own training leaves in the common state.
MEGATRON_LM_LLAMA = argparse.Namespace(
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
    group_query_attention=True, num_query_groups=2, kv_channels=16, max_position_embeddings=256,
    seq_length=128, position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
    rotary_interleaved=False, use_rope_scaling=True, rope_scaling_factor=8.0,
    normalization="RMSNorm", norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=True,
    squared_relu=False, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
    untie_embeddings_and_output_weights=True, vocab_size=None, padded_vocab_size=1024,
    make_vocab_size_divisible_by=128, params_dtype=torch.bfloat16, bf16=True, fp16=False,
    num_experts=None, multi_latent_attention=False, init_method_std=0.02,
    tokenizer_type="HuggingFaceTokenizer", tokenizer_model="meta-llama/Llama-3.1-8B",
)  # fmt: skip
LLAMA31 = ModelConfig(
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    kv_channels=16, vocab_size=1024, make_vocab_size_divisible_by=128,
    max_position_embeddings=256, rotary_base=500000.0, rotary_scaling_factor=8.0,
    norm_epsilon=1e-5, params_dtype="bf16",
)  # fmt: skip


def _bridge_step(root: Path, model_section: dict[str, Any]) -> Path:
    """A step directory holding Bridge's run_config.yaml (its other sections abridged)."""
    step = root / "iter_0000000"
    step.mkdir(parents=True)
    run_config = {
        "_target_": "megatron.bridge.training.config.ConfigContainer",
        "checkpoint": {"save_optim": False, "save_rng": False, "ckpt_format": "torch_dist"},
        "model": model_section,
        "tokenizer": None,
    }
    (step / "run_config.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    return step


def test_bridge_run_config_gives_the_model_config(tmp_path: Path) -> None:
    step = _bridge_step(tmp_path, BRIDGE_QWEN3)
    assert foreign_config.read_model_config(step) == QWEN3
    # Llama 3.1's RoPE scaling, a learned-position GELU model with biases
    scaled = {**BRIDGE_QWEN3, "rope_scaling": True, "rope_scaling_factor": 8.0}
    got = foreign_config.from_bridge_run_config({"model": scaled}, "run_config.yaml")
    assert got == dataclasses.replace(QWEN3, rotary_scaling_factor=8.0)
    gelu = {
        **BRIDGE_QWEN3, "gated_linear_unit": False, "add_bias_linear": True,
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
        "activation_func": {"_call_": False, "_target_": "torch.nn.functional.gelu"},
    }  # fmt: skip
    got = foreign_config.from_bridge_run_config({"model": gelu}, "run_config.yaml")
    assert (got.swiglu, got.add_bias_linear, got.position_embedding, got.normalization) == (
        False, True, "learned_absolute", "LayerNorm",
    )  # fmt: skip


def test_megatron_lm_args_give_the_model_config() -> None:
    assert foreign_config.from_megatron_lm_args(MEGATRON_LM_LLAMA, "common.pt") == LLAMA31
    # --vocab-size given: the real vocabulary, not the padded one; no GQA: one group per head
    plain = {**vars(MEGATRON_LM_LLAMA), "vocab_size": 1000, "group_query_attention": False,
             "use_rope_scaling": False}  # fmt: skip
    got = foreign_config.from_megatron_lm_args(plain, "common.pt")
    assert (got.vocab_size, got.num_query_groups, got.rotary_scaling_factor) == (1000, None, None)
    # an older Megatron-LM: no position_embedding_type, its rotary flag instead
    old = {k: v for k, v in plain.items() if k not in ("position_embedding_type", "qk_layernorm")}
    got = foreign_config.from_megatron_lm_args(
        {**old, "use_rotary_position_embeddings": False}, "common.pt"
    )
    assert got.position_embedding == "learned_absolute" and not got.qk_layernorm


@pytest.mark.parametrize(
    "model",
    [
        tiny_model(vocab_size=120, kv_channels=8),
        tiny_model(vocab_size=120, kv_channels=8, add_qkv_bias=True, tie_embeddings=True),
        tiny_model(
            vocab_size=120,
            kv_channels=8,
            qk_layernorm=True,
            rotary_scaling_factor=8.0,
            rotary_base=1e6,
            norm_epsilon=1e-5,
            params_dtype="bf16",
        ),
    ],
)
def test_what_we_write_for_the_other_tools_reads_back(model: ModelConfig) -> None:
    """Our run_config.yaml and args (interop.py) describe the model the reader gets back."""
    run_config = interop.bridge_run_config(model, tp=2, pp=1)
    assert foreign_config.from_bridge_run_config(run_config, "run_config.yaml") == model
    args = interop.megatron_lm_args(model, step=5, tp=2, pp=1, world_size=4)
    assert foreign_config.from_megatron_lm_args(args, "common.pt") == model


def _without(section: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k != key}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (_without(BRIDGE_QWEN3, "num_layers"), r"\(model section\) does not say num_layers"),
        ({**BRIDGE_QWEN3, "hidden_size": "64"}, r"hidden_size is '64', expected int"),
        ({**BRIDGE_QWEN3, "num_layers": True}, r"num_layers is True, expected int"),
        ({**BRIDGE_QWEN3, "num_moe_experts": 8}, r"num_moe_experts=8 is a feature .* "
         r"Megatron-Bridge checkpoint; export it with Megatron-Bridge's own tools"),
        ({**BRIDGE_QWEN3, "position_embedding_type": "yarn"},
         r"position_embedding_type='yarn' is not supported here .* rope or learned_absolute"),
        ({**BRIDGE_QWEN3, "activation_func": {"_target_": "torch.nn.functional.gelu"}},
         r"activation_func torch.nn.functional.gelu with gated_linear_unit=True"),
    ],
)  # fmt: skip
def test_a_bridge_run_config_we_cannot_read_names_the_file_and_the_fix(
    tmp_path: Path, section: dict[str, Any], message: str
) -> None:
    step = _bridge_step(tmp_path, section)
    with pytest.raises(ForeignConfigError, match=message) as err:
        foreign_config.read_model_config(step)
    text = str(err.value)
    assert str(step / "run_config.yaml") in text and "\n" not in text
    unsupported = "num_moe_experts" in section and section["num_moe_experts"]
    assert ("--model-config" in text) != bool(unsupported)  # a flag cannot add experts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_layers": None}, r"common.pt \(Megatron-LM args\) does not say num_layers, which the "
         r"architecture needs; pass --model-config FILE"),
        ({"vocab_size": None, "padded_vocab_size": None}, r"does not say padded_vocab_size"),
        ({"multi_latent_attention": True}, r"multi_latent_attention=True is a feature"),
        ({"squared_relu": True}, r"squared_relu=True is a feature"),
        ({"normalization": "LayerNorm1P"}, r"normalization='LayerNorm1P' is not supported"),
    ],
)  # fmt: skip
def test_megatron_lm_args_we_cannot_read_name_the_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ForeignConfigError, match=message):
        foreign_config.from_megatron_lm_args({**vars(MEGATRON_LM_LLAMA), **change}, "common.pt")


@pytest.mark.megatron
def test_no_description_at_all_says_what_was_looked_for(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.convert import read_model_config
    from megatron_gndpo.errors import MissingFileError

    step = tmp_path / "iter_0000002"
    step.mkdir()
    with pytest.raises(MissingFileError) as err:
        read_model_config(tmp_path, step)
    assert str(err.value) == (
        f"no model_config.yaml in {tmp_path}, and {step} has neither Megatron-Bridge's "
        "run_config.yaml nor Megatron-LM's args in its common state: pass the ModelConfig the "
        "checkpoint was trained with (--model-config FILE: the model section of the run's "
        "config.yaml)"
    )


@pytest.mark.megatron
def test_written_by_tells_the_tools_apart(tmp_path: Path) -> None:
    bridge = tmp_path / "bridge" / "iter_0000001"
    bridge.mkdir(parents=True)
    (bridge / "train_state.pt").write_bytes(interop.bridge_train_state_bytes(1))
    mlm = tmp_path / "mlm" / "iter_0000001"
    mlm.mkdir(parents=True)
    (mlm.parent / "latest_checkpointed_iteration.txt").write_text("1")
    other = tmp_path / "other" / "iter_0000001"
    other.mkdir(parents=True)
    assert [foreign_config.written_by(s) for s in (bridge, mlm, other)] == [
        "Megatron-Bridge", "Megatron-LM", "another tool",
    ]  # fmt: skip


def test_megatron_lm_tokenizer_args(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer_config.json").write_text("{}")
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    assert interop.megatron_lm_tokenizer_args(str(hf)) == {
        "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hf),
    }  # fmt: skip
    assert interop.megatron_lm_tokenizer_args("tok/sp.model") == {
        "tokenizer_type": "GPTSentencePieceTokenizer",
        "tokenizer_model": str(Path.cwd() / "tok" / "sp.model"),
    }
    for spec in (None, "builtin:char", str(weights_only)):
        assert interop.megatron_lm_tokenizer_args(spec) == {}, spec
    args = interop.megatron_lm_args(QWEN3, step=1, tp=1, pp=1, world_size=1, tokenizer=str(hf))
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", str(hf))
    assert not hasattr(interop.megatron_lm_args(QWEN3, step=1, tp=1, pp=1, world_size=1),
                       "tokenizer_type")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# A step of ours as the other tools leave theirs: resumed from (refused, naming the tool and
# checkpoint.init) and exported from Megatron-LM's args alone.

MODEL = tiny_model(vocab_size=120, kv_channels=8, max_position_embeddings=32)


def _as_left_by(root: Path, tool: str) -> Path:
    """A copy of ``root``'s step 3 as ``tool`` leaves one: no megatron_gndpo.json; Megatron-LM's
    also without Bridge's files (its args stay in the common state)."""
    copy = root.with_name(f"{root.name}_{tool}")
    shutil.copytree(root / "iter_0000003", copy / "iter_0000003")
    (copy / "iter_0000003" / "megatron_gndpo.json").unlink()
    shutil.copy(root / "latest_checkpointed_iteration.txt", copy)
    if tool == "bridge":
        shutil.copy(root / "latest_train_state.pt", copy)
    else:
        for name in ("run_config.yaml", "train_state.pt"):
            (copy / "iter_0000003" / name).unlink()
    return copy


def _resume_and_export(rank: int, world: int, root: str, tokenizer: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf
    from megatron_gndpo.checkpoint.dist import CheckpointError, load_checkpoint, save_checkpoint
    from megatron_gndpo.checkpoint.resume import plan_start, resume_from
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.schema import CheckpointConfig, OptimizerConfig

    cpu.enable()
    from megatron_gndpo.engine.optimizer import build_optimizer, wrap_ddp
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world), seed=1)
    ddp = wrap_ddp(build_gpt(MODEL, ParallelConfig(), groups), use_distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-2))
    ours = Path(root)
    # model only (a never-stepped optimizer has no state to save); the refusal comes first
    save_checkpoint(ours, 3, ddp, model_config=MODEL, tokenizer=tokenizer)
    args = dist_checkpointing.load_common_state_dict(str(ours / "iter_0000003"))["args"]
    refusals = {}
    for tool in ("bridge", "mlm"):
        copy = _as_left_by(ours, tool)
        plan = plan_start(CheckpointConfig(load=str(copy)), ours.with_name(f"new_{tool}"))
        try:
            resume_from(plan, lambda d: load_checkpoint(d, ddp, optimizer=optimizer))
        except CheckpointError as err:
            refusals[tool] = str(err)
    # the architecture from Megatron-LM's args alone (no model_config.yaml, no run_config.yaml)
    convert_mcore_to_hf(ours, ours.with_name("reference"), model=MODEL, family="llama")
    convert_mcore_to_hf(ours.with_name(f"{ours.name}_mlm"), ours.with_name("from_args"),
                        family="llama")  # fmt: skip
    return {"refusals": refusals, "tokenizer": (args.tokenizer_type, args.tokenizer_model)}


@pytest.mark.distributed
@pytest.mark.megatron
def test_resuming_another_tools_step_names_it_and_checkpoint_init(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf = tmp_path / "tok"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    root = tmp_path / "ckpt"
    out = run_distributed(_resume_and_export, 1, args=(str(root), str(hf)), timeout_s=300)[0]
    for tool, name in (("bridge", "Megatron-Bridge"), ("mlm", "Megatron-LM")):
        step = tmp_path / f"ckpt_{tool}" / "iter_0000003"
        assert out["refusals"][tool] == (
            f"{step} was written by {name}, not by megatron-gndpo: its optimizer state (if it "
            "saved one) is not in this project's layout, so a run cannot resume from it; to "
            f"start from its weights with a fresh optimizer, set checkpoint.init={step} instead "
            "of checkpoint.load"
        )
    assert out["tokenizer"] == ("HuggingFaceTokenizer", str(hf))
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    from_args = load_file(tmp_path / "from_args" / "model.safetensors")
    assert set(from_args) == set(reference)
    assert all(torch.equal(from_args[k], reference[k]) for k in reference)
    assert reference["model.embed_tokens.weight"].shape[0] == MODEL.vocab_size
