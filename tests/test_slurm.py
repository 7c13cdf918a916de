"""The batch script on a real Slurm: a single-node cluster started by scripts/ci/slurm_up.sh.

Every job is ``sbatch scripts/slurm/gndpo.sbatch`` itself, without a container (``IMAGE=none``)
and with the CPU node's limits on the command line (``--gpus-per-node=0 --cpus-per-task=2``):
srun starts one ``megatron-gndpo launch`` (torchrun), which starts two gloo ranks of the tiny CPU
config. Jobs find the project through PATH and PYTHONPATH, which sbatch passes on from this process.

Each interrupted job must end with the per-step metrics of an uninterrupted one (the first test's
job, same seed): a resumed run trains on from its checkpoint exactly as the straight run did.
The learning rate is constant in the tiny config, so a shorter run's steps are the first steps
of a longer one.

Skipped, with the reason, when the cluster is not up: run scripts/ci/slurm_up.sh (root) first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "gndpo.sbatch"
CONFIG = ROOT / "megatron_gndpo" / "configs" / "tiny_cpu.yaml"
CI_DIR = Path(os.environ.get("SLURM_CI_DIR", "/tmp/gndpo-slurm"))
SLURM_CONF = CI_DIR / "slurm.conf"

# The uninterrupted run, long enough that a time-limit warning (sent by slurmctld's checks every
# 30 s) arrives while it trains; the other runs are shorter prefixes of it.
REFERENCE_STEPS = 200
SHORT_STEPS = 48  # an interrupted run: the tiny job trains about 5 steps a second, and the
# interruption lands a second or two after step 6 is logged: well before the end
SAVE_INTERVAL = 4
JOB_TIMEOUT_S = 300  # the longest any one job may take here (2 loaded cores) before a test fails

# Metrics that depend on the wall clock, not on the training: left out of the comparison.
_TIMING = re.compile(r"^(time/|tokens/s$|mfu)")

# Each test waits for two or three jobs of about a minute each (more on loaded cores).
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


# --------------------------------------------------------------------------------------------
# The cluster and its jobs
# --------------------------------------------------------------------------------------------


def _slurm_env() -> dict[str, str]:
    """This process's environment for Slurm commands and jobs, pointed at the test cluster.

    A job runs whatever megatron-gndpo PATH finds first, so this interpreter's
    directory goes first; PYTHONPATH makes it import this checkout. Variables of an enclosing
    Slurm job or launcher are dropped, so that they cannot leak into the test's jobs.
    """
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return keep | {
        "SLURM_CONF": str(SLURM_CONF),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": python_path,
    }


def _slurm(*args: str, check: bool = True) -> str:
    result = subprocess.run(
        list(args), env=_slurm_env(), capture_output=True, text=True, timeout=30, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _why_no_cluster() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm is not installed: scripts/ci/slurm_up.sh installs and starts a test cluster"
    if not SLURM_CONF.exists():
        return f"no test cluster: {SLURM_CONF} is missing (start one with scripts/ci/slurm_up.sh)"
    try:
        sinfo = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"],
            env=_slurm_env(), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within 30 s: is slurmctld of {SLURM_CONF} running?"
    state = sinfo.stdout.strip()
    if state not in ("idle", "mixed", "allocated"):
        said = state or (sinfo.stderr.strip().splitlines() or ["nothing"])[-1]
        return f"the test cluster is not up (sinfo: {said!r}); start it with scripts/ci/slurm_up.sh"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    reason = _why_no_cluster()
    if reason is not None:
        pytest.skip(reason)


class Job:
    """One sbatch job of the test script; ``run_dir`` is its RUN_DIR and submit directory."""

    def __init__(self, job_id: int, run_dir: Path) -> None:
        self.id = job_id
        self.run_dir = run_dir

    def info(self) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, RunTime, ...)."""
        text = _slurm("scontrol", "show", "job", "--oneliner", str(self.id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def output(self) -> str:
        path = self.run_dir / f"job-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def node_log(self, restart: int) -> str:
        path = self.run_dir / "logs" / f"job{self.id}.restart{restart}" / f"{_node()}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def describe(self) -> str:
        """What a failing test prints: the job's state, its output and its node logs' ends."""
        parts = [f"job {self.id}: {self.info()}", f"--- job output ---\n{self.output()}"]
        for log in sorted((self.run_dir / "logs").glob("job*/*.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            parts.append(f"--- {log.relative_to(self.run_dir)} (end) ---\n{tail}")
        return "\n".join(parts)

    def wait(self, condition: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                     + self.describe())  # fmt: skip
            time.sleep(1.0)

    def wait_ended(self, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Wait until the job has left the queue for good; its final fields."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        self.wait(lambda: self.info().get("JobState") in ended, "the job to end", timeout)
        return self.info()

    def steps_logged(self) -> int:
        return len(_metrics(self.run_dir))


def _node() -> str:
    """This node's name in Slurm (slurm_up.sh names it after ``hostname -s``)."""
    return socket.gethostname().split(".")[0]


def _sbatch(
    run_dir: Path,
    *options: str,
    steps: int,
    save_interval: int = SAVE_INTERVAL,
    overrides: tuple[str, ...] = (),
    ranks: int = 2,
    jobs: list[Job] | None = None,
) -> Job:
    """``sbatch scripts/slurm/gndpo.sbatch`` for the tiny config on this CPU node; the job is
    also appended to ``jobs`` when given (the ``submit`` fixture cancels those left over)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job_env = _slurm_env() | {
        "IMAGE": "none",  # no pyxis/enroot here: the job runs on the host
        "GPUS_PER_NODE": str(ranks),  # gloo ranks (two unless a test asks for more)
        "CONFIG": str(CONFIG),
        "RUN_DIR": str(run_dir),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        "sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2",
        f"--chdir={run_dir}", f"--output={run_dir}/job-%j.out", *options,
        str(SBATCH), f"trainer.steps={steps}", f"checkpoint.save_interval={save_interval}",
        *overrides,
    ]  # fmt: skip
    result = subprocess.run(
        command, env=job_env, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, f"sbatch failed: {result.stderr}"
    job = Job(int(result.stdout.strip().split(";")[0]), run_dir)
    if jobs is not None:
        jobs.append(job)
    return job


def _cancel_if_queued(job: Job) -> None:
    if job.info().get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
        _slurm("scancel", str(job.id), check=False)


@pytest.fixture
def submit(cluster: None) -> Iterator[Callable[..., Job]]:
    """``_sbatch`` for one test; its jobs still queued or running at the end are cancelled."""
    jobs: list[Job] = []
    yield functools.partial(_sbatch, jobs=jobs)
    for job in jobs:
        _cancel_if_queued(job)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def _training_metrics(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if not _TIMING.match(k)} for row in rows]


def _assert_same_training(run_dir: Path, reference: list[dict[str, float]], steps: int) -> None:
    """The run's metrics, step by step, equal the uninterrupted run's first ``steps`` steps."""
    got = _training_metrics(_metrics(run_dir))
    want = _training_metrics(reference[:steps])
    assert [row["step"] for row in got] == list(range(1, steps + 1))
    for mine, theirs in zip(got, want, strict=True):
        different = {
            key: (mine.get(key), theirs.get(key))
            for key in sorted(mine.keys() | theirs.keys())
            if mine.get(key) != theirs.get(key)
        }
        assert not different, f"step {mine['step']} differs from the uninterrupted run: {different}"


def _resumed_at(log: str) -> int | None:
    match = re.search(r"resumed from \S+ at step (\d+)", log)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# The jobs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Reference:
    """The uninterrupted job, its final fields and its metrics."""

    job: Job
    final: dict[str, str]
    rows: list[dict[str, float]]


@pytest.fixture(scope="module")
def reference(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """REFERENCE_STEPS steps in one job, nothing interrupting it."""
    run_dir = tmp_path_factory.mktemp("reference")
    job = _sbatch(run_dir, "--time=10", steps=REFERENCE_STEPS)
    try:
        final = job.wait_ended()
    finally:
        _cancel_if_queued(job)
    return Reference(job, final, _metrics(run_dir))


def test_full_job(reference: Reference) -> None:
    """sbatch -> srun -> one launcher (torchrun) -> 2 gloo ranks: trains to the end, writes what
    it should."""
    job, final = reference.job, reference.final
    state = (final["JobState"], final["ExitCode"], final["Restarts"])
    assert state == ("COMPLETED", "0:0", "0"), job.describe()
    assert [row["step"] for row in reference.rows] == list(range(1, REFERENCE_STEPS + 1))
    assert all(
        math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in reference.rows
    )
    checkpoints = job.run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == str(REFERENCE_STEPS)
    assert (checkpoints / f"iter_{REFERENCE_STEPS:07d}").is_dir()
    assert (job.run_dir / "config.yaml").exists()
    log = job.node_log(0)
    assert "[default0]" in log, job.describe()  # torchrun's tags (rank 1 prints nothing)
    shards = sorted(p.name for p in (checkpoints / f"iter_{REFERENCE_STEPS:07d}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], job.describe()  # both ranks saved
    assert "srun exited with status 0" in job.output()


def test_time_limit_warning_saves_requeues_and_resumes(
    reference: Reference, submit: Callable[..., Job], tmp_path: Path
) -> None:
    """Near its time limit the job is warned (USR1 to the batch shell, from slurmctld's own
    timer), the trainer saves after its current step, the job requeues itself, and the requeued
    job resumes from that very step and finishes with the uninterrupted run's metrics.

    No periodic checkpoints here: the stop's save is the run's first, the slowest one (seconds
    here), and it takes longer than KillWait (5 s on the test cluster), as a large model's step
    and save do on a cluster with the default 30 s. So the save survives only if nothing kills
    the trainer before it is done.
    """
    run_dir = tmp_path / "run"
    # The warning lead (120 s) is long, the limit first longer still (5 min). Once the trainer is
    # in its loop, both ranks are paused (SIGSTOP), as if a step took minutes: on an idle machine
    # the tiny run ends in about 20 s, sooner than Slurm can warn (it checks every 30 s). Paused,
    # the limit is cut to 75-135 s from now, so that slurmctld's next check sends the warning;
    # then the ranks go on and find it pending. (The heartbeat watchdog, made to end a job with a
    # stopped rank, is off for this job; it does not change the training.)
    job = submit(run_dir, "--time=5", "--signal=B:USR1@120", steps=REFERENCE_STEPS,
                 save_interval=0, overrides=("trainer.heartbeat_timeout_s=0",))  # fmt: skip
    job.wait(lambda: job.steps_logged() >= 2, "the first training steps", JOB_TIMEOUT_S)
    found = [_worker_pid(job.id, rank) for rank in (0, 1)]
    pids = [pid for pid in found if pid is not None]
    assert len(pids) == 2, f"the trainer processes were not found: {found}\n" + job.describe()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        # (A warning in a run's first 30 s means a limit shorter than the lead: the script
        # refuses to requeue then, so the limit is cut only after that.)
        job.wait(lambda: _seconds(job.info()["RunTime"]) >= 35, "35 s of run time", 60)
        elapsed_s = _seconds(job.info()["RunTime"])
        _set_time_limit(job, math.ceil((elapsed_s + 75) / 60))
        job.wait(lambda: "time limit near" in job.output(), "the time-limit warning", 90)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    job.wait(lambda: job.info().get("Restarts") == "1", "the requeue", 60)
    _set_time_limit(job, 10)  # the requeued run: time enough to finish without another warning
    final = job.wait_ended()
    assert (final["JobState"], final["Restarts"]) == ("COMPLETED", "1"), job.describe()

    first, second = job.node_log(0), job.node_log(1)
    stopped = re.search(r"stop requested: saving at step (\d+)", first)
    assert stopped, "the warned run did not save on the warning\n" + job.describe()
    stop_step = int(stopped.group(1))
    assert 2 <= stop_step < REFERENCE_STEPS
    assert _resumed_at(second) == stop_step, job.describe()  # no step was lost or trained twice
    _assert_same_training(run_dir, reference.rows, REFERENCE_STEPS)


def test_hard_requeue_resumes_from_last_complete_checkpoint(
    reference: Reference, submit: Callable[..., Job], tmp_path: Path
) -> None:
    """``scontrol requeue`` of a running job (no warning: SIGTERM, SIGKILL 5 s later) requeues it
    with the same id; the new run resumes from the newest complete checkpoint."""
    run_dir = tmp_path / "run"
    job = submit(run_dir, "--time=10", steps=SHORT_STEPS)
    job.wait(
        lambda: job.steps_logged() >= SAVE_INTERVAL + 2, "steps past a checkpoint", JOB_TIMEOUT_S
    )
    _slurm("scontrol", "requeue", str(job.id))
    final = job.wait_ended()
    assert (final["JobState"], final["Restarts"]) == ("COMPLETED", "1"), job.describe()
    resumed = _resumed_at(job.node_log(1))
    assert resumed is not None and resumed >= SAVE_INTERVAL, job.describe()
    _assert_same_training(run_dir, reference.rows, SHORT_STEPS)


def _job_processes(job_id: int) -> dict[int, tuple[list[bytes], bytes]]:
    """This node's processes of the job (environment and command line by pid, from /proc): the
    launcher, its workers and whatever they started, which inherit ``SLURM_JOB_ID``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ:
            found[int(proc.name)] = (environ, cmdline)
    return found


def _worker_pid(job_id: int, rank: int) -> int | None:
    """The pid of the job's trainer process of global ``rank`` on this node (read from /proc)."""
    for pid, (environ, cmdline) in _job_processes(job_id).items():
        if (
            f"RANK={rank}".encode() in environ  # the launcher itself has no RANK
            and b"megatron_gndpo.cli\0train" in cmdline  # a worker: python -m megatron_gndpo.cli
        ):
            return pid
    return None


def _assert_no_process_outlives(job: Job) -> None:
    """Once the job has ended, none of its processes is left on the node (polled for 30 s). A
    process a killed rank had started, parented to init when the rank died, would hold its
    memory until the node reboots on a cluster that does not track jobs by cgroup (ours:
    proctrack/linuxproc): megatron-core's checkpoint writer started one per rank
    (``compat/saving.py``)."""
    deadline = time.monotonic() + 30
    while (left := _job_processes(job.id)) and time.monotonic() < deadline:
        time.sleep(1)
    commands = [
        cmdline.replace(b"\0", b" ").decode(errors="replace") for _, cmdline in left.values()
    ]
    assert not left, f"processes outlived the job: {dict(zip(left, commands, strict=True))}"


def _kill_rank_past_a_checkpoint(job: Job, rank: int) -> None:
    """Once ``job`` has logged steps past its first checkpoint, kill -9 the process of global
    ``rank``: the job must fail within a minute, its output naming the rank and saying to
    resubmit (no rank waits forever for the dead one)."""
    job.wait(
        lambda: job.steps_logged() >= SAVE_INTERVAL + 2, "steps past a checkpoint", JOB_TIMEOUT_S
    )
    pid = _worker_pid(job.id, rank=rank)
    assert pid is not None, f"rank {rank}'s process was not found\n" + job.describe()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    final = job.wait_ended(timeout=90)
    ended_s = time.monotonic() - killed
    assert final["JobState"] == "FAILED", job.describe()
    assert ended_s < 60, f"the job took {ended_s:.0f} s to end after the kill"
    assert job.steps_logged() < SHORT_STEPS, "the kill came after the last step\n" + job.describe()
    out = job.output()
    assert "training failed" in out and f"rank {rank}" in out and "resubmit" in out, out
    _assert_no_process_outlives(job)


def test_killed_rank_ends_job_and_next_submission_resumes(
    reference: Reference, submit: Callable[..., Job], tmp_path: Path
) -> None:
    """kill -9 of one trainer process: the job fails within a bounded time with a message that
    says what happened and what to do; the same submission again resumes and finishes."""
    run_dir = tmp_path / "run"
    _kill_rank_past_a_checkpoint(submit(run_dir, "--time=10", steps=SHORT_STEPS), rank=1)

    again = submit(run_dir, "--time=10", steps=SHORT_STEPS)
    final = again.wait_ended()
    assert final["JobState"] == "COMPLETED", again.describe()
    resumed = _resumed_at(again.node_log(0))
    assert resumed is not None and resumed >= SAVE_INTERVAL, again.describe()
    _assert_same_training(run_dir, reference.rows, SHORT_STEPS)


# rollout.disaggregate on the cluster: 2 trainer ranks and 1 rollout rank, one step off.
DISAGGREGATED = ("rollout.disaggregate.ranks=1", "rollout.disaggregate.staleness=1")


def test_disaggregated_job_killed_rollout_rank_resumes_with_batches_in_flight(
    submit: Callable[..., Job], tmp_path: Path
) -> None:
    """Rollout ranks apart (three processes: two trainer ranks, one rollout rank, one step off)
    under sbatch -> srun -> torchrun: kill -9 of the rollout rank ends the job in bounded time
    with the batch script's message; the same submission again resumes from the checkpoint with
    its batch sampled ahead, and trains to the end one step off. (That such a resume equals the
    uninterrupted run exactly is tests/test_disaggregated.py's; this is the real launcher's.)"""
    run_dir = tmp_path / "run"
    job = submit(run_dir, "--time=10", steps=SHORT_STEPS, overrides=DISAGGREGATED, ranks=3)
    _kill_rank_past_a_checkpoint(job, rank=2)  # the trainer ranks do not wait for it forever
    assert "rank 2 (rollout rank;" in job.output(), job.describe()
    saved = int((run_dir / "checkpoints" / "latest").read_text())
    inflight = run_dir / "checkpoints" / f"iter_{saved:07d}" / "inflight"
    assert sorted(p.name for p in inflight.iterdir()) == ["dp0.pt", "dp1.pt"], job.describe()

    again = submit(run_dir, "--time=10", steps=SHORT_STEPS, overrides=DISAGGREGATED, ranks=3)
    final = again.wait_ended()
    assert final["JobState"] == "COMPLETED", again.describe()
    assert _resumed_at(again.node_log(0)) == saved, again.describe()
    rows = _metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, SHORT_STEPS + 1)), again.describe()
    assert [row["async/staleness"] for row in rows] == [0.0] + [1.0] * (SHORT_STEPS - 1)
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in rows)
    assert all(row["weight_sync/check_logprob_diff"] < 1e-5 for row in rows
               if "weight_sync/check_logprob_diff" in row)  # fmt: skip


def _set_time_limit(job: Job, minutes: int) -> None:
    _slurm("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")


def _seconds(run_time: str) -> int:
    """Slurm's ``[days-]hours:minutes:seconds`` as seconds."""
    days, _, clock = run_time.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s
