"""A tiny job for torchrun in tests/test_reliability.py (no megatron-core: starts in seconds).

    python -m torch.distributed.run --nproc-per-node 2 -m tests.dist_job MODE OUT_DIR

Every rank starts torch.distributed through the project's own start-up (``init_distributed``)
and its watchdog (a 2 s heartbeat timeout), writes its pid to ``OUT_DIR/pid.RANK``, then:

- ``wait``: both ranks wait in barriers until killed (the test kills the launcher);
- ``error``: both ranks raise the same UserError through the CLI's reporting.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HEARTBEAT_TIMEOUT_S = 2.0


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    import torch.distributed as dist

    from megatron_gndpo.parallel.distributed import (
        Watchdog,
        init_distributed,
        report_error,
        shutdown_distributed,
    )

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
    watchdog.stop()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
