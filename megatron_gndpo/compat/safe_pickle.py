"""Loading a dist-checkpoint without running code it carries.

A torch distributed checkpoint holds pickles: its ``.metadata`` file, which torch 2.14's
``FileSystemReader.read_metadata`` reads with a plain ``pickle.load``, and its non-tensor items
(megatron-core's common state, the optimizer's parameter groups), which
``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``. Both run
whatever a planted pickle asks for (``os.system``), and checksums do not help: whoever can
change a file can change the manifest beside it.

:func:`restricted_unpickling` (a context manager around our loads, ``checkpoint/dist.py``;
nothing happens on import) swaps both for restricted readers while it is open:

- ``.metadata`` through :class:`MetadataUnpickler`, which admits only the classes a
  checkpoint's metadata is made of (torch's checkpoint dataclasses and enums, ``torch.Size``,
  dtypes, layouts, memory formats, megatron-core's two empty placeholder classes);
- the non-tensor items through ``torch.load(weights_only=True)``, torch's own restricted
  unpickler, which also admits ``argparse.Namespace`` (Megatron-LM's ``args``, which we write
  too: ``checkpoint/interop.py``) and numpy arrays (Megatron-LM's RNG states).

Anything else is refused before it runs, with :class:`UnsafePickleError` naming the file and
the class. ``MEGATRON_GNDPO_TRUST_CHECKPOINTS=1`` turns the restriction off for a checkpoint
from a trusted source that needs more (docs/TROUBLESHOOTING.md). ``tests/test_checkpoint.py``
shows that the installed torch still unpickles without restriction (the patch is needed) and
that a planted pickle runs nothing under it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from megatron_gndpo.errors import UserError

TRUST_ENV = "MEGATRON_GNDPO_TRUST_CHECKPOINTS"
_CHECKPOINT_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # the checkpoint id torch's own writer records
    ("pathlib", "PurePosixPath"),
    # empty classes megatron-core keeps "to load old checkpoint weights"
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}


class UnsafePickleError(UserError, pickle.UnpicklingError):
    """A checkpoint file asks to unpickle something a safe load does not admit."""


def trusted() -> bool:
    return os.environ.get(TRUST_ENV, "").lower() in ("1", "true", "yes")


def _refusal(where: str, what: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"{where} holds a pickled {what}, which a safe load does not run (a checkpoint's pickles "
        f"can carry code). If the checkpoint comes from a source you trust, set {TRUST_ENV}=1 "
        "to load it without this restriction"
    )


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint's ``.metadata`` admitting only the classes it is made of."""

    def __init__(self, file: Any, where: str = ".metadata") -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if _admitted(module, name) else None
        if found is None:
            raise _refusal(self.where, f"{module}.{name}")
        return found


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == "torch":  # dtypes, layouts and memory formats, never functions
        value = getattr(torch, name, None)
        return isinstance(value, torch.dtype | torch.layout | torch.memory_format)
    if module in _CHECKPOINT_MODULES:
        import importlib

        value = getattr(importlib.import_module(module), name, None)
        if name == "_MEM_FORMAT_ENCODING":
            return True  # an Enum of torch's checkpoint metadata
        return isinstance(value, type) and (
            dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)
        )
    return False


def _read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``FileSystemReader.read_metadata`` of torch 2.14, with :class:`MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as f:
        metadata = MetadataUnpickler(f, where=str(path)).load()
    if not isinstance(metadata, Metadata):
        raise _refusal(str(path), f"{type(metadata).__name__} instead of checkpoint metadata")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = self.load_id
    metadata.storage_meta = storage_meta
    return metadata


def safe_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` admits besides its defaults, for checkpoint items."""
    allowed: list[Any] = [argparse.Namespace]
    with contextlib.suppress(ImportError):
        import numpy as np

        allowed += [
            np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype(np.float64)),
            np._core.multiarray._reconstruct,  # type: ignore[attr-defined]
        ]  # fmt: skip
    return allowed


def _load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` of torch 2.14, with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    try:
        with torch.serialization.safe_globals(safe_globals()):
            obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        value.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(value)
        what = ", ".join(names) if names else str(err).splitlines()[0]
        raise _refusal(f"the checkpoint item {fqn!r}", what) from None
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[fqn], obj)
    else:
        self.state_dict[fqn] = obj


def still_unrestricted() -> dict[str, bool]:
    """Whether the installed torch still unpickles each part without restriction (the reason
    for this module): its reader's source calls ``pickle.load``, its planner's
    ``weights_only=False``."""
    import inspect

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return {
        "read_metadata": "pickle.load" in inspect.getsource(FileSystemReader.read_metadata),
        "load_bytes": "weights_only=False" in inspect.getsource(DefaultLoadPlanner.load_bytes),
    }


@contextlib.contextmanager
def restricted_unpickling() -> Iterator[None]:
    """While open, checkpoint loads unpickle only what a checkpoint is made of (see the module
    docstring); a no-op with ``MEGATRON_GNDPO_TRUST_CHECKPOINTS=1``. Re-entrant."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if trusted() or FileSystemReader.read_metadata is _read_metadata:
        yield
        return
    previous = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    FileSystemReader.read_metadata = _read_metadata  # type: ignore[method-assign]
    DefaultLoadPlanner.load_bytes = _load_bytes  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = previous  # type: ignore[method-assign]
