"""Hugging Face InternVL <-> megatron VLM conversion, against transformers' own InternVL.

The reference is transformers' native ``InternVLForConditionalGeneration`` (InternViT with layer
scale and q/k/v bias, pixel shuffle, the mlp1 projector, a Qwen2 language model with tied
embeddings), built tiny from a config with every weight perturbed (no downloads, fp32).

- Mapping units (one process): the state dict maps to megatron names and back exactly, in both
  of transformers' name forms; configs round trip; what cannot be represented is named.
- One 2-rank launch: convert at TP=2, load the checkpoint fresh at TP=2 and at TP=1 (a reshard),
  score rows with images with ``score_multimodal`` and compare every text token's log-prob with
  transformers' (a response right after an image, two images in a row, a text-only row); then
  export back through a TP=1 model with ``convert mcore-to-hf`` (the CLI). transformers loads
  the export: every tensor is bitwise the original and the safetensors hold the names
  ``save_pretrained`` wrote.
- One 4-rank launch, the pipeline layouts: convert at PP=2 (DP=2) and at TP=2 x PP=2 (the
  encoder on the first stage, the language layers split over both), score fresh loads of each
  and of the TP=2 x PP=2 checkpoint resharded to PP=2 on the last stage, and export the
  TP=2 x PP=2 checkpoint back; the same checks as above.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import vlm_mapping
from megatron_gndpo.config.vision import VisionConfig
from tests.harness import run_distributed
from tests.internvl import IMAGE, TOKENS_PER_TILE, VOCAB, hf_config

_TOLERANCE = 1e-4  # issue 7: the round trip matches transformers' log-probs to 1e-4 (fp32)


def _tiny_internvl(seed: int) -> Any:
    """A random transformers InternVL; every weight perturbed (the class token, position
    embeddings and layer scales start constant)."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration._from_config(hf_config(), attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return _tiny_internvl(seed=0)


# ---------------------------------------------------------------------------------------------
# Mapping units


def test_state_dict_round_trips_exactly(hf_model: Any) -> None:
    model, vision = vlm_mapping.vlm_configs_from_hf(hf_model.config.to_dict())
    assert vision.tokens_per_tile == TOKENS_PER_TILE and vision.projector == "norm_mlp"
    in_memory = hf_model.state_dict()  # model.vision_tower.*, model.language_model.*, lm_head
    mcore = vlm_mapping.hf_to_megatron(in_memory, model, vision, padded_vocab=128)
    qkv = mcore["vision_model.decoder.layers.0.self_attention.linear_qkv.weight"]
    q = in_memory["model.vision_tower.encoder.layer.0.attention.q_proj.weight"]
    k = in_memory["model.vision_tower.encoder.layer.0.attention.k_proj.weight"]
    assert torch.equal(qkv[:16], q[:16]) and torch.equal(qkv[16:32], k[:16])  # head 0: q, k, v
    assert mcore["vision_model.position_embeddings.weight"].shape == (17, 32)
    assert "language_model.output_layer.weight" not in mcore  # tied

    back = vlm_mapping.megatron_to_hf(mcore, model, vision)
    saved = {vlm_mapping.canonical_hf_name(k): v for k, v in in_memory.items()}
    del saved["language_model.lm_head.weight"]  # tied: save_pretrained drops it too
    assert set(back) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name
    # the saved name form maps the same way
    assert set(vlm_mapping.hf_to_megatron(back, model, vision, padded_vocab=128)) == set(mcore)


