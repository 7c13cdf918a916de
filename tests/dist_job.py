"""A tiny job for torchrun in tests/test_reliability.py (no megatron-core: starts in seconds).

    python -m torch.distributed.run --nproc-per-node 2 -m tests.dist_job MODE OUT_DIR

Every rank starts torch.distributed through the project's own start-up (``init_distributed``)
and its watchdog (a 2 s heartbeat timeout), writes its pid to ``OUT_DIR/pid.RANK``, then:

- ``wait``: both ranks wait in barriers until killed (the test kills the launcher);
- ``error``: both ranks raise the same UserError through the CLI's reporting;
- ``crash``: rank 1 crashes (a RuntimeError, marked crashed as the CLI marks one) while rank 0
  waits outside any collective, taking SIGTERM as a request (as the trainer does): rank 0's
  watchdog ends it with ``FOLLOWED_A_CRASH_EXIT``.

This job stands in for the trainer only where the trainer cannot be made to do a thing on cue:
raise an error on every rank, or crash on one rank while another waits outside a collective.
The real trainer's failures run under torchrun, ``megatron-gndpo launch`` and a real Slurm
cluster in tests/test_reliability.py and tests/test_slurm.py (a rollout rank killed mid-run).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

HEARTBEAT_TIMEOUT_S = 2.0


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    import torch.distributed as dist

    from megatron_gndpo.job.watchdog import Watchdog, report_error
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed

    env = init_distributed(backend="gloo", timeout_s=120)
    watchdog = Watchdog(env, HEARTBEAT_TIMEOUT_S)
    (out / f"pid.{env.rank}").write_text(str(os.getpid()))
    dist.barrier()
    if mode == "wait":
        while True:
            dist.barrier()
            time.sleep(0.2)
    elif mode == "error":
        report_error("the same problem on every rank; the fix")
        watchdog.stop(failed=True)
        return 2
    elif mode == "crash":
        if env.rank == 0:
            signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer stops at its next step
            while True:
                time.sleep(0.2)
        try:
            raise RuntimeError("a crash: nothing of ours printed")
        except BaseException:
            watchdog.stop(failed=True, said_why=False)
            raise
    watchdog.stop()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
