"""Checkpoints through megatron-core dist-checkpointing: atomic, resharding on load.

Layout of a checkpoint root::

    ROOT/
      iter_0000100/              one step, written by every rank together
        <dist-checkpointing files>
        megatron_gndpo.json      step, layout it was saved at, extra state (data position, ...)
      latest                     text: the newest complete step ("100")

A step is written into ``iter_XXXXXXX.tmp`` and renamed by rank 0 only after every rank has
finished, then ``latest`` is replaced atomically: a run killed mid-save leaves the previous
checkpoint as ``latest``, and the half-written ``.tmp`` directory is ignored (and removed by the
next save). Loading works at any TP/PP: dist-checkpointing reshards the saved tensors onto the
model it is given. Only the model is needed to load a teacher; the student also saves its
optimizer state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_LATEST = "latest"
_META = "megatron_gndpo.json"
# Optimizer sharding that reloads at another data-parallel size; "fully_reshardable" failed to
# load in megatron-core 0.19 (KeyError: 'step').
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | Path) -> int | None:
    """The newest complete step under ``root``, or None when there is none."""
    marker = Path(root) / _LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{marker} is corrupt (holds {text!r}, expected a step number); delete it to start "
            "fresh or write the step of a complete iter_* directory into it"
        )
    step = int(text)
    if not (step_dir(root, step) / _META).is_file():
        raise CheckpointError(
            f"{marker} names step {step} but {step_dir(root, step)} is incomplete or missing; "
            "restore it or point latest at an older complete step"
        )
    return step


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _model_state(model: Any) -> dict[str, Any]:
    # DDP's sharded_state_dict keys carry a "module." prefix that load rejects: use the inner model.
    inner = getattr(model, "module", model)
    # Replica ids come from megatron's global data-parallel group unless the model's own is
    # given: the teacher's layout (another DP size) needs its own.
    pgs = getattr(inner, "pg_collection", None)
    if pgs is not None and hasattr(pgs, "dp_cp"):
        return inner.sharded_state_dict(metadata={"dp_cp_group": pgs.dp_cp})
    return inner.sharded_state_dict()


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Any,
    *,
    optimizer: Any = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) at ``step`` under ``root`` on every rank; atomic.

    ``extra`` (JSON-serialisable: data position, RNG seeds, metrics) is stored beside the tensors.
    Returns the final step directory.
    """
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    sharded = {"model": _model_state(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(
            sharded["model"], metadata=_OPTIMIZER_METADATA
        )
    dist_checkpointing.save(sharded, str(tmp))
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "has_optimizer": optimizer is not None, "extra": extra or {}}
        (tmp / _META).write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _write_latest(Path(root), step)
        if keep_last:
            _prune(Path(root), keep_last)
    _barrier()
    return final


def _write_latest(root: Path, step: int) -> None:
    tmp = root / (_LATEST + ".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root / _LATEST)


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(
        int(p.name.removeprefix("iter_"))
        for p in root.glob("iter_*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / _META).is_file()
    )
    for old in steps[:-keep_last]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    for stale in root.glob("iter_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _init_empty_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer the state tensors a checkpoint load fills in place.

    With torch's Adam (no Transformer Engine or apex: CPU, or GPUs without TE) megatron-core
    0.19's distributed optimizer reads a ``step`` from every parameter state when it describes
    its checkpoint layout, and its own ``init_state_fn`` creates the moments but no ``step``.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        init_state_fn = getattr(chained, "init_state_fn", None)
        if inner is None or init_state_fn is None:
            continue
        init_state_fn(inner, getattr(chained, "config", None))
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for state in inner.state.values():
                state.setdefault("step", torch.tensor(0.0))


def _restore_torch_adam_step(optimizer: Any, loaded: Any) -> None:
    """Put the saved step back into torch Adam's per-parameter state after a load.

    megatron-core 0.19 restores the step from the saved param groups and then, in the
    dp_reshardable path, copies every tensor of the template's parameter state over it, ``step``
    included, which resets it to the freshly initialised optimizer's value. Only torch's Adam
    (no TE/apex) keeps ``step`` per parameter.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for index, opt in enumerate(chained):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        saved = loaded if len(chained) == 1 else loaded[index]
        steps = {g["step"] for g in saved["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for param_state in inner.state.values():
            param_state["step"] = torch.tensor(step)


def resolve(path: str | Path) -> Path:
    """A checkpoint root (use its latest step) or a step directory -> the step directory."""
    path = Path(path)
    if (path / _META).is_file():
        return path
    step = latest_step(path)
    if step is None:
        raise CheckpointError(
            f"no checkpoint at {path}: expected a directory with a '{_LATEST}' file or an "
            f"iter_* step directory containing {_META}"
        )
    return step_dir(path, step)


def load_checkpoint(path: str | Path, model: Any, *, optimizer: Any = None) -> dict[str, Any]:
    """Load ``model`` (and ``optimizer``) from a root or step directory, at any TP/PP.

    Returns the stored metadata (``step``, ``extra``). Missing or mismatched tensors are a
    :class:`CheckpointError` naming the checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = resolve(path)
    meta = json.loads((directory / _META).read_text())
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(
            f"{directory} holds no optimizer state (a model-only checkpoint, e.g. converted from "
            "Hugging Face); load it as initial weights, not as a resume point"
        )
    sharded = {"model": _model_state(model)}
    if optimizer is not None:
        _init_empty_optimizer_state(optimizer)
        sharded["optimizer"] = optimizer.sharded_state_dict(
            sharded["model"], is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    try:
        with torch.no_grad():
            state = dist_checkpointing.load(
                sharded,
                str(directory),
                # The access check is about writers: megatron derives replica ids from its
                # global parallel state, which is the student's, so a model on another layout
                # (the teacher's) fails it although every rank reads exactly what it needs.
                validate_access_integrity=False,
                # A tensor the model needs but the checkpoint lacks is an error up front.
                strict=StrictHandling.RAISE_UNEXPECTED,
            )
    except Exception as err:
        raise CheckpointError(
            f"could not load {directory}: {err}. Check that the checkpoint was written for this "
            "architecture (layers, hidden size, heads, vocabulary)"
        ) from err
    inner = getattr(model, "module", model)
    # no_grad: with fp32 parameters the distributed optimizer copies its dp_reshardable state
    # into views of the (grad-requiring) parameters.
    with torch.no_grad():
        inner.load_state_dict(state["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
            _restore_torch_adam_step(optimizer, state["optimizer"])
    return meta
