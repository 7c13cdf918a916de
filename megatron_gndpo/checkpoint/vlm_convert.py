"""Convert Hugging Face InternVL checkpoints to the project's VLM dist-checkpoints and back.

The vision-language counterpart of :mod:`~megatron_gndpo.checkpoint.convert` (same file
handling, same checkpoint format); names and layouts live in
:mod:`~megatron_gndpo.checkpoint.vlm_mapping`.

- :func:`convert_vlm_hf_to_mcore` runs on every rank of a job laid out as the target TP/PP: each
  rank builds its shard of :func:`~megatron_gndpo.models.vlm.build_vlm`, reads the HF tensors it
  needs, slices them, and the job saves one model-only checkpoint at step 0. Beside it:
  ``model_config.yaml`` (the language model), ``vision_config.yaml`` (the
  :class:`VisionConfig`), ``hf_config.json`` (the source ``config.json``) and the tokenizer and
  image-processor files.
- :func:`convert_vlm_mcore_to_hf` builds a TP=1/PP=1 VLM, loads a checkpoint saved at any TP/PP
  and writes ``model.safetensors`` (saved-form names, as ``save_pretrained`` writes them),
  ``config.json`` and those files; the result loads with
  ``transformers.InternVLForConditionalGeneration.from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.checkpoint import vlm_mapping
from megatron_gndpo.checkpoint.convert import (
    MAX_SHARD_BYTES,
    VISION_CONFIG_FILE,
    HFCheckpoint,
    check_layout,
    copy_token_ids,
    export_checkpoint,
    export_source,
    fill_shard,
    read_hf_config,
    save_converted,
    source_family,
)
from megatron_gndpo.checkpoint.hf_mapping import global_names
from megatron_gndpo.config.schema import Dtype, ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.tokenizer import copy_tokenizer_files
from megatron_gndpo.errors import ConversionError, MissingFileError
from megatron_gndpo.fileio import read_json
from megatron_gndpo.parallel.groups import ParallelGroups

# The image processor's files, carried beside the tokenizer's.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
VLM_LAYERS = "language_model.decoder.layers."  # the layers split over pipeline stages


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = read_json(path)
    return data if isinstance(data, dict) else None


def read_vlm_configs(hf_dir: str | Path) -> tuple[dict[str, Any], ModelConfig, VisionConfig]:
    """(config.json, language ModelConfig, VisionConfig) of an InternVL model directory."""
    hf_config = read_hf_config(hf_dir)
    preprocessor = _read_json(Path(hf_dir) / "preprocessor_config.json")
    model, vision = vlm_mapping.vlm_configs_from_hf(hf_config, preprocessor)
    return hf_config, model, vision


def _check_vlm_layout(model: ModelConfig, vision: VisionConfig, parallel: ParallelConfig) -> None:
    check_layout(model, parallel)
    tp = parallel.tensor_parallel
    if vision.num_attention_heads % tp:
        raise ConversionError(
            f"TP={tp} must divide the vision encoder's {vision.num_attention_heads} heads (the "
            "encoder shares the language model's tensor parallelism)"
        )


def vlm_global_names(net: Any) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """:func:`~megatron_gndpo.checkpoint.hf_mapping.global_names` of a VLM (its language model's
    layers are the ones split over pipeline stages)."""
    return global_names(net, VLM_LAYERS)


def fill_vlm_from_hf(
    net: torch.nn.Module,
    hf: HFCheckpoint,
    model: ModelConfig,
    vision: VisionConfig,
    *,
    tp: int,
    tp_rank: int,
) -> None:
    """Copy every parameter of this rank's VLM shard ``net`` from the InternVL checkpoint."""
    fill_shard(
        vlm_global_names(net), vlm_mapping.VLMTable(model, vision), _SavedNames(hf),
        padded_vocab=model.padded_vocab_size(tp), tp=tp, tp_rank=tp_rank,
    )  # fmt: skip


class _SavedNames:
    """An InternVL checkpoint's tensors by their saved-form names, whichever form it stores."""

    def __init__(self, hf: HFCheckpoint) -> None:
        self._hf = hf
        self._stored = {vlm_mapping.canonical_hf_name(n): n for n in hf.names}

    def get(self, name: str) -> torch.Tensor:
        return self._hf.get(self._stored[name])


def _copy_side_files(src: str | Path, dst: str | Path, vision: VisionConfig | None = None) -> None:
    """Tokenizer and processor files from ``src``; processor files ``src`` lacks are written
    from ``vision`` when given (an export of a model trained here is then servable as is)."""
    copy_tokenizer_files(src, dst)
    written = vlm_mapping.internvl_processor_files(vision) if vision is not None else {}
    for name in PROCESSOR_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
        elif name in written:
            (Path(dst) / name).write_text(json.dumps(written[name], indent=2))


