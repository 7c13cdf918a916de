"""Hugging Face <-> megatron conversion: mapping units, and round trips through real models.

Three tiny families built in code (no downloads), each exercising its own layout features:

- qwen2: QKV bias, GQA, tied embeddings (the last pipeline stage holds a copy as output_layer);
- qwen3: QK-norm, head_dim (24) != hidden / heads (16), tied embeddings;
- llama: llama3 RoPE scaling, untied lm_head.

The vocabulary (96) is padded to 256 at TP=2 and to 128 at TP=1, so padding, trimming and the
re-padding on a TP=2 -> TP=1 load are all exercised. The distributed test converts all three at
TP=2 x PP=2 in one 4-rank launch, checks the megatron log-probs against transformers', and in the
same launch exports them back through a TP=1/PP=1 model; transformers loads the result.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import hf_mapping
from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_gndpo.checkpoint.dist import CheckpointError
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from tests.forward import full_logprobs
from tests.harness import run_distributed

VOCAB = 96
FAMILIES = ("qwen2", "qwen3", "llama")
_SEQ, _BATCH = 12, 2


def _hf_config_kwargs(family: str) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    if family == "qwen2":
        return common | dict(rope_theta=1e6, tie_word_embeddings=True)
    if family == "qwen3":
        return common | dict(rope_theta=1e6, head_dim=24, tie_word_embeddings=True)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    # max positions above the llama3 original length, as in real Llama 3.1 configs
    return common | dict(
        rope_theta=5e5, rope_scaling=rope, max_position_embeddings=16384, tie_word_embeddings=False
    )


def _tiny_hf_model(family: str, seed: int) -> Any:
    """A random transformers model; every weight perturbed so biases and norms are not trivial."""
    import transformers

    config = transformers.AutoConfig.for_model(family, **_hf_config_kwargs(family))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
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
    return {family: _tiny_hf_model(family, seed=i) for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_to_hf_is_identity(hf_models: dict[str, Any], family: str) -> None:
    hf_model = hf_models[family]
    model = hf_mapping.model_config_from_hf(hf_model.config.to_dict())
    hf_state = hf_model.state_dict()
    mcore = hf_mapping.hf_to_megatron(hf_state, model, padded_vocab=128)
    assert mcore["embedding.word_embeddings.weight"].shape == (128, 64)
    assert mcore["embedding.word_embeddings.weight"][VOCAB:].abs().sum() == 0  # zero padding
    assert ("output_layer.weight" in mcore) == (not model.tie_embeddings)
    back = hf_mapping.megatron_to_hf(mcore, model, family=family)
    expected = {k: v for k, v in hf_state.items() if not (model.tie_embeddings and "lm_head" in k)}
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    # _extra_state entries (megatron's FP8 metadata) are skipped on export
    with_extra = mcore | {"decoder.layers.0.mlp.linear_fc1._extra_state": None}
    assert set(hf_mapping.megatron_to_hf(with_extra, model, family=family)) == set(expected)


def test_qkv_layout_is_grouped_per_kv_head() -> None:
    model = ModelConfig(hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=1)
    # one row per head, valued by its name: q0..q3 -> 0..3, k0, k1 -> 10, 11, v0, v1 -> 20, 21
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k, v = torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    mapping = hf_mapping.mapping_for("decoder.layers.0.self_attention.linear_qkv.weight", model)
    qkv = mapping.to_megatron([q, k, v], model, padded_vocab=0)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.flatten().tolist() for t in mapping.to_hf(qkv, model)] == [
        [0, 1, 2, 3], [10, 11], [20, 21]
    ]  # fmt: skip


def test_te_fused_norm_names_are_aliases() -> None:
    model = ModelConfig()
    te = hf_mapping.mapping_for("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", model)
    assert te.hf == ("model.layers.1.post_attention_layernorm.weight",)
    assert te.megatron == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"


def test_shard_for_rank_slices_fc1_halves_and_checks_shapes() -> None:
    gate, up = torch.arange(4.0).reshape(4, 1), torch.arange(10.0, 14.0).reshape(4, 1)
    full = torch.cat([gate, up])
    param = types.SimpleNamespace(tensor_model_parallel=True, partition_dim=0, shape=(4, 1))
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shard = hf_mapping.shard_for_rank(name, full, param, tp=2, tp_rank=1, swiglu=True)
    assert shard.flatten().tolist() == [2, 3, 12, 13]
    row = types.SimpleNamespace(tensor_model_parallel=True, partition_dim=1, shape=(2, 3))
    proj = torch.arange(12.0).reshape(2, 6)
    shard = hf_mapping.shard_for_rank("x.linear_proj.weight", proj, row, tp=2, tp_rank=1,
                                      swiglu=True)  # fmt: skip
    assert torch.equal(shard, proj[:, 3:])
    wrong = types.SimpleNamespace(tensor_model_parallel=False, shape=(5,))
    with pytest.raises(ValueError, match=r"x\.norm.*\(4,\).*\(5,\)"):
        hf_mapping.shard_for_rank("x.norm", torch.ones(4), wrong, tp=2, tp_rank=0, swiglu=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_config_round_trip(hf_models: dict[str, Any], family: str) -> None:
    import transformers

    # transformers 5 writes rope_parameters / dtype; ours writes rope_theta / rope_scaling /
    # torch_dtype: both must read back to the same ModelConfig.
    model = hf_mapping.model_config_from_hf(hf_models[family].config.to_dict())
    assert model.params_dtype == "fp32" and model.num_query_groups == 2
    assert model.add_qkv_bias == (family == "qwen2")
    assert model.qk_layernorm == (family == "qwen3")
    assert model.kv_channels == (24 if family == "qwen3" else None)
    assert model.rotary_scaling_factor == (8.0 if family == "llama" else None)
    assert model.tie_embeddings == (family != "llama")
    ours = hf_mapping.hf_config_from_model(model, family)
    assert hf_mapping.model_config_from_hf(ours) == model
    rebuilt = transformers.AutoConfig.for_model(**ours)
    assert type(rebuilt) is type(hf_models[family].config)
    assert hf_mapping.model_config_from_hf(rebuilt.to_dict()) == model


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "unsupported Hugging Face model_type 'mistral'"),
        ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe'"),
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
         r"sliding-window attention in layers \[1\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_size": None}, "no 'hidden_size'"),
    ],
)  # fmt: skip
def test_unsupported_hf_configs_are_named(change: dict[str, Any], message: str) -> None:
    config = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": VOCAB}  # fmt: skip
    config |= change
    with pytest.raises(ValueError, match=message):
        hf_mapping.model_config_from_hf(config)


def test_family_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"qwen3.*qk_layernorm=False"):
        hf_mapping.hf_config_from_model(ModelConfig(), "qwen3")
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        hf_mapping.hf_config_from_model(ModelConfig(), "gpt2")


def test_missing_and_unexpected_tensors_are_named(hf_models: dict[str, Any]) -> None:
    hf_model = hf_models["qwen2"]
    model = hf_mapping.model_config_from_hf(hf_model.config.to_dict())
    state = dict(hf_model.state_dict())
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias' is missing"):
        hf_mapping.hf_to_megatron(state, model, padded_vocab=128)
    extra = dict(hf_model.state_dict()) | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match=r"o_proj\.bias.*no place"):
        hf_mapping.hf_to_megatron(extra, model, padded_vocab=128)


def test_conversion_errors_name_the_problem(tmp_path: Path, hf_models: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    parallel = ParallelConfig()
    no_groups: Any = None  # the errors come before any megatron model is built
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        convert_hf_to_mcore(tmp_path, tmp_path / "out", groups=no_groups, parallel=parallel)
    hf_dir = tmp_path / "hf"
    hf_models["llama"].save_pretrained(hf_dir)
    path = hf_dir / "model.safetensors"
    state = load_file(str(path))
    del state["lm_head.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is missing"):
        convert_hf_to_mcore(hf_dir, tmp_path / "out", groups=no_groups, parallel=parallel)
    with pytest.raises(ValueError, match="TP=3 must divide"):
        tp3 = ParallelConfig(tensor_parallel=3)
        convert_hf_to_mcore(hf_dir, tmp_path / "out", groups=no_groups, parallel=tp3)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        convert_mcore_to_hf(tmp_path / "nothing", tmp_path / "exported", family="llama")


# ---------------------------------------------------------------------------------------------
# Real models: TP=2 x PP=2 import, world-1 export


def _import_tp2_pp2(rank: int, world_size: int, root: str, tokens: torch.Tensor) -> Any:
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world_size, tp=2, pp=2), seed=1234)
    parallel = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)
    out: dict[str, Any] = {}
    for family in FAMILIES:
        ckpt = Path(root) / f"mcore_{family}"
        model = convert_hf_to_mcore(Path(root) / f"hf_{family}", ckpt, groups=groups,
                                    parallel=parallel)  # fmt: skip
        # Score with a fresh model loaded from disk: the saved checkpoint is what is tested.
        net = build_gpt(model, parallel, groups)
        net.eval()
        load_checkpoint(ckpt, net)
        logprobs = full_logprobs(net, groups, tokens, hidden=model.hidden_size, vocab=VOCAB)
        if logprobs is not None and groups.coords["tp"] == 0:
            out[family] = logprobs
    # Export in the same job (saves a launch): while megatron's global state is still TP2xPP2,
    # every rank loads a TP=1/PP=1 model (another layout, another DP size) from the TP=2/PP=2
    # checkpoint (a collective) and rank 0 writes. The model config and family come from the
    # files conversion wrote beside the checkpoint.
    for family in FAMILIES:
        convert_mcore_to_hf(Path(root) / f"mcore_{family}", Path(root) / f"export_{family}",
                            dtype="fp32")  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_hf_to_mcore_tp2_pp2_and_back(tmp_path: Path) -> None:
    import transformers

    tokens = _tokens()
    originals, expected = {}, {}
    for i, family in enumerate(FAMILIES):
        hf_model = _tiny_hf_model(family, seed=10 + i)
        hf_model.save_pretrained(tmp_path / f"hf_{family}")
        (tmp_path / f"hf_{family}" / "tokenizer_config.json").write_text('{"model_max_length": 8}')
        originals[family] = hf_model
        expected[family] = _hf_logprobs(hf_model, tokens)

    results = run_distributed(_import_tp2_pp2, 4, args=(str(tmp_path), tokens), timeout_s=300)
    by_family = results[2]  # rank 2: TP rank 0 of the last pipeline stage
    for family in FAMILIES:
        diff = (by_family[family] - expected[family]).abs().max().item()
        assert diff < 1e-4, f"{family}: megatron TP2xPP2 log-probs differ from HF by {diff}"
        ckpt = tmp_path / f"mcore_{family}"
        assert (ckpt / "tokenizer_config.json").is_file()
        assert (ckpt / "generation_config.json").is_file()
        assert json.loads((ckpt / "hf_config.json").read_text())["model_type"] == family

    for family in FAMILIES:
        out = tmp_path / f"export_{family}"
        config = json.loads((out / "config.json").read_text())
        assert config["eos_token_id"] == 2 and config["torch_dtype"] == "float32"
        assert (out / "tokenizer_config.json").is_file()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        original = originals[family].state_dict()
        exported = loaded.state_dict()
        assert set(exported) == set(original), family
        for name, tensor in original.items():
            assert exported[name].dtype == torch.float32
            assert torch.equal(exported[name], tensor), f"{family}: {name} changed"
        diff = (_hf_logprobs(loaded, tokens) - expected[family]).abs().max().item()
        assert diff < 1e-5, f"{family}: exported model's log-probs differ by {diff}"


def test_export_writes_sharded_safetensors_with_an_index(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.convert import _write_safetensors

    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    files = _write_safetensors(iter(tensors), tmp_path, max_shard_bytes=2048)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == files[2]
    from megatron_gndpo.checkpoint.convert import HFCheckpoint

    with HFCheckpoint(tmp_path) as ckpt:
        assert ckpt.names == {f"t{i}" for i in range(5)}
        assert torch.equal(ckpt.get("t3"), tensors[3][1])
        with pytest.raises(ValueError, match="'t9' is missing"):
            ckpt.get("t9")


def test_dataclass_fields_survive_yaml(tmp_path: Path) -> None:
    # model_config.yaml is how an export finds the architecture: every field must round trip.
    from megatron_gndpo.checkpoint.convert import MODEL_CONFIG_FILE, read_model_config
    from megatron_gndpo.config.loader import to_yaml

    model = dataclasses.replace(ModelConfig(), kv_channels=24, rotary_scaling_factor=8.0)
    (tmp_path / MODEL_CONFIG_FILE).write_text(to_yaml(model))
    assert read_model_config(tmp_path) == model


def _save_fp32_and_export(rank: int, world_size: int, root: str) -> None:
    from megatron_gndpo.checkpoint import convert_cli
    from megatron_gndpo.checkpoint.convert import describe_checkpoints
    from megatron_gndpo.checkpoint.dist import save_checkpoint
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from tests.tiny import tiny_model

    model = tiny_model(vocab_size=VOCAB)  # fp32
    groups = build_student_groups(ParallelLayout(world_size), seed=7)
    save_checkpoint(Path(root) / "ckpt", 3, build_gpt(model, ParallelConfig(), groups))
    describe_checkpoints(Path(root) / "ckpt", model)
    # A model config claiming bf16 does not make the export bf16: the saved tensors are fp32.
    claims_bf16 = dataclasses.replace(model, params_dtype="bf16")
    convert_mcore_to_hf(Path(root) / "ckpt", Path(root) / "api", model=claims_bf16, family="llama")
    convert_mcore_to_hf(Path(root) / "ckpt", Path(root) / "bf16", family="llama", dtype="bf16")
    # Last: the CLI ends the job's process groups.
    convert_cli.mcore_to_hf_main(
        ["--mcore-dir", str(Path(root) / "ckpt"), "--out", str(Path(root) / "cli"),
         "--family", "llama"]
    )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.megatron
def test_export_defaults_to_the_saved_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run_distributed(_save_fp32_and_export, 1, args=(str(tmp_path),), timeout_s=300)
    for name, expected in (
        ("cli", torch.float32),
        ("api", torch.float32),
        ("bf16", torch.bfloat16),
    ):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["torch_dtype"] == str(expected).removeprefix("torch."), name
        dtypes = {t.dtype for t in load_file(str(tmp_path / name / "model.safetensors")).values()}
        assert dtypes == {expected}, name
