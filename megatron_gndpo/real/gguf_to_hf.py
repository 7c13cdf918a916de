"""A GGUF file (llama.cpp's format) as an ordinary Hugging Face model directory in fp32.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=NAME)``, with the ``gguf`` and
``accelerate`` packages: the ``real`` extra) and dequantizes every tensor to fp32 on load; what
this module adds is the step to a directory every other tool reads:

- the model loaded from GGUF keeps ``quantization_config`` (``quant_method: gguf``) in its
  config, and ``save_pretrained`` refuses it; the weights are already plain fp32 tensors, so
  they move into a model built from the config without it, which saves normally
  (``model.safetensors``, tied embeddings stored once);
- values GGUF stores as float32 (``rms_norm_eps`` 1e-5 reads back as 9.999999747e-06) are
  written as the shortest decimal that is the same float32, as the upstream config.json has them;
- the GGUF's model name (``_model_name_or_path``) is dropped;
- the tokenizer (BPE vocabulary, merges, special tokens, chat template) is saved beside it:
  ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, with
  ``model_max_length`` set to the model's context length.

The result is the quantized model's weights exactly (dequantization is the only change), so a
model fetched this way carries the quantization noise of its GGUF; it is not the original
checkpoint. Used by :mod:`megatron_gndpo.real.fetch` (the real-model tier), never by
training code.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from megatron_gndpo.errors import MissingFileError, MissingPackageError

# The packages transformers' GGUF reader needs (setup.py's `real` extra).
REQUIRED_PACKAGES = ("gguf", "accelerate")
# Config values GGUF stores as float32 that upstream config.json files write as decimals.
_FLOAT32_KEYS = ("rms_norm_eps",)


def require_gguf_packages() -> None:
    """Raise MissingPackageError naming the extra unless transformers can read GGUF here."""
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"reading a GGUF file needs the Python packages {', '.join(missing)}, which are not "
            "installed here: pip install -e '.[real]' (the real-model tier's extra)"
        )


def shortest_float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 as ``value`` (9.999999747e-06 ->
    1e-05): what a float read back from a float32 field was written as."""
    import numpy as np

    return float(str(np.float32(value)))


def clean_config(config: dict[str, Any]) -> dict[str, Any]:
    """A GGUF-loaded model's ``config.to_dict()`` as a plain config.json: no
    ``quantization_config``, no GGUF model name, float32 fields as their decimals."""
    dropped = ("quantization_config", "_model_name_or_path")
    out = {k: v for k, v in config.items() if k not in dropped}
    for key in _FLOAT32_KEYS:
        if isinstance(out.get(key), float):
            out[key] = shortest_float32(out[key])
    return out


def convert_gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write ``gguf_file``'s model (dequantized to fp32) and tokenizer to ``out_dir`` as a
    Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
    ``convert hf-to-mcore`` read. ``out_dir`` must not hold another model. Returns it.

    Takes ~25 s and ~1.2 GB of memory for a 135M model on 2 cores (transformers dequantizes in
    numpy, then the weights are copied once into the model that is saved).
    """
    import torch

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise MissingFileError(f"GGUF file {gguf_file} does not exist")
    require_gguf_packages()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = clean_config(loaded.config.to_dict())
    plain = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(plain, dtype=torch.float32)
    # every tensor, strictly: a name transformers' GGUF reader mapped differently fails here
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.model_max_length = int(config["max_position_embeddings"])
    tokenizer.save_pretrained(out)
    _drop_loader_flags(out / "tokenizer_config.json")
    return out


def _drop_loader_flags(path: Path) -> None:
    """transformers writes how this tokenizer happened to be loaded (``is_local``,
    ``local_files_only``) into tokenizer_config.json; they say nothing about the tokenizer."""
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