def test_configs_round_trip(hf_model: Any) -> None:
    from transformers import InternVLConfig

    model, vision = vlm_mapping.vlm_configs_from_hf(hf_model.config.to_dict())
    exported = vlm_mapping.hf_config_from_vlm(model, vision, "qwen2")
    assert vlm_mapping.vlm_configs_from_hf(exported) == (model, vision)
    rebuilt = InternVLConfig(**exported)
    assert (
        rebuilt.vision_config.attention_bias and rebuilt.text_config.tie_word_embeddings is not None
    )
    assert rebuilt.image_seq_length == TOKENS_PER_TILE and rebuilt.tie_word_embeddings
    # a VLM that is not InternVL-shaped cannot be written as one
    clip = VisionConfig(image_token_id=IMAGE)
    with pytest.raises(ValueError, match=r"encoder=clip.*projector=mlp"):
        vlm_mapping.hf_config_from_vlm(model, clip, "qwen2")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vision_feature_layer": -2}, r"vision_feature_layer=-2 \(supported: -1"),
        ({"downsample_ratio": 0.25}, "downsample_ratio=0.25"),
        ({"vision_config": {"use_qk_norm": True}}, "use_qk_norm=True"),
        ({"vision_config": {"attention_bias": False}}, "InternViT-6B is not supported"),
        ({"vision_config": {"use_mean_pooling": False}}, "final LayerNorm"),
        ({"model_type": "internvl_chat"}, "original remote-code InternVL format"),
        ({"image_seq_length": 16}, "image_seq_length=16"),
    ],
)
def test_unsupported_configs_are_named(hf_model: Any, change: dict[str, Any], message: str) -> None:
    config = hf_model.config.to_dict()
    for key, value in change.items():
        config[key] = config[key] | value if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=message):
        vlm_mapping.vlm_configs_from_hf(config)


def test_missing_and_unexpected_tensors_are_named(hf_model: Any) -> None:
    model, vision = vlm_mapping.vlm_configs_from_hf(hf_model.config.to_dict())
    state = dict(hf_model.state_dict())
    lambdas = state.pop("model.vision_tower.encoder.layer.1.lambda_2")
    with pytest.raises(ValueError, match=r"layer\.1\.lambda_2' is missing"):
        vlm_mapping.check_hf_names(state, model, vision)
    state["model.vision_tower.encoder.layer.1.lambda_2"] = lambdas
    state["model.vision_tower.layernorm.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match=r"vision_tower\.layernorm\.weight.*no place"):
        vlm_mapping.check_hf_names(state, model, vision)


def test_cli_tells_a_vlm_by_its_files(tmp_path: Path, hf_model: Any) -> None:
    from megatron_gndpo.checkpoint.vlm_convert import is_hf_vlm, is_vlm_checkpoint, read_vlm_configs

    hf_model.config.save_pretrained(tmp_path / "hf")
    assert is_hf_vlm(tmp_path / "hf") and not is_hf_vlm(tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(config | {"model_type": "internvl_chat"})
    )
    assert is_hf_vlm(tmp_path / "hf")  # takes the VLM path, which names the format
    with pytest.raises(ValueError, match="convert_internvl_weights_to_hf"):
        read_vlm_configs(tmp_path / "hf")
    step = tmp_path / "ckpt" / "iter_0000000"
    step.mkdir(parents=True)
    assert not is_vlm_checkpoint(step)
    (tmp_path / "ckpt" / "vision_config.yaml").write_text("encoder: internvit\n")
    assert is_vlm_checkpoint(step) and is_vlm_checkpoint(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------
# Real models: TP=2 import, TP=2 and TP=1 scoring, world-1 export


def _rows() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Rows [text, image, text]; a response right after an image; two images (one at position
    0); text only. Padded to one length."""
    g = torch.Generator().manual_seed(5)

    def text(n: int) -> list[int]:
        return [int(t) for t in torch.randint(6, VOCAB, (n,), generator=g)]

    img = [IMAGE] * TOKENS_PER_TILE
    rows = [text(3) + img + text(5), text(2) + img + text(4),
            img + text(2) + img + text(3), text(6)]  # fmt: skip
    n_images = [1, 1, 2, 0]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    images = [torch.randn(n, 3, 28, 28, generator=g) if n else None for n in n_images]
    return tokens, lengths, images


def _hf_token_logprobs(model: Any, tokens: torch.Tensor, lengths: torch.Tensor,
                       images: list[torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
    """``out[b, t] = log p(tokens[b, t] | prefix, images)`` by transformers, each row alone;
    0 at t = 0, image positions and padding (``score_multimodal``'s contract)."""
    out = torch.zeros(tokens.shape)
    with torch.no_grad():
        for b, n in enumerate(lengths.tolist()):
            ids = tokens[b : b + 1, :n]
            logits = model(input_ids=ids, pixel_values=images[b]).logits[0]  # [n, V]
            picked = logits.float().log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            out[b, 1:n] = picked
    out[tokens == IMAGE] = 0.0
    return out


def _score(net: Any, groups: Any, rows: Any) -> torch.Tensor | None:
    from megatron_gndpo.engine.scoring import score_multimodal
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    tokens, lengths, images = rows
    head = TokenLogProbs(vocab_size=VOCAB)
    return score_multimodal(net, groups, tokens, lengths, images, head=head, token_budget=64)


def _convert_score_export(rank: int, world_size: int, root: str, rows: Any) -> dict[str, Any]:
    from megatron_gndpo.checkpoint import convert_cli
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.checkpoint.vlm_convert import convert_vlm_hf_to_mcore
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups

    ckpt = Path(root) / "mcore"
    tp2 = ParallelConfig(tensor_parallel=2)
    groups = build_student_groups(ParallelLayout(world_size, tp=2), seed=1234)
    model, vision = convert_vlm_hf_to_mcore(Path(root) / "hf", ckpt, groups=groups, parallel=tp2)
    out: dict[str, Any] = {}
    # Score with fresh models loaded from disk: the saved checkpoint is what is tested.
    for name, parallel, layout_groups in (
        ("tp2", tp2, groups),
        ("tp1", ParallelConfig(), build_groups(ParallelLayout(world_size), name="tp1")),
    ):
        net = build_vlm(model, vision, parallel, layout_groups)
        load_checkpoint(ckpt, net)
        out[name] = _score(net, layout_groups, rows)
    # Export in the same job (saves a launch) through the CLI, which finds vision_config.yaml
    # beside the checkpoint: every rank loads a TP=1 VLM, rank 0 writes. It ends the job's
    # process groups, so it comes last. No --dtype: the export keeps the saved fp32.
    export = Path(root) / "export"
    convert_cli.mcore_to_hf_main(["--mcore-dir", str(ckpt), "--out", str(export)])
    return out


def _save_hf(root: Path, hf_model: Any) -> Path:
    """``hf_model`` saved as an InternVL directory with an image processor config."""
    hf_dir = root / "hf"
    hf_model.save_pretrained(hf_dir)
    (hf_dir / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]})
    )
    return hf_dir


