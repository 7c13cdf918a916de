"""The checkpoints' errors (user errors: one line, exit 2; see megatron_gndpo/errors.py)."""

from __future__ import annotations

from megatron_gndpo.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


class CorruptCheckpointError(CheckpointError):
    """A step's files differ from the checksums saved with it, or its values are not finite."""
