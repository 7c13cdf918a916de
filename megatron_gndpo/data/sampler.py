"""Which prompts each data-parallel rank takes at each step: deterministic and resumable.

The prompts form one endless stream: epoch ``e`` is a permutation of ``range(num_examples)``
drawn from ``random.Random(seed + e)`` (or the identity without shuffling), and the epochs follow
each other. A step takes the next ``prompts_per_step`` indices of the stream (the *global batch*),
crossing into the next epoch when the current one runs out, so every prompt is drawn once per
epoch and none is starved by a batch size that does not divide the data set. Data-parallel rank
``r`` of ``dp_size`` takes the contiguous slice ``[r * k, (r + 1) * k)``, ``k = prompts_per_step
/ dp_size``.

The stream depends only on ``(num_examples, seed, shuffle)``: every DP size sees the same global
batches, and the state (``epoch``, ``position`` in that epoch) can be restored under a different
DP size or batch size.
"""

from __future__ import annotations

import random
from typing import Any

from megatron_gndpo.errors import DataError


class PromptSampler:
    """Yields, step after step, the prompt indices of this data-parallel rank."""

    def __init__(
        self,
        num_examples: int,
        *,
        prompts_per_step: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        fingerprint: str | None = None,
        source: str = "the prompt file",
    ) -> None:
        """``fingerprint``: of the prompts' content (:func:`~megatron_gndpo.data.datasets.
        prompt_fingerprint`), saved with the state and checked on load, so a file rewritten
        with as many records is refused; ``source`` names the prompts in that message."""
        if num_examples < 1:
            raise ValueError(
                f"PromptSampler needs at least one prompt, got num_examples={num_examples}"
            )
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if prompts_per_step % dp_size:
            raise DataError(
                f"rollout.prompts_per_step={prompts_per_step} is not divisible by the "
                f"data-parallel size {dp_size}; make prompts_per_step a multiple of {dp_size}"
            )
        self.num_examples = num_examples
        self.prompts_per_step = prompts_per_step
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = fingerprint
        self.source = source
        self._epoch = 0
        self._position = 0
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def epoch(self) -> int:
        """Epoch the next index is drawn from."""
        return self._epoch

    @property
    def position(self) -> int:
        """Offset of the next index within the current epoch's order."""
        return self._position

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts_per_step // self.dp_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The order of all prompt indices in ``epoch``."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def next_step(self) -> list[int]:
        """This rank's prompt indices for the next step (advances the sampler)."""
        global_batch = self._take(self.prompts_per_step)
        k = self.prompts_per_rank
        return global_batch[self.dp_rank * k : (self.dp_rank + 1) * k]

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        return self.next_step()

    def _take(self, count: int) -> list[int]:
        """The next ``count`` indices of the stream, rolling over epochs as needed."""
        taken: list[int] = []
        while len(taken) < count:
            order = self.epoch_order(self._epoch)
            chunk = order[self._position : self._position + count - len(taken)]
            taken.extend(chunk)
            self._position += len(chunk)
            if self._position == self.num_examples:
                self._epoch += 1
                self._position = 0
        return taken

    # -----------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; the batch and DP sizes are not part of it."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "shuffle": self.shuffle,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the data set, seed and shuffling must match the saved ones."""
        missing = {"epoch", "position", "seed", "num_examples", "shuffle"} - set(state)
        if missing:
            raise DataError(
                f"sampler state is missing {sorted(missing)}; it is not a PromptSampler state"
            )
        for key, current in (
            ("seed", self.seed),
            ("num_examples", self.num_examples),
            ("shuffle", self.shuffle),
        ):
            if state[key] != current:
                raise DataError(
                    f"the checkpoint's prompt sampler has {key}={state[key]!r} but this run has "
                    f"{key}={current!r}, so the data order would not continue; resume with the "
                    "same data set, trainer.seed and data.shuffle"
                )
        saved = state.get("fingerprint")  # absent: saved before fingerprints, nothing to check
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:
            raise DataError(
                f"{self.source} holds {self.num_examples} prompts, as many as when the "
                "checkpoint was saved, but their content differs (its fingerprint changed): the "
                "run would continue its data order on other prompts. Restore the file the run "
                "trained on; to train on the new one deliberately, start a new run (another "
                "logging.run_dir) with checkpoint.init pointing at the checkpoint"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_examples:
            raise DataError(
                f"invalid sampler state epoch={epoch}, position={position} for "
                f"{self.num_examples} prompts"
            )
        self._epoch = epoch
        self._position = position
