"""The paths a training config names, checked before anything is built.

:func:`check_paths` runs on every rank after :func:`~megatron_gndpo.checks.validate` and before
the models are built, so a typo in a path costs seconds, not a model build (or, for an
unwritable checkpoint directory, a save interval of compute). It reads the file system only; it
writes nothing but a probe file it removes at once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from megatron_gndpo.checkpoint.dist import CheckpointError, resolve
from megatron_gndpo.config import Config, ConfigError, save_dir, teacher_sections
from megatron_gndpo.fileio import is_stream, not_a_file

_BUILTIN = "builtin:"
_DATA_SUFFIXES = (".jsonl", ".parquet")


def _data_problem(key: str, spec: str | None) -> str | None:
    if spec is None or spec.startswith(_BUILTIN):
        return None  # unknown built-in names are reported by the loader, with the choices
    path = Path(spec)
    if is_stream(path):  # a pipe: `data.train=<(zcat x.jsonl.gz)`, read as JSONL
        return None
    if path.suffix not in _DATA_SUFFIXES:
        why = not_a_file(path)
        if why is not None and path.exists():
            return f"{key}: {why}; name a .jsonl or .parquet file, or builtin:NAME"
        return f"{key}={spec}: use a .jsonl or .parquet file, or builtin:NAME"
    why = not_a_file(path)
    if why is not None:
        return f"{key}: prompt file {why}"
    return None


def _tokenizer_problem(key: str, spec: str | None) -> str | None:
    if spec is None or spec.startswith(_BUILTIN) or Path(spec).exists():
        return None
    return (
        f"{key}: tokenizer {spec} does not exist (a SentencePiece .model file or a Hugging "
        "Face tokenizer directory)"
    )


def _checkpoint_problem(key: str, spec: str | None) -> str | None:
    if spec is None:
        return None
    try:
        resolve(spec)
    except CheckpointError as err:
        return f"{key}: {err}"
    return None


def _writable_problem(key: str, directory: Path) -> str | None:
    """Whether ``directory`` exists as a writable directory, or can be created."""
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{key}: {directory} cannot be created: {existing} is a file, not a directory"
    try:  # os.access says yes to root on a read-only file system: try it
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{key}: {directory} is not writable ({err.strerror} in {existing})"
    return None


def check_paths(cfg: Config) -> None:
    """Raise one :class:`ConfigError` listing every path of ``cfg`` that cannot work: prompt
    files and tokenizers that do not exist, checkpoints (teacher.load, checkpoint.init,
    checkpoint.load) that are not there, run and checkpoint directories that cannot be written.
    """
    checks = [
        _data_problem("data.train", cfg.data.train),
        _data_problem("data.eval", cfg.data.eval),
        _tokenizer_problem("data.tokenizer", cfg.data.tokenizer),
        *(_tokenizer_problem(f"{k}.tokenizer", t.tokenizer) for k, t in teacher_sections(cfg)),
        *(_checkpoint_problem(f"{k}.load", t.load) for k, t in teacher_sections(cfg)),
        _checkpoint_problem("checkpoint.init", cfg.checkpoint.init),
        _checkpoint_problem("checkpoint.load", cfg.checkpoint.load),
        _writable_problem("logging.run_dir", Path(cfg.logging.run_dir)),
        _writable_problem(
            "checkpoint.save" if cfg.checkpoint.save else "logging.run_dir (its checkpoints/)",
            save_dir(cfg),
        ),
    ]
    problems = list(dict.fromkeys(p for p in checks if p is not None))
    if problems:
        lines = "\n".join(f"  - {msg}" for msg in problems)
        raise ConfigError(f"the configuration names paths that do not work:\n{lines}")
