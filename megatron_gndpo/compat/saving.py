"""megatron-core's checkpoint writer keeps its write results in this process.

megatron-core 0.19's ``FileSystemWriterAsync`` (behind ``dist_checkpointing.save``) hands the
results of its writer threads back through ``get_write_results_queue()``: a queue behind a
``multiprocessing`` manager, a server process started with ``spawn`` at the first save and kept
for the life of the rank. The manager is there for megatron's *asynchronous* saves, whose writes
run in another process. Ours are synchronous (``checkpoint/dist.py`` calls
``dist_checkpointing.save`` and waits): the writes run in threads of the saving rank, which a
plain thread queue serves as well. The manager costs more than the queue:

- it is a second Python process per rank that imports the launcher's main module again (about
  570 MB of host memory measured per rank on CPU);
- nothing ties it to its parent: when a rank is killed (``kill -9``, the OOM killer, a node's
  watchdog) the manager outlives it, parented to init, and holds its memory until the node is
  rebooted, unless the cluster tracks a job's processes by cgroup (Slurm's
  ``proctrack/cgroup``). A plain ``torchrun`` or a ``proctrack/linuxproc`` cluster leaves one per
  killed rank (found by the real-Slurm kill test, ``tests/test_slurm.py``).

:func:`keep_write_results_in_process` seeds megatron's cache of that queue with a thread queue
before the first save, so the manager is never started. Nothing happens on import.
"""

from __future__ import annotations

import queue


def keep_write_results_in_process() -> None:
    """Before a synchronous ``dist_checkpointing.save``: megatron's writer gets its results
    through a thread queue of this process instead of a spawned manager process. Idempotent.

    Not for megatron's asynchronous saves (their writes run in another process); we make none.
    Raises ``RuntimeError`` when the installed megatron-core no longer has the cache this seeds
    (its writer changed: check whether it still starts a manager, then update or drop this)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue") or not hasattr(
        filesystem_async, "get_write_results_queue"
    ):
        raise RuntimeError(
            "megatron-core's filesystem_async has no _results_queue/get_write_results_queue "
            "any more; megatron_gndpo/compat/saving.py must be updated for this megatron-core"
        )
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
