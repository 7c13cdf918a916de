"""Where a run writes: paths derived from the config (checked by ``checks/paths.py``)."""

from __future__ import annotations

from pathlib import Path

from megatron_gndpo.config.schema import Config


def save_dir(cfg: Config) -> Path:
    """Where the run's checkpoints go: checkpoint.save, or RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.save or Path(cfg.logging.run_dir) / "checkpoints")
