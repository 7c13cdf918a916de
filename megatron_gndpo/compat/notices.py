"""megatron-core's (and torch's, vLLM's) known notices, collected instead of printed.

megatron-core 0.19 logs a few notices each time a model or its wrapper is built (a demo builds
six models), warns at import about optional packages a CPU machine does not have, and torch
warns about deprecations megatron-core's calls hit: a ``train`` printed 8 such lines before its
first step and ``convert`` up to 27 before ``wrote ...``. They are expected, so a newcomer
should not have to tell them from real problems. :func:`quiet_known_notices` collects every
known notice (each text once) instead of printing it: into the run's log file when the command
has one (:func:`log_to`; ``train``: ``RUN_DIR/upstream_notices.log``), and says so in one line
on the job's rank 0, the first time one comes. ``MEGATRON_GNDPO_NOTICES=show`` prints them
instead, one line each, once. Two exceptions are printed all the same: Transformer Engine or
Apex missing on a machine with a GPU (not expected there: the image has both), and anything not
in the lists below, which is left alone. GPTModel's deprecation notice is collected too, and
replaced on screen by one line of ours, once, that names the class that runs and how to switch
(:data:`GPT_DEPRECATION`). Nothing happens on import; entry points call it.

Where megatron-core asks for something we can pass, we pass it instead of filtering (the
distributed optimizer's parameter layout: ``engine/optimizer.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

NOTICES_FILE = "upstream_notices.log"
SHOW_ENV = "MEGATRON_GNDPO_NOTICES"


def gpt_deprecation(sections: Sequence[str] = ()) -> str:
    """Our line instead of megatron-core's GPTModel notice: which models run as a GPTModel (the
    config ``sections`` with model_class=gpt, such as ``teacher.model``; unnamed when the command
    does not know) and how to switch."""
    if not sections:
        which, fix = "a model of this command", "set its model_class=hybrid"
    else:
        which = " and ".join(sections)
        fix = "set " + " and ".join(f"{s}.model_class=hybrid" for s in sections)
    return (
        f"megatron-core's GPTModel runs {which} (model_class=gpt), which megatron-core "
        f"deprecates: {fix} to run the same layers as a HybridModel (same log-probs; gpt "
        "checkpoints load into it)"
    )


# megatron-core 0.19 logs "GPTModel IS DEPRECATED ... migration guide ..." on every GPTModel
# build; our line says it instead, once: which model runs as one and how to switch.
GPT_DEPRECATION = ("GPTModel IS DEPRECATED", gpt_deprecation())
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
GPU_FALLBACK_LINE = (
    "megatron-gndpo: warning: megatron-core found no Transformer Engine or Apex on a machine with "
    "a GPU: it falls back to slower torch kernels (the image built from ./Dockerfile has both)"
)


def _launcher_rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _show() -> bool:
    return os.environ.get(SHOW_ENV, "").lower() == "show"


def _gpu_present() -> bool:
    torch = sys.modules.get("torch")  # the warnings come from code that imported it
    return bool(torch is not None and torch.cuda.is_available())


class _Collector:
    """Where the known notices go: each text once, into a file or memory, announced in one
    line on the launcher's rank 0 (the other ranks get the same notices)."""

    def __init__(self) -> None:
        self.speaks = _launcher_rank() == "0"
        self.seen: list[str] = []
        self.path: Path | None = None
        self.announced = False

    def add(self, text: str, file: TextIO | None = None) -> None:
        if text in self.seen:
            return
        self.seen.append(text)
        if not self.speaks:
            return
        if _show():
            print(text, file=file or sys.stderr, flush=True)
            return
        self._write([text])
        if not self.announced:
            self.announced = True
            where = (
                f"are collected in {self.path}"
                if self.path is not None
                else f"are not shown ({SHOW_ENV}=show prints them)"
            )
            print(
                "megatron-gndpo: known upstream notices (megatron-core's and torch's "
                f"deprecations and CPU fallbacks, expected here) {where}",
                file=file or sys.stderr, flush=True,
            )  # fmt: skip

    def log_to(self, path: Path) -> None:
        self.path = path
        self._write(self.seen)  # what came before the file was known

    def _write(self, texts: list[str]) -> None:
        if self.path is None or not texts or not self.speaks:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(f"{text}\n" for text in texts)
        except OSError:  # the log is a courtesy: never the reason a command fails
            self.path = None


