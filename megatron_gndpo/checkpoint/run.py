"""A training run's checkpoints: resumed once at the start, saved every ``save_interval``.

    checkpoints = RunCheckpoints(cfg, save_dir, ddp, optimizer)   # the plan: before any model
    resumed = checkpoints.resume(state)      # the newest intact step; `state` restored from it
    checkpoints.save(step, state)            # atomic, keep_last of this run's steps kept

``state`` names the objects a checkpoint saves besides the weights and the optimizer (each with
``state_dict``/``load_state_dict``: the data samplers, the schedule, the tokenizer's stamp...;
``checkpoint/resume.py``). Where to start is decided from the file system alone before any model
is built (:func:`plan_start`); nothing in the save directory is touched until the resume has
succeeded, and then what the run does not continue is moved aside, never deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gndpo.checkpoint.convert import describe_checkpoints
from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
from megatron_gndpo.checkpoint.resume import (
    Resumed,
    plan_start,
    restore_run_state,
    resume_from,
    run_state,
    set_aside,
    warn,
)
from megatron_gndpo.config import Config


class RunCheckpoints:
    """The run's save directory and how it resumes and saves (module docstring)."""

    def __init__(self, cfg: Config, save_dir: Path) -> None:
        self.cfg, self.save_dir = cfg, save_dir
        self.start = plan_start(cfg.checkpoint, save_dir)  # reads the file system only
        self.run_id = ""

    def resume(
        self, ddp: Any, optimizer: Any, state: Mapping[str, Any], metrics_file: Path
    ) -> Resumed:
        """Load the newest intact checkpoint of the plan into ``ddp`` and ``optimizer`` and
        restore ``state`` from it (or start at step 0); then move aside what the run does not
        continue (``metrics_file``: its rows beyond the step are copied along)."""
        verify = self.cfg.checkpoint.verify
        resumed = resume_from(
            self.start,
            lambda d: load_checkpoint(d, ddp, optimizer=optimizer, verify=verify),
            say=_warn,
            verify=verify,
        )
        self.run_id = resumed.run_id
        if resumed.directory is not None:
            restore_run_state(state, resumed.meta["extra"], resumed.directory)
        if dist.get_rank() == 0:
            moved = set_aside(self.start, resumed, metrics_file)
            if moved is not None:
                _warn(f"moved what this run does not continue into {moved}; nothing deleted")
        return resumed

    def describe(self) -> None:
        """The architecture beside the checkpoints; written only once the run has started (a
        failed resume leaves the old one)."""
        if dist.get_rank() == 0:
            describe_checkpoints(self.save_dir, self.cfg.model, self.cfg.model.vision)

    def due(self, step: int) -> bool:
        """Whether ``checkpoint.save_interval`` saves at ``step``."""
        interval = self.cfg.checkpoint.save_interval
        return bool(interval) and step % interval == 0

    def save(
        self,
        step: int,
        ddp: Any,
        optimizer: Any,
        state: Mapping[str, Any],
        *,
        extra: Mapping[str, Any] | None = None,
        extra_files: Callable[[Path], None] | None = None,
    ) -> None:
        """Save the weights, the optimizer and ``state`` (and ``extra``, ``extra_files``) at
        ``step`` on every rank; keeps ``checkpoint.keep_last`` of this run's steps."""
        c, saved = self.cfg, run_state(state) | dict(extra or {})
        save_checkpoint(
            self.save_dir, step, ddp, optimizer=optimizer, extra=saved,
            keep_last=c.checkpoint.keep_last, run_id=self.run_id, model_config=c.model,
            tokenizer=c.data.tokenizer, extra_files=extra_files,
        )  # fmt: skip


def _warn(message: str) -> None:
    if dist.get_rank() == 0:
        warn(message)
