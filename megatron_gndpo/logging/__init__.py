"""Metrics of a run: stage timers, throughput and MFU, sinks (JSONL, console, W&B, TensorBoard)
and progress bars.

The package is named ``logging`` inside ``megatron_gndpo``; with absolute imports (Python 3)
``import logging`` anywhere still means the standard library, and the modules here import it as
``std_logging`` to keep the two apart for a reader.
"""

from megatron_gndpo.logging.progress import progress
from megatron_gndpo.logging.sinks import (
    CONSOLE_KEYS,
    METRICS_FILE,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    Sink,
    TensorBoardSink,
    WandbSink,
    build_logger,
    format_console_line,
    require_tensorboard,
    to_scalars,
    wandb_mode,
)
from megatron_gndpo.logging.throughput import (
    PEAK_BF16_FLOPS,
    attention_seq_len,
    gpt_flops_per_token,
    mfu,
    model_flops_per_token,
    peak_flops_for,
)
from megatron_gndpo.logging.timers import TIME_PREFIX, StageTimer

__all__ = [
    "CONSOLE_KEYS",
    "METRICS_FILE",
    "PEAK_BF16_FLOPS",
    "TENSORBOARD_DIR",
    "TIME_PREFIX",
    "WANDB_ID_FILE",
    "ConsoleSink",
    "JsonlSink",
    "MetricsLogger",
    "Sink",
    "StageTimer",
    "TensorBoardSink",
    "WandbSink",
    "attention_seq_len",
    "build_logger",
    "format_console_line",
    "gpt_flops_per_token",
    "mfu",
    "model_flops_per_token",
    "peak_flops_for",
    "progress",
    "require_tensorboard",
    "to_scalars",
    "wandb_mode",
]
