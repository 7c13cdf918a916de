"""A teacher that follows the student: an exponential moving average of its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class EMAWeights:
    """A teacher that follows the student (``teacher.weights=ema``): after every optimizer step,
    ``teacher = decay * teacher + (1 - decay) * student``, shard by shard (the two models have
    one layout, so each rank averages its own shards; no collective).

    Its weights are part of the run's state: :meth:`save` writes this rank's shards into a
    checkpoint's step directory and :meth:`load` reads them back, so a resumed run continues with
    the teacher it had.
    """

    FILE = "teacher_ema{index}_rank{rank}.pt"  # the EMA teacher's index, the rank

    def __init__(self, teacher: Any, student: Any, decay: float) -> None:
        self.pairs = list(zip(teacher.parameters(), student.parameters(), strict=True))
        self.decay = decay

    @torch.no_grad()
    def update(self) -> None:
        for t, s in self.pairs:
            t.mul_(self.decay).add_(s.detach().to(t.dtype), alpha=1.0 - self.decay)

    def save(self, directory: Path, index: int = 0) -> None:
        tensors = [t.detach().cpu() for t, _ in self.pairs]
        torch.save(tensors, directory / self.FILE.format(index=index, rank=dist.get_rank()))

    def load(self, directory: Path, index: int = 0) -> bool:
        """This rank's shards from ``directory``; False (nothing changed) when it has none."""
        path = directory / self.FILE.format(index=index, rank=dist.get_rank())
        if not path.is_file():
            return False
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for (t, _), saved in zip(self.pairs, tensors, strict=True):
                t.copy_(saved.to(t.device, t.dtype))
        return True
