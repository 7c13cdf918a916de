"""megatron-core's (and vLLM's) known notices, shown at most once per process instead of on
every model build (or weight sync).

megatron-core 0.19 logs a few notices each time a model or its wrapper is built (a demo builds
six models, so they came six times between the step lines), and warns at import about optional
packages a CPU machine does not have (nine ``warnings.warn`` calls, two lines each, on every
rank). They are expected, so a newcomer should not have to tell them from real problems:
:func:`quiet_known_notices` lets each logged notice through once and drops repeats, and shows
the known warnings once for the job (rank 0), one line each, the fallbacks for a missing
Transformer Engine or Apex as one line in all. GPTModel's deprecation notice is replaced by one
line of ours that names the class that runs and how to switch (:data:`GPT_DEPRECATION`).
Nothing else is filtered, and nothing happens on import; entry points call it explicitly.

Where megatron-core asks for something we can pass, we pass it instead of filtering (the
distributed optimizer's parameter layout: ``engine/optimizer.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, TextIO

# megatron-core 0.19 logs "GPTModel IS DEPRECATED ... migration guide ..." on every GPTModel
# build; this line says it instead, once: which class runs and how to switch.
GPT_DEPRECATION = (
    "GPTModel IS DEPRECATED",
    "megatron-core's GPTModel runs this model (model.model_class=gpt), which megatron-core "
    "deprecates: set model.model_class=hybrid to run the same layers as a HybridModel "
    "(same log-probs; gpt checkpoints load into it)",
)
# (logger, start of the message) of notices logged on every build.
KNOWN_LOGGED = (
    ("megatron.core.models.gpt.gpt_model", GPT_DEPRECATION[0]),
    ("megatron.core.models.multimodal.llava_model", "LLaVA is work in progress"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel:"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # vLLM (0.32) on every in-place weight reload, i.e. every weight sync. The rotary embedding
    # has a cache but no checkpoint weight, so the reload puts its cache back and warns; the
    # post-sync check (weight_sync/check.py) is what says whether the engine's weights are right.
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load"),
    ("vllm.v1.core.block_pool", "Successfully reset prefix cache"),
    # torch, at import on a machine without CUDA (every rank)
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)
# Start of the message of notices raised with warnings.warn (at import, or per call): the
# fallbacks megatron-core takes without Transformer Engine or Apex (shown as one line), then the
# others (one line each).
FALLBACK_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
)
OTHER_WARNINGS = (
    "absl.logging is not installed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
    # torch 2.14 on megatron-core 0.19's calls: its optimizer's zero_grad reads .grad of every
    # parameter, and its gradient buffers use the collectives torch has renamed
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    # torch 2.14's distributed checkpoint on megatron-core 0.19's one-process load
    # (``checkpoint.load(state, reader, no_dist=True)``, torch's ShardedTensor inside)
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
    "The argument order of load has been changed",
    "Please use DTensor instead and we are deprecating ShardedTensor",
)
KNOWN_WARNINGS = FALLBACK_WARNINGS + OTHER_WARNINGS
FALLBACK_LINE = (
    "known upstream notice: megatron-core: Transformer Engine and/or Apex are not installed, so "
    "it uses torch's optimizers, norms and multi-tensor ops (expected on a CPU; the GPU image "
    "has both)"
)


def _launcher_rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


class _Once(logging.Filter):
    """Passes the first record whose message starts with ``prefix`` on the launcher's rank 0,
    drops the same message later and on the other ranks (they log the same); other records
    pass. With ``instead``, the record that passes says that line instead."""

    def __init__(self, prefix: str, instead: str | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.instead = instead
        self.seen: set[str] = set()
        self.speaks = _launcher_rank() == "0"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if not self.speaks or message in self.seen:
            return False
        self.seen.add(message)
        if self.instead is not None:
            record.msg, record.args = self.instead, None
        return True


class _KnownWarnings:
    """A ``warnings.showwarning`` (the documented hook for how warnings are shown) that prints
    the known upstream warnings in one line each, on the launcher's rank 0 only, the fallback
    family once in all; every other warning goes to the hook it replaced."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.said: set[str] = set()
        self.speaks = _launcher_rank() == "0"  # the same warnings come on every rank

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if text.startswith(FALLBACK_WARNINGS):
            self._say("fallback", FALLBACK_LINE, file)
        elif text.startswith(OTHER_WARNINGS):
            first = text.strip().split(". ")[0].rstrip(".")
            self._say(text, f"known upstream notice: {first}", file)
        else:
            self.previous(message, category, filename, lineno, file, line)

    def _say(self, key: str, line: str, file: TextIO | None) -> None:
        if self.speaks and key not in self.said:
            self.said.add(key)
            print(line, file=file or sys.stderr)


_INSTALLED: list[tuple[logging.Logger, _Once]] = []
_SHOWWARNING: list[Any] = []  # the hook quiet_known_notices replaced


def quiet_known_notices() -> None:
    """Show each known megatron-core notice at most once in this process. Idempotent."""
    if _INSTALLED:
        return
    for name, prefix in KNOWN_LOGGED:
        instead = GPT_DEPRECATION[1] if prefix == GPT_DEPRECATION[0] else None
        logger, once = logging.getLogger(name), _Once(prefix, instead)
        logger.addFilter(once)
        _INSTALLED.append((logger, once))
    for prefix in KNOWN_WARNINGS:
        warnings.filterwarnings("once", message=prefix)
    _SHOWWARNING.append(warnings.showwarning)
    warnings.showwarning = _KnownWarnings(warnings.showwarning)


def restore() -> None:
    """Undo :func:`quiet_known_notices` (tests)."""
    while _INSTALLED:
        logger, once = _INSTALLED.pop()
        logger.removeFilter(once)
    if _SHOWWARNING:
        warnings.showwarning = _SHOWWARNING.pop()