def _check_logprobs(got: dict[str, torch.Tensor], expected: torch.Tensor) -> None:
    """Every layout's log-probs (by name) within the tolerance of transformers'."""
    for name, logprobs in got.items():
        diff = (logprobs - expected).abs().max().item()
        assert diff < _TOLERANCE, f"{name}: megatron log-probs differ from transformers by {diff}"
    assert (expected[1, 2 + TOKENS_PER_TILE] != 0) and (expected[3, 1:6] != 0).all()


def _check_export(root: Path, hf_model: Any, rows: Any, expected: torch.Tensor) -> None:
    """``root/export`` (written by ``convert mcore-to-hf``) is ``root/hf`` bitwise, hub names."""
    from safetensors import safe_open
    from transformers import InternVLForConditionalGeneration

    export = root / "export"
    assert (export / "preprocessor_config.json").is_file()
    config = json.loads((export / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == 2 and config["torch_dtype"] == "float32"

    def names(path: Path) -> set[str]:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return set(f.keys())

    assert names(export) == names(root / "hf")  # the save_pretrained (hub) name form
    loaded = InternVLForConditionalGeneration.from_pretrained(
        export, attn_implementation="eager"
    ).eval()
    original, exported = hf_model.state_dict(), loaded.state_dict()
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor), f"{name} changed"
    diff = (_hf_token_logprobs(loaded, *rows) - expected).abs().max().item()
    assert diff == 0.0, f"the exported model's log-probs differ by {diff}"


@pytest.mark.distributed
@pytest.mark.megatron
def test_internvl_to_mcore_tp2_matches_transformers_and_back(tmp_path: Path, hf_model: Any) -> None:
    _save_hf(tmp_path, hf_model)
    rows = _rows()
    expected = _hf_token_logprobs(hf_model, *rows)

    results = run_distributed(_convert_score_export, 2, args=(str(tmp_path), rows), timeout_s=300)
    _check_logprobs({name: results[0][name] for name in ("tp2", "tp1")}, expected)

    from megatron_gndpo.checkpoint.vlm_convert import read_vision_config

    vision = read_vision_config(tmp_path / "mcore")
    assert vision.image_mean == (0.5, 0.5, 0.5) and vision.projector_norm_epsilon == 1e-5
    _check_export(tmp_path, hf_model, rows, expected)


# ---------------------------------------------------------------------------------------------
# Pipeline layouts: PP=2 and TP=2 x PP=2 import, scoring on the last stage, export


def _convert_pipeline_score_export(
    rank: int, world_size: int, root: str, rows: Any
) -> dict[str, Any]:
    """Convert at PP=2 (DP=2) and at TP=2 x PP=2 on 4 ranks; score fresh loads of each (and the
    TP=2 x PP=2 checkpoint resharded to PP=2); export the TP=2 x PP=2 one."""
    from megatron_gndpo.checkpoint import convert_cli
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.checkpoint.vlm_convert import convert_vlm_hf_to_mcore
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups

    tp2pp2 = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)
    pp2 = ParallelConfig(pipeline_parallel=2)
    layouts = {
        "tp2pp2": (tp2pp2, build_student_groups(ParallelLayout(world_size, tp=2, pp=2), seed=1)),
        "pp2": (pp2, build_groups(ParallelLayout(world_size, pp=2), name="pp2")),
    }
    for name, (parallel, groups) in layouts.items():
        convert_vlm_hf_to_mcore(
            Path(root) / "hf", Path(root) / f"mcore_{name}", groups=groups, parallel=parallel
        )
    model, vision = vlm_mapping.vlm_configs_from_hf(
        json.loads((Path(root) / "hf" / "config.json").read_text())
    )
    out: dict[str, Any] = {"stage": layouts["pp2"][1].coords["pp"]}
    # (checkpoint, layout it is loaded at): fresh models, the saved checkpoints are tested
    for ckpt, name in (("pp2", "pp2"), ("tp2pp2", "tp2pp2"), ("tp2pp2", "pp2")):
        parallel, groups = layouts[name]
        net = build_vlm(model, vision, parallel, groups)
        load_checkpoint(Path(root) / f"mcore_{ckpt}", net)
        out[f"{ckpt}->{name}"] = _score(net, groups, rows)
        assert hasattr(net, "vision_model") and (net.vision_model is not None) == (
            groups.is_first_stage
        ), "the vision encoder lives on the first pipeline stage only"
    convert_cli.mcore_to_hf_main(
        ["--mcore-dir", str(Path(root) / "mcore_tp2pp2"), "--out", str(Path(root) / "export"),
         "--dtype", "fp32"]
    )  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_internvl_to_mcore_pipeline_matches_transformers_and_back(
    tmp_path: Path, hf_model: Any
) -> None:
    _save_hf(tmp_path, hf_model)
    rows = _rows()
    expected = _hf_token_logprobs(hf_model, *rows)

    results = run_distributed(
        _convert_pipeline_score_export, 4, args=(str(tmp_path), rows), timeout_s=400
    )
    names = ("pp2->pp2", "tp2pp2->tp2pp2", "tp2pp2->pp2")
    for res in results:  # only the last stage scores
        assert all((res[n] is None) == (res["stage"] == 0) for n in names), res["stage"]
    last = [res for res in results if res["stage"] == 1]
    assert len(last) == 2
    for res in last:
        _check_logprobs({n: res[n] for n in names}, expected)
    _check_export(tmp_path, hf_model, rows, expected)
