"""Convert Hugging Face checkpoints to the project's megatron dist-checkpoints and back.

- :func:`convert_hf_to_mcore` runs on every rank of a job laid out as the target TP/PP (and EP
  for a mixture-of-experts model: each rank fills only its own experts): each
  rank builds its own shard, reads only the HF tensors it needs (``safetensors.safe_open``,
  single-file or sharded with ``model.safetensors.index.json``), slices them and the job saves
  one model-only checkpoint at step 0. Beside it: ``model_config.yaml`` (the
  :class:`ModelConfig`), ``hf_config.json`` (the source ``config.json``, for token ids on
  export) and the tokenizer files.
- :func:`convert_mcore_to_hf` builds a TP=1/PP=1 model, loads a checkpoint saved at any TP/PP
  (dist-checkpointing reshards), maps it back and writes ``model.safetensors`` (sharded past
  ``max_shard_bytes``), ``config.json`` and the tokenizer files; the result loads with
  ``transformers.AutoModelForCausalLM.from_pretrained``.

The parameter names and layouts live in :mod:`megatron_gndpo.checkpoint.hf_mapping`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from megatron_gndpo.checkpoint import foreign_config, hf_mapping, interop
from megatron_gndpo.checkpoint.dist import (
    MODEL_CONFIG_FILE,
    load_checkpoint,
    resolve,
    save_checkpoint,
    saved_tensors,
)
from megatron_gndpo.config.loader import to_yaml
from megatron_gndpo.config.schema import Dtype, ModelClass, ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.tokenizer import copy_tokenizer_files
from megatron_gndpo.errors import ConversionError, MissingFileError
from megatron_gndpo.fileio import read_json
from megatron_gndpo.models import naming
from megatron_gndpo.parallel.distributed import barrier, rank
from megatron_gndpo.parallel.groups import ParallelGroups

VISION_CONFIG_FILE = "vision_config.yaml"  # a VLM's, beside its model_config.yaml
HF_CONFIG_FILE = "hf_config.json"
_SAFETENSORS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_TORCH_DTYPES: dict[Dtype, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
}  # fmt: skip
# Largest output file before the safetensors are split (transformers' default is 5 GB too).
MAX_SHARD_BYTES = 5 * 1024**3
# Token ids carried from the source config.json into the exported one.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingFileError(
            f"no config.json in {hf_dir}: point --hf-dir at a Hugging Face model directory "
            "(the one save_pretrained / huggingface-cli download wrote)"
        )
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object: is it a config.json?")
    return config


class HFCheckpoint:
    """Lazy access to the tensors of a Hugging Face safetensors checkpoint (one file or sharded).

    Only the files holding requested tensors are opened; tensors are read one at a time.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index, single = self.dir / _INDEX, self.dir / _SAFETENSORS
        if index.is_file():
            weight_map = read_json(index)["weight_map"]
            self.files: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), _SAFETENSORS)
        else:
            found = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = (
                f" (found {found}: re-save the model with save_pretrained(..., "
                "safe_serialization=True))"
                if found
                else ""
            )
            raise MissingFileError(f"no {_SAFETENSORS} or {_INDEX} in {self.dir}{hint}")
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConversionError(
                f"tensor {name!r} is missing from the Hugging Face checkpoint in {self.dir}"
            )
        file = self.files[name]
        if file not in self._open:
            from safetensors import safe_open

            path = self.dir / file
            if not path.is_file():
                raise MissingFileError(f"{path} (named in {_INDEX} for {name!r}) is missing")
            self._open[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        tensor: torch.Tensor = self._open[file].get_tensor(name)
        return tensor

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    tp, pp, ep = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel
    if model.query_groups % tp or model.num_attention_heads % tp:
        raise ConversionError(
            f"TP={tp} must divide the attention heads ({model.num_attention_heads}) and KV heads "
            f"({model.query_groups}); choose a tensor-parallel size that divides both"
        )
    if model.num_layers % pp:
        raise ConversionError(
            f"PP={pp} does not divide the {model.num_layers} layers; choose a pipeline size "
            "that divides the layer count"
        )
    if ep > 1 and not model.is_moe:
        raise ConversionError(
            f"EP={ep} needs a mixture-of-experts model and this one is dense; use EP=1 (--ep 1)"
        )
    if model.is_moe and (model.num_experts or 0) % ep:
        raise ConversionError(
            f"EP={ep} does not divide the {model.num_experts} experts; choose an expert-parallel "
            "size that divides the expert count"
        )
    if model.is_moe and model.expert_ffn_hidden_size % tp:
        raise ConversionError(
            f"TP={tp} does not divide the expert FFN width {model.expert_ffn_hidden_size} "
            "(moe_intermediate_size); choose a tensor-parallel size that divides it"
        )


def describe_checkpoints(
    directory: str | Path, model: ModelConfig, vision: VisionConfig | None = None
) -> None:
    """The architecture beside a directory of checkpoints (``model_config.yaml``, and a VLM's
    ``vision_config.yaml``), so ``convert mcore-to-hf`` needs no flags. Rank 0 only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MODEL_CONFIG_FILE).write_text(to_yaml(model))
    if vision is not None:
        (directory / VISION_CONFIG_FILE).write_text(to_yaml(vision))


class TensorSource(Protocol):
    """Full Hugging Face tensors by name: an :class:`HFCheckpoint`, or weights received."""

    def get(self, name: str) -> torch.Tensor: ...


def fill_from_hf(
    net: torch.nn.Module,
    hf: TensorSource,
    model: ModelConfig,
    *,
    tp: int,
    tp_rank: int,
    expert_offset: int = 0,
    only: Container[str] | None = None,
) -> None:
    """Copy every parameter of this rank's shard ``net`` from the HF checkpoint.

    ``expert_offset``: the global index of this rank's first expert
    (:func:`~megatron_gndpo.checkpoint.hf_mapping.expert_offset`); experts are split over TP
    like the dense MLP (expert TP = TP). ``only``: copy just the parameters of these full-model
    names (a weight broadcast's bucket holds some layers: ``rollout/remote.fill_by_bucket``).
    """
    fill_shard(
        hf_mapping.global_names(net, expert_offset=expert_offset), hf_mapping.LanguageTable(model),
        hf, padded_vocab=model.padded_vocab_size(tp), tp=tp, tp_rank=tp_rank, only=only,
    )  # fmt: skip


def fill_shard[M: hf_mapping.Mapped](
    params: Iterable[tuple[str, str, torch.nn.Parameter]],
    table: hf_mapping.MappingTable[M],
    hf: TensorSource,
    *,
    padded_vocab: int,
    tp: int,
    tp_rank: int,
    only: Container[str] | None = None,
) -> None:
    """Copy each of this rank's ``params`` (local name, full-model name, parameter: a family's
    ``global_names``) from the HF tensors ``table`` maps it from, sliced for TP rank
    ``tp_rank``; with ``only``, just the parameters of these full-model names."""
    with torch.no_grad():
        for local, full_name, param in params:
            if only is not None and full_name not in only:
                continue
            mapping = table.mapping_for(full_name)
            tensors = [hf.get(n) for n in mapping.hf]
            full = table.to_megatron(mapping, tensors, padded_vocab=padded_vocab)
            shard = hf_mapping.shard_for_rank(
                local, full, param, tp=tp, tp_rank=tp_rank, swiglu=table.gated(mapping)
            )
            param.copy_(shard)
            del tensors, full, shard  # one parameter's full tensor at a time


def convert_hf_to_mcore(
    hf_dir: str | Path,
    out_root: str | Path,
    *,
    groups: ParallelGroups,
    parallel: ParallelConfig,
    model_class: ModelClass = "gpt",
) -> ModelConfig:
    """Convert a Hugging Face model directory to a model-only dist-checkpoint at step 0.

    Call on every rank of a job laid out as ``parallel`` (``groups`` from
    ``build_student_groups`` or ``build_groups``). ``model_class``: the megatron-core class
    written (``model.model_class``). Returns the model's :class:`ModelConfig`, also written to
    ``out_root/model_config.yaml``.
    """
    from megatron_gndpo.models.build import build_model

    hf_config = read_hf_config(hf_dir)
    model = hf_mapping.model_config_from_hf(hf_config)
    model = dataclasses.replace(model, model_class=model_class)
    check_layout(model, parallel)
    with HFCheckpoint(hf_dir) as hf:
        hf_mapping.check_hf_names(hf.names, model, where=str(hf_dir))
        net = build_model(model, parallel, groups)
        fill_from_hf(
            net, hf, model, tp=parallel.tensor_parallel, tp_rank=groups.coords["tp"],
            expert_offset=hf_mapping.expert_offset(model, groups.layout, groups.rank),
        )  # fmt: skip
    # Megatron-LM's args name the source's tokenizer, when it has one
    save_converted(out_root, net, hf_dir, hf_config, model, model_config=model,
                   tokenizer=str(hf_dir))  # fmt: skip
    return model


def save_converted(
    out_root: str | Path,
    net: torch.nn.Module,
    hf_dir: str | Path,
    hf_config: dict[str, Any],
    model: ModelConfig,
    vision: VisionConfig | None = None,
    *,
    side_files: Callable[[str | Path, str | Path], Any] = copy_tokenizer_files,
    **metadata: Any,
) -> None:
    """Save every rank's converted shard ``net`` as a model-only checkpoint at step 0
    (``metadata``: ``save_checkpoint``'s), and beside it (rank 0) the architecture
    (:func:`describe_checkpoints`), the source ``config.json`` and what ``side_files`` copies
    from ``hf_dir`` (the tokenizer's files, by default)."""
    out_root = Path(out_root)
    if rank() == 0:
        out_root.mkdir(parents=True, exist_ok=True)
    barrier()
    save_checkpoint(out_root, 0, net, **metadata)
    if rank() == 0:
        describe_checkpoints(out_root, model, vision)
        (out_root / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
        side_files(hf_dir, out_root)
    barrier()


def read_model_config(mcore_root: str | Path, step: Path | None = None) -> ModelConfig:
    """The architecture of a checkpoint: the ``model_config.yaml`` written beside it, else (a
    checkpoint of Megatron-Bridge or Megatron-LM) what step directory ``step`` says in that
    tool's form (``checkpoint/foreign_config.py``)."""
    from megatron_gndpo.config.loader import build, read_yaml

    path = Path(mcore_root) / MODEL_CONFIG_FILE
    if path.is_file():
        return build(ModelConfig, read_yaml(path), prefix="model.")
    found = foreign_config.read_model_config(step) if step is not None else None
    if found is None:
        theirs = (
            f", and {step} has neither Megatron-Bridge's {interop.BRIDGE_RUN_CONFIG} nor "
            "Megatron-LM's args in its common state"
            if step is not None
            else ""
        )
        raise MissingFileError(
            f"no {MODEL_CONFIG_FILE} in {mcore_root}{theirs}: pass the ModelConfig the "
            "checkpoint was trained with (--model-config FILE: the model section of the run's "
            "config.yaml)"
        )
    return found


def read_model_config_file(path: str | Path) -> ModelConfig:
    """The ModelConfig in a YAML file: a model section alone, or a whole run config (its
    ``model`` section is used), as ``--model-config`` takes it."""
    from megatron_gndpo.config.loader import build, read_yaml

    data = read_yaml(path)
    if isinstance(data.get("model"), dict):  # a whole run config: take its model section
        data = data["model"]
    return build(ModelConfig, data, prefix="model.")


def source_hf_config(
    base: Path, tokenizer_dir: Path | None, step: Path | None = None
) -> dict[str, Any] | None:
    """The source model's config.json: saved beside the checkpoint, in the tokenizer dir, or
    (a Megatron-Bridge import of step ``step``) in the Hugging Face directory it came from."""
    candidates = [base / HF_CONFIG_FILE]
    if tokenizer_dir is not None:
        candidates.append(tokenizer_dir / "config.json")
    for candidate in candidates:
        if candidate.is_file():
            data = read_json(candidate)
            return data if isinstance(data, dict) else None
    return foreign_config.source_hf_config(step) if step is not None else None


def source_dtype(step: Path, model: ModelConfig) -> Dtype:
    """The dtype a checkpoint's weights were saved in: that of most of its model tensors (the
    optimizer's fp32 master weights aside), else ``model.params_dtype``."""
    elements: dict[torch.dtype, int] = {}
    for key, (shape, dtype) in saved_tensors(step).items():
        if not key.startswith("optimizer") and dtype.is_floating_point:
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
    if not elements:
        return model.params_dtype
    most = max(elements, key=elements.__getitem__)
    return next((name for name, d in _TORCH_DTYPES.items() if d == most), model.params_dtype)


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """What a checkpoint holds, read from its files (nothing built)."""

    step: Path  # the step directory that loads (the newest, given a root)
    root: Path  # the directory beside which its descriptions lie (model_config.yaml, tokenizer)
    model: ModelConfig


def saved_model(
    path: str | Path,
    model: ModelConfig | None = None,
    *,
    dtype: Dtype | Literal["saved"] | None = None,
    foreign: bool = True,
) -> SavedModel:
    """The checkpoint at ``path`` (a root or a step directory) and its architecture: ``model``
    when given, else what is beside it (:func:`read_model_config`; ``foreign``: or what its step
    says in Megatron-Bridge's or Megatron-LM's form). ``dtype``: the parameters' dtype to build
    in; ``"saved"``: the one its weights were saved in (:func:`source_dtype`: the load is then
    exact); None: as the architecture says. A missing or corrupt checkpoint is a
    ``CheckpointError``, raised before anything is built."""
    step = resolve(path)
    root = Path(path) if step != Path(path) else step.parent
    model = model if model is not None else read_model_config(root, step if foreign else None)
    if dtype is not None:
        saved = source_dtype(step, model) if dtype == "saved" else dtype
        model = dataclasses.replace(model, params_dtype=saved)
    return SavedModel(step=step, root=root, model=model)


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in _TORCH_DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; use one of {', '.join(_TORCH_DTYPES)}")


def _write_safetensors(
    tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int
) -> list[str]:
    """Write shards of at most ``max_shard_bytes`` (plus an index when there are several)."""
    from safetensors.torch import save_file

    # A previous export's files would mix with these (transformers reads the index first).
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / _INDEX]:
        stale.unlink(missing_ok=True)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"part-{len(files):05d}.safetensors"
        save_file(shards[-1], str(out_dir / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shards[-1], name))
        shards[-1] = {}  # drop the written tensors

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (out_dir / files[0]).rename(out_dir / _SAFETENSORS)
        return [_SAFETENSORS]
    final = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    renames = dict(zip(files, final, strict=True))
    for old, new in renames.items():
        (out_dir / old).rename(out_dir / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renames[v] for k, v in sorted(weight_map.items())},
    }
    (out_dir / _INDEX).write_text(json.dumps(index, indent=2))
    return final


def convert_mcore_to_hf(
    mcore_root: str | Path,
    out_dir: str | Path,
    *,
    model: ModelConfig | None = None,
    family: str | None = None,
    dtype: Dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a Hugging Face model directory from a megatron checkpoint saved at any TP/PP/EP.

    Meant for one process (a larger world loads the full model on every rank; rank 0 writes).
    ``model`` defaults to the checkpoint's ``model_config.yaml`` and ``family`` to the source
    ``config.json``'s model_type (both written by :func:`convert_hf_to_mcore`); for a checkpoint
    Megatron-Bridge or Megatron-LM wrote, to what its ``run_config.yaml`` or saved ``args`` say
    (and the ``config.json`` of the HF model Bridge imported, when still there); tokenizer files
    come from ``tokenizer_dir`` or, by default, from beside the checkpoint. ``dtype`` defaults
    to the one the weights were saved in (:func:`source_dtype`). A missing or corrupt checkpoint
    is a ``CheckpointError``. Returns ``out_dir``.
    """
    from megatron_gndpo.models.build import build_model

    src = export_source(mcore_root, model, dtype, tokenizer_dir, foreign=True)
    saved = src.model
    if family is None:  # the source's config.json, else the model config's own family
        family = source_family(src.source, saved, mcore_root)
    # config.json names the dtype the weights are written in
    config = hf_mapping.hf_config_from_model(
        dataclasses.replace(saved, params_dtype=src.dtype), family
    )
    copy_token_ids(src.source, config)

    return export_checkpoint(
        src.step, out_dir,
        build=lambda groups: build_model(saved, ParallelConfig(), groups),
        to_hf=lambda state: hf_mapping.iter_megatron_to_hf(state, saved, consume=True),
        config=config, side_files=src.side_files, dtype=src.dtype,
        max_shard_bytes=max_shard_bytes, copy_side_files=copy_tokenizer_files,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """What an export reads before building anything (:func:`export_source`)."""

    step: Path  # the step directory loaded
    base: Path  # the checkpoint root, beside which conversion wrote its config files
    model: ModelConfig  # built in the dtype the weights were saved in
    dtype: Dtype  # the exported weights'
    source: dict[str, Any] | None  # the source model's config.json, when found
    side_files: Path  # where the tokenizer (and processor) files are copied from


def export_source(
    mcore_root: str | Path,
    model: ModelConfig | None,
    dtype: Dtype | None,
    tokenizer_dir: str | Path | None,
    *,
    foreign: bool,
) -> ExportSource:
    """The checkpoint an export loads and what it is: ``model`` defaults to the config written
    beside it, or (``foreign``: a language model's checkpoint may come from Megatron-Bridge or
    Megatron-LM) to what its step says in that tool's form; ``dtype`` to the one the weights
    were saved in (:func:`source_dtype`). A missing or corrupt checkpoint is a
    ``CheckpointError`` before anything is built."""
    check_dtype(dtype)
    # Built in the saved dtype, so the load is exact and only the export casts.
    saved = saved_model(mcore_root, model, dtype="saved", foreign=foreign)
    step, base, model = saved.step, saved.root, saved.model
    foreign_step = step if foreign else None
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    return ExportSource(
        step=step,
        base=base,
        model=model,
        dtype=dtype or model.params_dtype,
        source=source_hf_config(base, tok_dir, foreign_step),
        side_files=tok_dir if tok_dir is not None else base,
    )


def source_family(
    source: dict[str, Any] | None, model: ModelConfig, where: str | Path, whose: str = ""
) -> str:
    """The Hugging Face family of a source ``config.json`` (``model_type``), else the model
    config's own; neither is a ConversionError asking for ``--family``."""
    found = (source or {}).get("model_type") or model.family
    if found is None:
        raise ConversionError(
            f"pass --family ({whose}one of {', '.join(hf_mapping.FAMILIES)}): no source "
            f"config.json beside {where} tells it, and its model config sets no family"
        )
    return str(found)


def copy_token_ids(source: dict[str, Any] | None, config: dict[str, Any]) -> None:
    """The source config's token ids (BOS, EOS, pad) into the exported ``config``."""
    for key in _TOKEN_ID_KEYS:
        if source and source.get(key) is not None:
            config[key] = source[key]


def export_checkpoint(
    step: Path,
    out_dir: str | Path,
    *,
    build: Callable[[ParallelGroups], torch.nn.Module],
    to_hf: Callable[[dict[str, Any]], Iterable[tuple[str, torch.Tensor]]],
    config: dict[str, Any],
    side_files: Path,
    dtype: Dtype,
    max_shard_bytes: int,
    copy_side_files: Callable[[Path, Path], Any],
) -> Path:
    """Load checkpoint ``step`` into a TP=1/PP=1 model from ``build`` and write it as Hugging
    Face safetensors (names and layouts from ``to_hf`` on the state dict, which it may consume),
    ``config.json`` and the files ``copy_side_files`` copies from ``side_files``.

    Every rank loads; rank 0 writes. Starts (and ends) a one-process world when none exists.
    """
    from megatron_gndpo.parallel.world import one_process_world

    with one_process_world(reuse=True) as groups:
        net = build(groups)
        load_checkpoint(step, net)
        # named as GPTModel names them, whichever class ``build`` built (models/naming.py)
        source = naming.model_class_of(net)
        state = {
            naming.convert(k, source=source, target="gpt"): v
            for k, v in net.state_dict().items()
            if not hf_mapping.is_extra_state(k)
        }
        del net  # the state dict is now the only owner: consuming it frees memory as we write
        if rank() == 0:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            out_dtype = _TORCH_DTYPES[dtype]
            tensors = (
                # copy: outputs must not share storage (gate/up, q/k/v are views)
                (name, t.detach().to("cpu", out_dtype, copy=True).contiguous())
                for name, t in to_hf(state)
            )
            _write_safetensors(tensors, out, max_shard_bytes)
            (out / "config.json").write_text(json.dumps(config, indent=2))
            copy_side_files(side_files, out)
        barrier()
    return Path(out_dir)
