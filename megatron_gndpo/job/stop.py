"""A run asked to stop: SIGTERM or SIGUSR1 (Slurm's warning before preemption or the time
limit) or a first Ctrl-C end the training loop after the current step, on every rank at once,
with a checkpoint the same command (or the requeued job) resumes from."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist


class StopRequest:
    """SIGTERM/SIGUSR1 and a first Ctrl-C (SIGINT) set a flag; every rank stops at the same step
    (one all-reduce), with a checkpoint. A second Ctrl-C stops at once (KeyboardInterrupt)."""

    _SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False  # by Ctrl-C
        self.previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
                print(
                    "megatron-gndpo: Ctrl-C: stopping after this step, with a checkpoint "
                    "(Ctrl-C again stops at once)", file=sys.stderr, flush=True,
                )  # fmt: skip
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
