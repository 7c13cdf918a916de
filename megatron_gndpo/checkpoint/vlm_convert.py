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
    HF_CONFIG_FILE,
    VISION_CONFIG_FILE,
    HFCheckpoint,
    check_dtype,
    check_layout,
    describe_checkpoints,
    export_checkpoint,
    read_hf_config,
    read_model_config,
    source_dtype,
    source_hf_config,
)
from megatron_gndpo.checkpoint.dist import resolve, save_checkpoint
from megatron_gndpo.checkpoint.hf_mapping import FAMILIES, global_names, shard_for_rank
from megatron_gndpo.config.schema import Dtype, ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.tokenizer import copy_tokenizer_files
from megatron_gndpo.errors import ConversionError, MissingFileError
from megatron_gndpo.parallel.distributed import barrier, rank
from megatron_gndpo.parallel.groups import ParallelGroups

# The image processor's files, carried beside the tokenizer's.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
VLM_LAYERS = "language_model.decoder.layers."  # the layers split over pipeline stages
_MAX_SHARD_BYTES = 5 * 1024**3


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
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
    stored = {vlm_mapping.canonical_hf_name(n): n for n in hf.names}
    padded = model.padded_vocab_size(tp)
    with torch.no_grad():
        for local, full_name, param in vlm_global_names(net):
            mapping = vlm_mapping.vlm_mapping_for(full_name, model, vision)
            tensors = [hf.get(stored[n]) for n in mapping.hf]
            full = mapping.to_megatron(tensors, model, vision, padded_vocab=padded)
            # only the language model's MLP is gated ([gate; up] halves sliced per rank)
            gated = model.swiglu and mapping.lm is not None
            shard = shard_for_rank(local, full, param, tp=tp, tp_rank=tp_rank, swiglu=gated)
            param.copy_(shard)
            del tensors, full, shard


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
    out_root = Path(out_root)
    if rank() == 0:
        out_root.mkdir(parents=True, exist_ok=True)
    barrier()
    save_checkpoint(out_root, 0, net)
    if rank() == 0:
        describe_checkpoints(out_root, model, vision)
        (out_root / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
        _copy_side_files(hf_dir, out_root)
    barrier()
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


def _lm_family(
    source: dict[str, Any] | None, family: str | None, where: Path, model: ModelConfig
) -> str:
    if family is not None:
        return family
    text = (source or {}).get("text_config") or {}
    found = text.get("model_type") or model.family
    if found is None:
        raise ConversionError(
            f"pass --family (the language model's: one of {', '.join(FAMILIES)}): no source "
            f"config.json beside {where} tells it, and its model config sets no family"
        )
    return str(found)


def convert_vlm_mcore_to_hf(
    mcore_root: str | Path,
    out_dir: str | Path,
    *,
    model: ModelConfig | None = None,
    vision: VisionConfig | None = None,
    family: str | None = None,
    dtype: Dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = _MAX_SHARD_BYTES,
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

    check_dtype(dtype)
    step = resolve(mcore_root)  # a CheckpointError before anything is built
    base = Path(mcore_root) if step != Path(mcore_root) else step.parent
    model = model if model is not None else read_model_config(base)
    model = dataclasses.replace(model, params_dtype=source_dtype(step, model))
    dtype = dtype or model.params_dtype
    vision = vision if vision is not None else read_vision_config(base)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    source = source_hf_config(base, tok_dir)
    family = _lm_family(source, family, base, model)
    # config.json names the dtype the weights are written in
    out_model = dataclasses.replace(model, params_dtype=dtype)
    config = vlm_mapping.hf_config_from_vlm(out_model, vision, family)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = ((source or {}).get("text_config") or {}).get(key)
        if value is not None:
            config["text_config"][key] = value

    return export_checkpoint(
        step, out_dir,
        build=lambda groups: build_vlm(model, vision, ParallelConfig(), groups),
        to_hf=lambda state: vlm_mapping.iter_megatron_to_hf(state, model, vision, consume=True),
        config=config, side_files=tok_dir if tok_dir is not None else base, dtype=dtype,
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