class _Collect(logging.Filter):
    """Takes the records whose message starts with ``prefix`` into the collector (they are
    not printed); other records pass. With ``instead``, the first such record on the
    launcher's rank 0 passes saying that line instead."""

    def __init__(self, prefix: str, collector: _Collector, instead: str | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.collector = collector
        self.instead = instead
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        self.collector.add(f"{record.name}: {message}")
        if self.instead is None or self.said or not self.collector.speaks:
            return False
        self.said = True
        record.msg, record.args = self.instead, None
        return True


class _KnownWarnings:
    """A ``warnings.showwarning`` (the documented hook for how warnings are shown) that sends
    the known upstream warnings to the collector (the TE/Apex fallback printed in one line on
    a GPU machine, where it is not expected); every other warning goes to the hook it
    replaced."""

    def __init__(self, previous: Any, collector: _Collector) -> None:
        self.previous = previous
        self.collector = collector
        self.said_fallback = False

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
            if _gpu_present() and not self.said_fallback and self.collector.speaks:
                self.said_fallback = True
                print(GPU_FALLBACK_LINE, file=file or sys.stderr, flush=True)
            self.collector.add(FALLBACK_LINE, file)
        elif text.startswith(OTHER_WARNINGS):
            first = text.strip().split(". ")[0].rstrip(".")
            self.collector.add(f"known upstream notice: {first}", file)
        else:
            self.previous(message, category, filename, lineno, file, line)


_INSTALLED: list[tuple[logging.Logger, _Collect]] = []
_SHOWWARNING: list[Any] = []  # the hook quiet_known_notices replaced
_COLLECTOR: list[_Collector] = []


def quiet_known_notices() -> bool:
    """Collect the known upstream notices of this process instead of printing them (see the
    module docstring). Idempotent: True when this call installed it (then the caller may
    :func:`restore`)."""
    if _INSTALLED:
        return False
    collector = _Collector()
    _COLLECTOR.append(collector)
    for name, prefix in KNOWN_LOGGED:
        instead = GPT_DEPRECATION[1] if prefix == GPT_DEPRECATION[0] else None
        logger, collect = logging.getLogger(name), _Collect(prefix, collector, instead)
        logger.addFilter(collect)
        _INSTALLED.append((logger, collect))
    for prefix in KNOWN_WARNINGS:
        warnings.filterwarnings("once", message=prefix)
    _SHOWWARNING.append(warnings.showwarning)
    warnings.showwarning = _KnownWarnings(warnings.showwarning, collector)
    return True


def name_gpt_models(sections: Sequence[str]) -> None:
    """The config sections whose model runs as a GPTModel (``model``, ``teacher.model``...):
    the GPTModel line names them (with ``model.model_class=hybrid`` the teacher may still be
    one). After :func:`quiet_known_notices`."""
    for _, collect in _INSTALLED:
        if collect.prefix == GPT_DEPRECATION[0]:
            collect.instead = gpt_deprecation(sections)


def log_to(path: str | Path) -> None:
    """Write the known notices (those so far, and the later ones) into ``path`` (appended),
    and name it in the one line; after :func:`quiet_known_notices`."""
    if _COLLECTOR:
        _COLLECTOR[0].log_to(Path(path))


def collected() -> list[str]:
    """The known notices collected so far in this process (tests)."""
    return list(_COLLECTOR[0].seen) if _COLLECTOR else []


def restore() -> None:
    """Undo :func:`quiet_known_notices` (a command that installed it, at its end; tests)."""
    while _INSTALLED:
        logger, collect = _INSTALLED.pop()
        logger.removeFilter(collect)
    if _SHOWWARNING:
        warnings.showwarning = _SHOWWARNING.pop()
    _COLLECTOR.clear()
