"""megatron-core's (and vLLM's) known notices, shown at most once per process instead of on
every model build (or weight sync).

megatron-core 0.19 logs a few notices each time a model or its wrapper is built (a demo builds
six models, so they came six times between the step lines), and warns at import about optional
packages a CPU machine does not have. They are expected, so a newcomer should not have to tell
them from real problems: :func:`quiet_known_notices` lets each through once and drops repeats.
Nothing else is filtered, and nothing happens on import; entry points call it explicitly.

Where megatron-core asks for something we can pass, we pass it instead of filtering (the
distributed optimizer's parameter layout: ``engine/optimizer.py``).
"""

from __future__ import annotations

import logging
import warnings

# (logger, start of the message) of notices logged on every build.
KNOWN_LOGGED = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.models.multimodal.llava_model", "LLaVA is work in progress"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel:"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # vLLM (0.32) on every in-place weight reload, i.e. every weight sync. The rotary embedding
    # has a cache but no checkpoint weight, so the reload puts its cache back and warns; the
    # post-sync check (weight_sync/check.py) is what says whether the engine's weights are right.
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load"),
    ("vllm.v1.core.block_pool", "Successfully reset prefix cache"),
)
# Start of the message of notices raised with warnings.warn (at import, or per call).
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
)


class _Once(logging.Filter):
    """Passes the first record whose message starts with ``prefix``, drops the same message
    later; other records pass."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


_INSTALLED: list[tuple[logging.Logger, _Once]] = []


def quiet_known_notices() -> None:
    """Show each known megatron-core notice at most once in this process. Idempotent."""
    if _INSTALLED:
        return
    for name, prefix in KNOWN_LOGGED:
        logger, once = logging.getLogger(name), _Once(prefix)
        logger.addFilter(once)
        _INSTALLED.append((logger, once))
    for prefix in KNOWN_WARNINGS:
        warnings.filterwarnings("once", message=prefix)


def restore() -> None:
    """Undo :func:`quiet_known_notices` (the logging part; tests)."""
    while _INSTALLED:
        logger, once = _INSTALLED.pop()
        logger.removeFilter(once)
