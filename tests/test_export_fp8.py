"""FP8 export through NVIDIA ModelOpt: the format vLLM loads, scales that reproduce the weights,
and a clear error naming the ``modelopt`` extra when ModelOpt is not installed.

The quantization tests run on the CPU with a tiny Qwen2 built in code (no downloads) and are
skipped where ModelOpt is not importable (it is not in the ``test`` extra). What they verify:
ModelOpt's PTQ (``mtq.quantize`` with ``FP8_DEFAULT_CFG`` and our calibration loop) and its
unified HF export run on the CPU; the output has E4M3 decoder weights with per-tensor scales,
BF16 embeddings/lm_head, ``quantization_config.quant_method == "modelopt"``; dequantized weights
are within E4M3 rounding of the BF16 ones and the model's log-probs with them stay close. Not
verified here (no GPU, no vLLM on CI): that vLLM serves the directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import convert_cli
from megatron_gndpo.checkpoint.export_fp8 import calibration_texts, require_modelopt
from megatron_gndpo.config import MissingExtraError

E4M3_MAX = 448.0
PROMPTS = ["the cat sat on a mat", "a dog ran to the cat", "it sat", "the mat ran to a dog"]


def _tokenizer() -> Any:
    """A byte-level BPE (the kind Qwen2 uses) trained on PROMPTS: AutoTokenizer loads it as
    Qwen2's tokenizer from a directory whose config says qwen2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(PROMPTS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _tiny_hf_dir(path: Path) -> Path:
    """A random bf16 Qwen2 (QKV biases, GQA) and its tokenizer, saved like an export."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _calibration_ids(prompts: list[str] = PROMPTS) -> list[list[int]]:
    tokenizer = _tokenizer()
    return [tokenizer(text)["input_ids"] for text in prompts]


def _logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float().log_softmax(-1)


# ---------------------------------------------------------------------------------------------
# Without ModelOpt


def _hide_modelopt(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name.split(".")[0] == "modelopt" else real(name, *a),
    )  # fmt: skip


def test_missing_modelopt_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_modelopt(monkeypatch)
    with pytest.raises(MissingExtraError, match=r"megatron-gndpo\[modelopt\]"):
        require_modelopt()


def test_cli_without_modelopt_fails_before_exporting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _hide_modelopt(monkeypatch)
    argv = ["--mcore-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]
    with pytest.raises(SystemExit) as exit_info:
        convert_cli.mcore_to_hf_main([*argv, "--fp8-out", str(tmp_path / "fp8")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "FP8 export (--fp8-out) needs the Python package 'modelopt'" in err
    assert "pip install 'megatron-gndpo[modelopt]'" in err
    assert "leave out --fp8-out" in err
    assert not (tmp_path / "hf").exists()  # nothing was exported


def test_calibration_texts_from_text_and_prompt_files(tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("first prompt\n\n  \nsecond prompt\nthird\n")
    assert calibration_texts(str(text), limit=2) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(5)))
    assert calibration_texts(str(jsonl), key="question", limit=3) == ["q0", "q1", "q2"]
    assert len(calibration_texts("builtin:arithmetic", limit=4)) == 4
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no calibration prompts"):
        calibration_texts(str(tmp_path / "empty.txt"), limit=4)


# ---------------------------------------------------------------------------------------------
# With ModelOpt (CPU)


def _check_fp8_dir(bf16_dir: Path, fp8_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((fp8_dir / "config.json").read_text())
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["quant_algo"]) == ("modelopt", "FP8")
    hf_quant = json.loads((fp8_dir / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "FP8"
    assert (fp8_dir / "tokenizer.json").is_file()  # copied from the BF16 export

    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    bf16 = load_file(str(bf16_dir / "model.safetensors"))
    linear = [n for n in bf16 if n.endswith("proj.weight")]
    assert len(linear) == 2 * 7  # q, k, v, o, gate, up, down per layer
    dequantized = dict(bf16)
    for name in linear:
        base = name.removesuffix(".weight")
        weight, scale = fp8[name], fp8[f"{base}.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn
        assert scale.dtype == torch.float32 and scale.numel() == 1
        assert fp8[f"{base}.input_scale"] > 0  # calibrated: amax / 448 of the activations
        ref = bf16[name].float()
        # per-tensor scale: amax maps to E4M3's largest value
        assert float(scale) == pytest.approx(float(ref.abs().max()) / E4M3_MAX, rel=1e-2)
        deq = weight.float() * scale
        # E4M3 keeps 3 mantissa bits: relative rounding error <= 2^-4 (normals)
        assert float((deq - ref).norm() / ref.norm()) < 2**-4
        dequantized[name] = deq.to(torch.bfloat16)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert fp8[name].dtype == torch.bfloat16
        assert torch.equal(fp8[name], bf16[name])

    model = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).eval()
    ids = _calibration_ids()[1]
    reference = _logprobs(model, ids)
    model.load_state_dict(dequantized, strict=False)
    assert float((_logprobs(model, ids) - reference).abs().max()) < 0.05


def test_fp8_export_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("modelopt.torch.quantization")
    from megatron_gndpo.checkpoint.export_fp8 import export_fp8

    bf16_dir = _tiny_hf_dir(tmp_path / "bf16")
    out = export_fp8(bf16_dir, tmp_path / "fp8", _calibration_ids(), device="cpu")
    assert out == tmp_path / "fp8"
    _check_fp8_dir(bf16_dir, out)


def test_cli_fp8_out_calibrates_with_the_exported_tokenizer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``convert mcore-to-hf --fp8-out``: the BF16 export (tested in test_conversion.py, stood in
    for here) is followed by calibration on prompts from a file, tokenized by the exported
    tokenizer, and the FP8 export."""
    pytest.importorskip("modelopt.torch.quantization")
    import megatron_gndpo.checkpoint.convert as convert
    import megatron_gndpo.compat.cpu as cpu
    import megatron_gndpo.parallel.distributed as distributed

    def fake_export(mcore_root: str, out_dir: str, **_: Any) -> Path:
        return _tiny_hf_dir(Path(out_dir))

    monkeypatch.setattr(convert, "convert_mcore_to_hf", fake_export)
    monkeypatch.setattr(cpu, "enable_if_no_cuda", lambda: None)
    monkeypatch.setattr(distributed, "init_distributed", lambda: None)
    monkeypatch.setattr(distributed, "shutdown_distributed", lambda: None)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(PROMPTS) + "\n")
    bf16_dir, fp8_dir = tmp_path / "hf", tmp_path / "hf_fp8"
    convert_cli.mcore_to_hf_main([
        "--mcore-dir", str(tmp_path / "ckpt"), "--out", str(bf16_dir), "--fp8-out", str(fp8_dir),
        "--calib-data", str(calib), "--calib-samples", "3",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert f"wrote {bf16_dir}" in out
    tokens = sum(map(len, _calibration_ids(PROMPTS[:3])))
    assert f"calibrating FP8 scales on 3 prompts ({tokens} tokens)" in out
    assert f"wrote {fp8_dir} (FP8, ModelOpt unified HF format)" in out
    _check_fp8_dir(bf16_dir, fp8_dir)
