"""Wall-clock time per named stage of one training step.

The step function wraps each stage in ``with timer.time("rollout"):`` and, once the step is done,
logs ``timer.pop()``: ``{"time/rollout": seconds, ...}``. Stages may nest, and each records
under exactly the name it was given: a whole-step ``timer.time("step")`` around everything gives
``time/step`` beside ``time/rollout``, and a sub-stage names its parent itself,
``timer.time("update/forward_backward")`` inside ``timer.time("update")``. (Names are not
prefixed by the enclosing stage, so a helper's stage keeps its name wherever it is called.)
A stage entered several times in one step (a micro-batch loop) accumulates its seconds.

CUDA kernels run asynchronously, so on a GPU a stage's wall time only means something if the
device is drained at its boundaries: pass ``sync=torch.cuda.synchronize``. Synchronising costs
a little overlap, which is why it is a choice and not the default.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# Prefix of every key ``pop`` returns; the console and the dashboards group timings by it.
TIME_PREFIX = "time/"


class StageTimer:
    """Accumulates wall seconds per named stage until ``pop``."""

    def __init__(
        self,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """sync: called when a stage starts and ends (e.g. ``torch.cuda.synchronize``).
        clock: seconds from an arbitrary origin; tests pass a fake one.
        """
        self._sync = sync
        self._clock = clock
        self._open: list[str] = []
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the body as stage ``name`` (adding to its seconds if it already ran this step).

        The time is recorded even if the body raises, so a failed step still shows where it was.
        Entering a stage that is already open is an error: its seconds would count twice.
        """
        if not name or name.startswith("/") or name.endswith("/"):
            raise ValueError(f"stage name {name!r} must be non-empty and not start or end in '/'")
        if name in self._open:
            raise RuntimeError(f"stage {name!r} is already open; name the inner stage differently")
        self._open.append(name)
        if self._sync is not None:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            elapsed = self._clock() - start
            self._open.pop()
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed

    def pop(self) -> dict[str, float]:
        """Seconds per stage of the step, ``{"time/<name>": s}``, and start a new step.

        Raises RuntimeError when called inside a stage: its time would be lost or split between
        two steps; pop after the step's outermost stage has closed.
        """
        if self._open:
            raise RuntimeError(
                f"StageTimer.pop() called inside stage {self._open[-1]!r}; "
                "pop once the step's stages have all closed"
            )
        seconds, self._seconds = self._seconds, {}
        return {TIME_PREFIX + name: s for name, s in seconds.items()}
