"""A step's integrity: its description (``megatron_gndpo.json``), the size and SHA-256 of
every other file of it (written at save, checked before any load, the ranks sharing the reading),
and the finiteness of the weights and optimizer state (refused at save, checked after load)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.checkpoint.errors import CorruptCheckpointError
from megatron_gndpo.parallel.distributed import rank, world_size

META = "megatron_gndpo.json"
_META = META
_READ_CHUNK = 8 << 20  # bytes hashed at a time (hashlib releases the GIL for large updates)


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The ``megatron_gndpo.json`` of a step directory."""
    path = Path(directory) / _META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{path} is unreadable ({err})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise CorruptCheckpointError(f"{path} is not a checkpoint description (no step)")
    return meta


def run_of(directory: str | Path) -> str | None:
    """The id of the run that saved a step (None: saved before run ids, or unreadable)."""
    try:
        run_id = read_meta(directory).get("run_id")
    except CorruptCheckpointError:
        return None
    return run_id if isinstance(run_id, str) else None


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (CPU objects)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank: one decision that every rank acts on."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _files(directory: Path) -> list[str]:
    """Every file of a step directory (relative paths), its metadata file aside."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != _META
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "sha256"}}`` of a step, the files shared out over the ranks."""
    names = _from_rank0(_files(directory) if rank() == 0 else None)
    mine = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
        for name in names[rank() :: world_size()]
    }
    return {name: entry for part in _gather(mine) for name, entry in part.items()}


def _file_problem(directory: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{name} has {size} bytes, {entry['bytes']} were saved"
    if _sha256(path) != entry["sha256"]:
        return f"{name} does not match the checksum saved with it (its contents changed)"
    return None


def verify_step(directory: str | Path) -> bool:
    """Check every file of a step against its saved checksum; the ranks share the reading.

    Raises :class:`CorruptCheckpointError` naming each bad file. Returns False for a step saved
    before checksums were written (nothing to check against), True when all files match.
    """
    directory = Path(directory)
    files = read_meta(directory).get("files")
    if files is None:
        return False
    names = sorted(files)
    mine = [_file_problem(directory, n, files[n]) for n in names[rank() :: world_size()]]
    problems = [p for part in _gather(mine) for p in part if p is not None]
    if problems:
        raise CorruptCheckpointError(f"{directory} is corrupt: {'; '.join(problems)}")
    return True


def _optimizer_tensors(optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's own tensors on this rank: fp32 master weights and its state (moments)."""
    out = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            out += [("master weights", p) for p in group["params"]]
        for state in inner.state.values():
            out += [(key, v) for key, v in state.items() if isinstance(v, torch.Tensor)]
    return out


def nonfinite(model: Any, optimizer: Any = None) -> list[str]:
    """Names of the tensors holding a NaN or an infinity, over every rank (collective)."""
    inner = getattr(model, "module", model)
    bad = [
        name
        for name, p in inner.named_parameters()
        if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())
    ]
    if optimizer is not None:
        tensors = _optimizer_tensors(optimizer)
        bad += sorted(
            {
                f"optimizer {key}"
                for key, t in tensors
                if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
            }
        )
    return sorted({name for part in _gather(bad) for name in part})


def _shown(names: Sequence[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
