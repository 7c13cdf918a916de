"""Per-step metrics fanned out to a JSONL file, the console, Weights & Biases and TensorBoard.

One process logs: the trainer builds the logger on every rank with ``enabled`` true on exactly
one (rank 0 of the group whose metrics are already reduced) and calls ``log`` everywhere; the
other ranks do nothing, not even convert their values. Files in the run directory:

    metrics.jsonl       one JSON object per step, the record a run is judged by
    wandb_id.txt        the W&B run id, reused when the run resumes
    wandb/              W&B's own files (offline runs sync later with ``wandb sync``)
    tensorboard/        event files, with logging.tensorboard=true

On resume from a checkpoint at step N, call ``MetricsLogger.truncate_after(N)`` before the next
``log``, so steps N+1.. logged before the restart are not recorded twice.
"""

from __future__ import annotations

import json
import logging as std_logging
import math
import os
import secrets
import string
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO, cast

from megatron_gndpo.fileio import write_atomic

if TYPE_CHECKING:
    # Only a type here: importing megatron_gndpo.config pulls in torch, and this package stays
    # cheap to import.
    from megatron_gndpo.config.schema import LoggingConfig

logger = std_logging.getLogger(__name__)

Scalar = float | int | bool

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
TENSORBOARD_DIR = "tensorboard"

# The numbers worth a glance on the console, in the order printed (when present). grad_norm is
# the pre-clip norm, score/rms beside it the scale it answers to; the clip-active share and the
# spike count so far say whether those norms reach the update and how often they jump
# (algorithms/metrics.py). The rest of a step's metrics go to the JSONL file and the dashboards.
CONSOLE_KEYS = (
    "loss",
    "grad_norm",
    "score/rms",
    "grad_norm/clip_active_frac",
    "grad_norm/spikes",
    "score/mean",
    "score/std",
    "advantage/std",
    "clip/frac",
    "response_length/mean",
    "tokens/s",
    "mfu",
    "time/step",
)


class Sink(Protocol):
    """Where one step's metrics go. ``metrics`` holds plain Python numbers."""

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Sends each step's metrics to its sinks, on the one process that logs."""

    def __init__(self, sinks: Sequence[Sink], *, enabled: bool) -> None:
        """enabled: false on every process but the one that logs; then nothing is written."""
        self.enabled = enabled
        self.sinks: list[Sink] = list(sinks) if enabled else []
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (numbers, or 0-d tensors) for ``step``."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close()")
        if not self.enabled:
            return
        scalars = to_scalars(metrics)
        for sink in self.sinks:
            sink.log(step, scalars)

    def truncate_after(self, step: int) -> None:
        """Forget steps after ``step`` where a sink can (the JSONL file): call on resume."""
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.truncate_after(step)

    def close(self) -> None:
        """Flush and close every sink; logging after this is an error."""
        sinks, self.sinks = self.sinks, []
        self._closed = True
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, Scalar]:
    """Plain numbers from numbers, numpy scalars or one-element tensors; TypeError otherwise."""
    scalars: dict[str, Scalar] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r}")
        if isinstance(value, bool | int | float):
            scalars[key] = value
            continue
        try:
            scalars[key] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"metric {key!r} is a {type(value).__name__}, not a number; log a float"
            ) from exc
    return scalars


# ---------------------------------------------------------------- JSONL


