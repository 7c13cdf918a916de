"""FP8 export of a Hugging Face model through NVIDIA ModelOpt post-training quantization.

    BF16 HF directory ─ transformers ─> model ─ mtq.quantize(FP8_DEFAULT_CFG, calibration) ─>
    ─ export_hf_checkpoint ─> HF directory vLLM loads with its ``modelopt`` quantization

What the output holds (ModelOpt's unified Hugging Face checkpoint): every decoder ``Linear``
weight in ``float8_e4m3fn`` with a float32 per-tensor ``weight_scale`` and a static per-tensor
``input_scale`` for its activations (``w ≈ weight_fp8 · weight_scale``, ``x_fp8 = x /
input_scale``), embeddings, norms, biases and ``lm_head`` in BF16; ``config.json`` with a
``quantization_config`` (``quant_method: modelopt``, ``quant_algo: FP8``) and
``hf_quant_config.json``; the tokenizer files of the source directory.

Calibration: the input scales are ``amax / 448`` (448 is E4M3's largest finite value), with
``amax`` the largest absolute activation seen while the model runs the calibration prompts
(ModelOpt's max calibrator). A few hundred prompts from the training distribution are typical;
the weight scales need no data.

ModelOpt is the ``modelopt`` extra; without it :func:`require_modelopt` raises a
``MissingExtraError`` that names the extra. Quantization runs on a GPU when one is visible, and on
the CPU otherwise (slow for real sizes: tested there with tiny models only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.config.extras import require_package

# A calibration prompt longer than this is cut: the amax of a few hundred tokens per prompt is
# what calibration needs, and longer rows only cost time.
DEFAULT_CALIBRATION_TOKENS = 512
DEFAULT_CALIBRATION_SAMPLES = 128


def require_modelopt(what: str = "FP8 export (--fp8-out)") -> None:
    """Raise ``MissingExtraError`` naming the ``modelopt`` extra unless ModelOpt is importable."""
    require_package(
        "modelopt", what=what, extra="modelopt", instead="export BF16 only (leave out --fp8-out)"
    )


def calibration_texts(spec: str, *, key: str = "prompt", limit: int) -> list[str]:
    """Up to ``limit`` calibration prompts: a ``.txt`` file (one prompt per line), or any prompt
    set ``data.train`` accepts (``.jsonl``, ``.parquet``, ``builtin:NAME``; ``key`` names the
    prompt column)."""
    if spec.endswith(".txt"):
        lines = Path(spec).read_text(encoding="utf-8").splitlines()
        texts = [line for line in lines if line.strip()]
    else:
        from megatron_gndpo.data.datasets import load_prompts

        texts = [example.prompt for example in load_prompts(spec, prompt_key=key)]
    if not texts:
        raise ValueError(f"no calibration prompts in {spec}")
    return texts[:limit]


def tokenize_calibration(
    texts: Sequence[str], tokenizer_dir: str | Path, *, max_tokens: int
) -> list[list[int]]:
    """Token ids of each prompt with the model's tokenizer, chat template applied when it has
    one (the deployed model sees templated prompts), cut to ``max_tokens``."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # some tokenizers return a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids)[:max_tokens])
    return out


def _forward_loop(calibration: Sequence[Sequence[int]], device: torch.device) -> Any:
    """The calibration pass ModelOpt runs with its quantizers collecting amax: one prompt per
    forward (no padding, so padding never enters the statistics)."""

    def loop(model: Any) -> None:
        for ids in calibration:
            model(torch.tensor([list(ids)], device=device))

    return loop


def export_fp8(
    hf_dir: str | Path,
    out_dir: str | Path,
    calibration: Sequence[Sequence[int]],
    *,
    device: str | None = None,
) -> Path:
    """Quantize the BF16 Hugging Face model in ``hf_dir`` to FP8 and write it to ``out_dir``.

    ``calibration`` holds token-id rows (at least one, none empty). ``device`` defaults to the
    GPU when one is visible. Returns ``out_dir``.
    """
    require_modelopt()
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from megatron_gndpo.data.tokenizer import copy_tokenizer_files

    if not calibration or any(len(ids) == 0 for ids in calibration):
        raise ValueError("FP8 calibration needs at least one prompt and no empty prompt")
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model: Any = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    model = model.to(where).eval()
    with torch.no_grad():
        model = mtq.quantize(
            model, mtq.FP8_DEFAULT_CFG, forward_loop=_forward_loop(calibration, where)
        )
    out = Path(out_dir)
    with torch.inference_mode():
        export_hf_checkpoint(model, export_dir=out)
    copy_tokenizer_files(hf_dir, out)
    _check_exported(out)
    return out


def _check_exported(out: Path) -> None:
    """Fail loudly if ModelOpt wrote something other than an FP8 checkpoint."""
    config = json.loads((out / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "modelopt" or quant.get("quant_algo") != "FP8":
        raise RuntimeError(
            f"ModelOpt wrote {out / 'config.json'} without an FP8 quantization_config "
            f"(found {quant!r}); vLLM would load it unquantized"
        )
