"""The trainer's schedule of rollouts sampled on rollout ranks apart (``rollout.disaggregate``).

:class:`RolloutPipeline` decides which batch is asked for when, and so with which weights: the
trainer publishes ``W_k`` after step ``k`` and then asks for batch ``k + 1 + staleness``, which
the rollout ranks sample with ``W_k`` (their commands run in order, :mod:`.remote`). At the start
the batches up to ``staleness`` steps ahead are asked for with the weights the run starts from;
a checkpoint carries the batches sampled ahead, with the prompts each was drawn from, and a
resumed run takes them instead of asking again. Staleness 0 is the synchronous schedule: each
batch is asked for right after the weights it is sampled with.

The trainer keeps what it shares with the colocated path (drawing a batch's prompts, their seeds
and a batch's sampling parameters) and hands it in as functions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_gndpo.data.prompt_sets import Drawn
from megatron_gndpo.rollout.base import Rollout, SamplingParams
from megatron_gndpo.rollout.remote import RemoteRollouts, Result, save_inflight


class RolloutPipeline:
    """The trainer's side of the one-step-off (k-step-off) pipeline; every trainer rank holds
    one and calls every method in the same order (they run collectives over the trainer)."""

    def __init__(
        self,
        remote: RemoteRollouts,
        *,
        staleness: int,
        steps: int,
        draw: Callable[[int], Drawn],
        resolve: Callable[[Drawn], list[Any]],
        seeds: Callable[[list[Any], int], list[int]],
        sampling: Callable[[int], SamplingParams],
    ) -> None:
        self.remote, self.staleness, self.steps = remote, staleness, steps
        self._draw, self._resolve, self._seeds, self._sampling = draw, resolve, seeds, sampling
        self.asked: dict[int, Drawn] = {}  # batch -> the prompts it was drawn from

    def start(self, step: int, inflight: dict[int, tuple[Result, Drawn]]) -> None:
        """Publish the weights the run starts from (after ``step``) and ask for the first
        batches: those up to ``staleness`` steps ahead, except the ones a resumed checkpoint
        brought along (``inflight``: by batch, its result and drawn prompts)."""
        self.remote.publish(step)
        if inflight:
            self.remote.restore({b: result for b, (result, _) in inflight.items()})
            self.asked |= {b: drawn for b, (_, drawn) in inflight.items()}
        last = min(step + 1 + self.staleness, self.steps)
        for batch in range(step + 1, last + 1):
            if batch not in self.asked:
                self._ask(batch)

    def take(self, batch: int) -> tuple[list[Any], Rollout, dict[str, float]]:
        """``batch``'s prompts, its rollout from the rollout ranks and the pipeline's metrics."""
        result, metrics = self.remote.take(batch)
        return self._resolve(self.asked.pop(batch)), result.rollout, metrics

    def advance(self, version: int) -> dict[str, float]:
        """After step ``version``: its weights to the rollout ranks and the next batch asked
        for (sampled with them), while there are steps left to use them."""
        batch = version + 1 + self.staleness
        if batch > self.steps:
            return {}
        metrics = self.remote.publish(version)
        self._ask(batch)
        return metrics

    def checkpoint(self, replicas: int) -> tuple[dict[str, Any], Callable[[Path], None]]:
        """Receive the batches sampled ahead (before a checkpoint): what the checkpoint's run
        state records of them, and the writer of their files into its step directory."""
        remote = self.remote
        batches = remote.drain()
        state = {"batches": batches, "replicas": replicas, "staleness": self.staleness}
        asked = {b: self.asked[b] for b in batches}

        def write(directory: Path) -> None:
            save_inflight(directory, remote, asked)

        return state, write

    def stop(self) -> None:
        """End the rollout ranks' loop."""
        self.remote.stop()

    def _ask(self, batch: int) -> None:
        """Draw ``batch``'s prompts now and ask the rollout ranks for their samples."""
        drawn = self._draw(batch)
        prompts = self._resolve(drawn)
        self.asked[batch] = drawn
        ids = [list(p.ids) for p in prompts]
        self.remote.request(batch, ids, self._seeds(prompts, batch), self._sampling(batch))
