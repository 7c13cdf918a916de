"""Errors the project raises on purpose: each message names the problem and the fix.

Entry points (``megatron-gndpo ...``) print a :class:`UserError` once per job as
``megatron-gndpo: error: MESSAGE``, without a traceback, and exit with status 2; any other
exception is a bug and keeps its traceback. Every subclass also derives from the built-in
exception a caller would expect (``ValueError`` for bad content, ``FileNotFoundError`` for a
missing file, ...), so code that catches those keeps working.

The configuration's :class:`~megatron_gndpo.config.ConfigError` and the checkpoints'
:class:`~megatron_gndpo.checkpoint.dist.CheckpointError` are user errors too; they live with
the code that raises them.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


class DataError(UserError, ValueError):
    """A prompt file, its records or the tokenizer's input is malformed (names file and line)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the configuration names does not exist."""


class MissingPackageError(UserError, ImportError):
    """An optional package this input needs (pyarrow for Parquet, ...) is not installed."""


class ConversionError(UserError, ValueError):
    """A checkpoint or config the conversion cannot map (an unsupported feature, a layout that
    cannot hold the model, tensors that do not match the config); the message names the fix."""


class DistributedStartError(UserError, RuntimeError):
    """The launcher's environment does not describe a job this process can join."""
