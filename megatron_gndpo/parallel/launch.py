"""``megatron-gndpo launch``: torchrun for this package, with one line instead of a traceback.

    megatron-gndpo launch [torchrun options] train [--config FILE] [section.key=value ...]
    megatron-gndpo launch --nproc-per-node 4 convert hf-to-mcore --hf-dir ... --tp 2 --pp 2

It is torchrun (``torch.distributed.run``: the same options, rendezvous and elastic agent),
started on ``python -m megatron_gndpo.cli COMMAND ...`` with this interpreter. Only what happens
when a worker fails differs. Plain torchrun ends with its own ``ChildFailedError`` traceback and
a failure box, and exits with 1 whatever its workers' codes were. Here:

- a worker that failed with one of our errors has already printed it once for the job
  (``megatron-gndpo: error: ...``, exit code 2): nothing more is printed, and the exit code is 2
  (also when another worker failed first: the heartbeat watchdog kills a stopped rank, then
  says so). A worker the watchdog ends because another one crashed exits with 1, not 2;
- any other failure (a crash, a signal, the OOM killer) gets one line naming the process that
  failed first, which the Slurm script quotes (``scripts/slurm/gndpo.sbatch``):
  ``megatron-gndpo: launch: rank 1 (local rank 1 on HOST, pid N) failed first: exit code -9
  (SIGKILL); ...`` (with rollout ranks apart, its role too: ``rank 2 (rollout rank; local
  rank 2 ...``), and the launcher exits with the worker's code (128 + N for signal N, as a
  shell reports it);
- a launcher stopped by a signal (srun's SIGTERM when another node failed) says so in one line
  and exits with 128 + N.

A worker whose collective fails because another worker went away (gloo's "Connection closed by
peer" when a rank is killed) prints nothing under the launcher and exits with
:data:`LOST_A_RANK_EXIT`; it is never the worker the line names (under plain torchrun or srun it
says so in one line instead of a traceback).

The worker's own traceback, when it has one, is in its output above the line, as with torchrun.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

COMMANDS = ("train", "convert")
_MODULE = "megatron_gndpo.cli"
_USER_ERROR_EXIT = 2  # cli.main's exit code for an error we raise on purpose
# The exit code of a worker whose collective failed because another worker went away (killed,
# crashed): never the failure the launcher names, whichever exited first.
LOST_A_RANK_EXIT = 3
# Set for the workers of `megatron-gndpo launch`: the launcher names a failed worker itself.
LAUNCHED_ENV = "MEGATRON_GNDPO_LAUNCH"
# How torch's collectives say that the other end is gone (gloo's TCP pair, NCCL's remote error).
_PEER_GONE = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "remote process exited or there was a network error",
)  # fmt: skip


def lost_a_rank(err: BaseException) -> str | None:
    """The one line a collective's error says when another worker went away (``Connection
    closed by peer``: it was killed or crashed), else None."""
    text = str(err)
    for words in _PEER_GONE:
        if isinstance(err, RuntimeError) and words in text:
            return words
    return None


def _first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to name: the earliest, leaving out the workers that only lost a peer
    (:data:`LOST_A_RANK_EXIT`) unless every failure is one; ties go to the lower rank."""
    named = {r: f for r, f in failures.items() if f.exitcode != LOST_A_RANK_EXIT} or failures
    rank = min(named, key=lambda r: (named[r].timestamp, r))
    return rank, named[rank]


class _DropFailureLog(logging.Filter):
    """torchrun's agent logs the first failure ("failed (exitcode: ...)") and each worker it
    stops ("Sending process N closing signal SIGTERM") before raising; the launcher reports the
    failure itself, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("failed (exitcode", "Sending process"))


HELP = """\
usage: megatron-gndpo launch [torchrun options] train|convert ...

Start the command on several processes, as torchrun does (its options, rendezvous and elastic
agent), with one line instead of torchrun's traceback when a worker fails, and the worker's
exit code: 2 for an error we print (`megatron-gndpo: error: ...`, once for the job), 128 + N
for a worker killed by signal N (`megatron-gndpo: launch: rank R (...) failed first: ...`).

commands:
  train [--config FILE] [section.key=value ...]     `megatron-gndpo train --help`
  convert hf-to-mcore|mcore-to-hf [options]         `megatron-gndpo convert DIRECTION --help`