def convert_vlm_hf_to_mcore(
    hf_dir: str | Path,
    out_root: str | Path,
    *,
    groups: ParallelGroups,
    parallel: ParallelConfig,
) -> tuple[ModelConfig, VisionConfig]:
    """Convert an InternVL model directory to a model-only VLM dist-checkpoint at step 0.

    Call on every rank of a job laid out as ``parallel``. Returns the language
    :class:`ModelConfig` and the :class:`VisionConfig`, also written beside the checkpoint.
    """
    from megatron_gndpo.models.vlm import build_vlm

    hf_config, model, vision = read_vlm_configs(hf_dir)
    _check_vlm_layout(model, vision, parallel)
    with HFCheckpoint(hf_dir) as hf:
        vlm_mapping.check_hf_names(hf.names, model, vision, where=str(hf_dir))
        net = build_vlm(model, vision, parallel, groups)
        fill_vlm_from_hf(
            net, hf, model, vision, tp=parallel.tensor_parallel, tp_rank=groups.coords["tp"]
        )
    save_converted(out_root, net, hf_dir, hf_config, model, vision, side_files=_copy_side_files)
    return model, vision


def read_vision_config(mcore_root: str | Path) -> VisionConfig:
    """The ``vision_config.yaml`` written beside a converted VLM checkpoint."""
    from megatron_gndpo.config.loader import build, read_yaml

    path = Path(mcore_root) / VISION_CONFIG_FILE
    if not path.is_file():
        raise MissingFileError(
            f"no {VISION_CONFIG_FILE} in {mcore_root}: pass the VisionConfig the VLM was "
            "trained with"
        )
    return build(VisionConfig, read_yaml(path), prefix="vision.")


def convert_vlm_mcore_to_hf(
    mcore_root: str | Path,
    out_dir: str | Path,
    *,
    model: ModelConfig | None = None,
    vision: VisionConfig | None = None,
    family: str | None = None,
    dtype: Dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write an InternVL model directory from a VLM checkpoint saved at any TP/PP.

    Meant for one process (a larger world loads the full model on every rank; rank 0 writes).
    ``model`` and ``vision`` default to the configs written beside the checkpoint, ``family``
    (the language model's: llama, qwen2, qwen3) to the source ``config.json``'s
    ``text_config.model_type``. Token ids come from the source config; tokenizer and processor
    files from ``tokenizer_dir`` or from beside the checkpoint; ``dtype`` defaults to the one
    the weights were saved in. Returns ``out_dir``.
    """
    from megatron_gndpo.models.vlm import build_vlm

    # a VLM checkpoint is this project's: no Megatron-Bridge or Megatron-LM form is read
    src = export_source(mcore_root, model, dtype, tokenizer_dir, foreign=False)
    saved = src.model
    vision = vision if vision is not None else read_vision_config(src.base)
    text = (src.source or {}).get("text_config")
    if family is None:
        family = source_family(text, saved, src.base, whose="the language model's: ")
    # config.json names the dtype the weights are written in
    out_model = dataclasses.replace(saved, params_dtype=src.dtype)
    config = vlm_mapping.hf_config_from_vlm(out_model, vision, family)
    copy_token_ids(text, config["text_config"])

    return export_checkpoint(
        src.step, out_dir,
        build=lambda groups: build_vlm(saved, vision, ParallelConfig(), groups),
        to_hf=lambda state: vlm_mapping.iter_megatron_to_hf(state, saved, vision, consume=True),
        config=config, side_files=src.side_files, dtype=src.dtype,
        max_shard_bytes=max_shard_bytes,
        copy_side_files=functools.partial(_copy_side_files, vision=vision),
    )  # fmt: skip


def is_hf_vlm(hf_dir: str | Path) -> bool:
    """Whether ``hf_dir``'s ``config.json`` is an InternVL one (False when it has none)."""
    config = _read_json(Path(hf_dir) / "config.json")
    return (config or {}).get("model_type") in (vlm_mapping.MODEL_TYPE, "internvl_chat")


def is_vlm_checkpoint(mcore_dir: str | Path) -> bool:
    """Whether a checkpoint root (or its step directory) has ``vision_config.yaml`` beside it."""
    path = Path(mcore_dir)
    return any((p / VISION_CONFIG_FILE).is_file() for p in (path, path.parent))