def _json_value(value: Scalar) -> Scalar | str:
    """JSON has no NaN or infinity: write those as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlSink:
    """Appends ``{"step": step, **metrics}`` as one line per call, flushed at once.

    The file opens on the first ``log``, so a sink that never logs creates nothing. An existing
    file is appended to; a last line cut short by a crash is dropped first.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None
        self._last_step: int | None = None
        self._warned_repeat = False

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        if "step" in metrics:
            raise ValueError("'step' is a reserved key of metrics.jsonl; rename the metric")
        file = self._open()
        if self._last_step is not None and step <= self._last_step and not self._warned_repeat:
            self._warned_repeat = True
            logger.warning(
                "%s already holds step %d and step %d is logged now; on resume call "
                "MetricsLogger.truncate_after(<checkpoint step>) first",
                self.path,
                self._last_step,
                step,
            )
        record = {"step": step, **{key: _json_value(value) for key, value in metrics.items()}}
        file.write(json.dumps(record, allow_nan=False) + "\n")
        file.flush()
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def truncate_after(self, step: int) -> None:
        """Remove the records with step > ``step`` (and unreadable lines); atomic rewrite."""
        self.close()
        if not self.path.exists():
            return
        kept: list[str] = []
        dropped_unreadable = 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            record_step = _record_step(line)
            if record_step is None:
                dropped_unreadable += int(bool(line.strip()))
            elif record_step <= step:
                kept.append(line + "\n")
        if dropped_unreadable:
            logger.warning("dropped %d unreadable lines from %s", dropped_unreadable, self.path)
        write_atomic(self.path, "".join(kept).encode("utf-8"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> TextIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._last_step = _drop_partial_last_line(self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        return self._file


def _record_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _drop_partial_last_line(path: Path) -> int | None:
    """Cut an unterminated last line (a crash mid-write); return the largest step in the file."""
    if not path.exists():
        return None
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning("dropping an incomplete last line from %s", path)
        with open(path, "r+b") as file:
            file.truncate(keep)
        data = data[:keep]
    steps = [_record_step(line) for line in data.decode("utf-8").splitlines()]
    return max((s for s in steps if s is not None), default=None)


# ---------------------------------------------------------------- console


def format_console_line(
    step: int, metrics: Mapping[str, Scalar], keys: Sequence[str] = CONSOLE_KEYS
) -> str:
    """``step 12 | loss 0.1234 | grad_norm 1.5 | ... | mfu 41.2% | time/step 3.21s``."""
    parts = [f"step {step}"]
    parts += [f"{key} {_format_value(key, metrics[key])}" for key in keys if key in metrics]
    return " | ".join(parts)


def _format_value(key: str, value: Scalar) -> str:
    if isinstance(value, bool | int):
        return str(value)
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key.startswith("time/"):
        return f"{value:.2f}s"
    if key == "tokens/s" and math.isfinite(value):
        return f"{value:.0f}"
    return f"{value:.4g}"


class ConsoleSink:
    """Prints the key numbers (``CONSOLE_KEYS``, in that order) every ``every`` steps."""

    def __init__(
        self, every: int = 1, keys: Sequence[str] = CONSOLE_KEYS, stream: TextIO | None = None
    ) -> None:
        """stream: where to print; None means the current ``sys.stdout``."""
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.keys = tuple(keys)
        self._stream = stream

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        if step % self.every == 0:
            line = format_console_line(step, metrics, self.keys)
            print(line, file=self._stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- Weights & Biases


WandbMode = Literal["online", "offline", "disabled", "shared"]


def wandb_mode() -> WandbMode | None:
    """The W&B mode: the user's WANDB_MODE when set, else online with a WANDB_API_KEY in the
    environment and offline without one.

    Passed to ``wandb.init`` explicitly because W&B reads its environment once per process.
    None (W&B decides) for a WANDB_MODE this code does not know, such as the old "dryrun".
    Offline runs write under run_dir/wandb and upload later with ``wandb sync``; a user logged
    in through ``wandb login`` (key in ~/.netrc) sets WANDB_MODE=online to log live.
    """
    user_mode = os.environ.get("WANDB_MODE")
    if user_mode:
        if user_mode in ("online", "offline", "disabled", "shared"):
            return cast(WandbMode, user_mode)
        return None
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _wandb_run_id(run_dir: Path) -> str:
    """The id in run_dir/wandb_id.txt, written first if absent, so a resumed run continues."""
    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text(encoding="utf-8").strip()
        if run_id:
            return run_id
    alphabet = string.ascii_lowercase + string.digits
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n", encoding="utf-8")
    return run_id


class WandbSink:
    """A W&B run in ``run_dir``, resumed by id. W&B trouble warns and never stops training.

    W&B talks to a server and a helper process, and fails in many ways (no network, a bad key,
    a full disk, a changed API); every failure is logged as a warning and the sink goes quiet,
    because a lost dashboard must not cost a training run. The JSONL file is the record.
    """

    def __init__(
        self,
        project: str,
        run_name: str | None,
        run_dir: str | os.PathLike[str],
        config: Mapping[str, Any],
    ) -> None:
        self._run: Any = None
        run_dir = Path(run_dir)
        try:
            import wandb

            run_id = _wandb_run_id(run_dir)
            self._run = wandb.init(
                project=project,
                name=run_name,
                dir=str(run_dir),
                config=dict(config),
                id=run_id,
                resume="allow",
                mode=wandb_mode(),
            )
        except Exception as exc:  # any failure: see the class docstring
            logger.warning("W&B is off for this run: wandb.init failed: %r", exc)
            self._run = None

    @property
    def active(self) -> bool:
        """Whether metrics are reaching W&B."""
        return self._run is not None

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        if self._run is None:
            return
        try:
            self._run.log(dict(metrics), step=step)
        except Exception as exc:  # see the class docstring
            logger.warning("W&B is off from step %d: run.log failed: %r", step, exc)
            self._finish()

    def close(self) -> None:
        self._finish()

    def _finish(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish()
        except Exception as exc:  # see the class docstring
            logger.warning("wandb finish failed: %r", exc)


# ---------------------------------------------------------------- TensorBoard


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError that says what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "logging.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or set logging.tensorboard=false)"
        ) from exc
    return SummaryWriter


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``log_dir``, flushed every step."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        summary_writer = require_tensorboard()
        self._writer: Any = summary_writer(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# ---------------------------------------------------------------- wiring


def build_logger(
    cfg: LoggingConfig, *, enabled: bool, config_dict: Mapping[str, Any]
) -> MetricsLogger:
    """Console (every ``cfg.log_interval`` steps) and run_dir/metrics.jsonl (every step) always;
    W&B when ``cfg.wandb_project`` is set; TensorBoard in run_dir/tensorboard when asked.

    Call on every rank. The TensorBoard check runs on every rank, so a missing package stops
    all ranks alike instead of leaving the others waiting at a collective.
    config_dict: the resolved config, shown by W&B with the run.
    """
    if cfg.tensorboard:
        require_tensorboard()
    if not enabled:
        return MetricsLogger([], enabled=False)
    run_dir = Path(cfg.run_dir)
    sinks: list[Sink] = [ConsoleSink(cfg.log_interval), JsonlSink(run_dir / METRICS_FILE)]
    if cfg.wandb_project is not None:
        sinks.append(WandbSink(cfg.wandb_project, cfg.wandb_run_name, run_dir, config_dict))
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    return MetricsLogger(sinks, enabled=True)