torchrun's options most runs need (every torchrun option is accepted; `python -m
torch.distributed.run --help` lists them all):
  --nproc-per-node N        processes on this node: one per GPU (on a CPU, any number)
  --nnodes N                nodes in the job (MIN:MAX for an elastic range)
  --node-rank R             this node's rank, with --master-addr/--master-port (static start)
  --master-addr HOST        the host of rank 0 (default 127.0.0.1)
  --master-port PORT        a free port on it (default 29500)
  --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID
                            a rendezvous for several nodes instead of --node-rank
  --max-restarts N          start the workers again after a failure, N times (default 0)

examples:
  megatron-gndpo launch --nproc-per-node 2 train parallel.tensor_parallel=2
  megatron-gndpo launch --nproc-per-node 4 convert hf-to-mcore --hf-dir HF --out CKPT --tp 2 --pp 2
"""


def _usage_error(message: str) -> int:
    print(f"megatron-gndpo launch: error: {message}", file=sys.stderr)
    return _USER_ERROR_EXIT


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_code_of(worker_exitcode: int) -> int:
    """The launcher's exit code for a worker's: the same, or 128 + N for a worker killed by
    signal N (multiprocessing reports -N)."""
    return 128 - worker_exitcode if worker_exitcode < 0 else worker_exitcode


def failure_line(
    rank: int, local_rank: int, host: str, pid: int, exitcode: int, role: str | None = None
) -> str:
    how = f"exit code {exitcode}"
    if exitcode < 0:
        how += f" ({_signal_name(-exitcode)})"
    which = f"{role} rank; " if role else ""
    return (
        f"megatron-gndpo: launch: rank {rank} ({which}local rank {local_rank} on {host}, "
        f"pid {pid}) "
        f"failed first: {how}; the other workers were stopped. Its output above says why "
        "(a traceback, or nothing when it was killed: look for the OOM killer in `dmesg`)"
    )


def role_of(rank: int, world_size: int | None, rollout_ranks: int) -> str | None:
    """The role of global ``rank`` when the job's last ``rollout_ranks`` ranks only generate
    (``rollout.disaggregate.ranks``): "rollout" or "trainer"; None when the job has one role or
    its world size is not fixed by torchrun's options (``--nnodes 1:4``, ``--nproc-per-node
    auto``: the line then names the rank only)."""
    if world_size is None or not 0 < rollout_ranks < world_size:
        return None
    return "rollout" if rank >= world_size - rollout_ranks else "trainer"


def _world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """torchrun's world size when fixed by its options (``--nnodes 2 --nproc-per-node 4``)."""
    try:
        return int(nnodes) * int(nproc_per_node)
    except ValueError:
        return None


def main(argv: Sequence[str], rollout_ranks: Callable[[Sequence[str]], int] = lambda _: 0) -> int:
    """``rollout_ranks``: how many of the job's ranks a command (``train ...``) gives to
    generation alone (the cli reads its config; the failure line then names the role)."""
    import socket

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else _USER_ERROR_EXIT
    # torchrun's own parser: its first positional (the script) is our command
    args = torchrun.parse_args(argv)
    if args.module or args.no_python:
        return _usage_error(
            "launch runs megatron-gndpo's own module: leave out -m/--module and --no-python"
        )
    if args.training_script not in COMMANDS:
        return _usage_error(
            f"'{args.training_script}' is not a command launch runs: give torchrun's options, "
            f"then one of {', '.join(COMMANDS)} and its arguments, e.g. `megatron-gndpo launch "
            "--nproc-per-node 2 train parallel.tensor_parallel=2`"
        )
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = _MODULE
    args.module = True

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    drop = _DropFailureLog()
    agent_log.addFilter(drop)
    os.environ[LAUNCHED_ENV] = "1"  # the workers inherit it
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        if any(f.exitcode == _USER_ERROR_EXIT for f in err.failures.values()):
            # One of our errors, printed once for the job by the workers already. It may not be
            # the first failure: the heartbeat watchdog SIGKILLs a stopped rank, then says why.
            # (torchrun also records the codes of the workers it stops after the first failure:
            # a rank the watchdog ends after another one crashed exits with 1, not 2, so that a
            # crash is named below; job/watchdog.py's Watchdog.)
            return _USER_ERROR_EXIT
        rank, failure = _first_failure(err.failures)
        host = socket.getfqdn()
        world = _world_size(str(args.nnodes), str(args.nproc_per_node))
        role = role_of(rank, world, rollout_ranks(args.training_script_args))
        print(failure_line(rank, failure.local_rank, host, failure.pid, failure.exitcode, role),
              file=sys.stderr, flush=True)  # fmt: skip
        return exit_code_of(failure.exitcode)
    except SignalException as err:
        name = _signal_name(int(err.sigval))
        print(
            f"megatron-gndpo: launch: stopped by {name}; its workers were stopped too",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(err.sigval)
    except RendezvousError as err:
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
        print(
            f"megatron-gndpo: error: the workers' rendezvous at {endpoint} failed "
            f"({type(err).__name__}: {err}). Check that every node reaches that host and port "
            "(--rdzv-endpoint) and that all nodes were started with the same --nnodes and "
            "--rdzv-id",
            file=sys.stderr,
            flush=True,
        )
        return _USER_ERROR_EXIT
    finally:
        agent_log.removeFilter(drop)
        os.environ.pop(LAUNCHED_ENV, None)
    return 0
