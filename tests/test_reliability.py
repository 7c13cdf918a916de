"""Nothing lost, every failure explained (issue 15): real torchrun jobs and a real trainer.

- a stopped rank ends the job within the heartbeat bound, named; workers die with torchrun;
  an error every rank raises is printed once (tests/dist_job.py, no megatron-core: seconds);
- the trainer on real checkpoints: a corrupt newest iteration is skipped loudly for the newest
  intact one (and kept), a failed resume writes nothing, non-finite weights are never saved,
  a missing ``latest`` is not a silent fresh start.
"""

from __future__ import annotations

import contextlib
import io
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
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_cpu.yaml"


def _torchrun(
    *args: str, out: Path, launcher: str = "torch.distributed.run"
) -> subprocess.Popen[str]:
    """Two workers under torchrun, or under ``megatron-gndpo launch`` (``launcher="launch"``;
    its arguments are torchrun's then the command, without ``-m megatron_gndpo.cli``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = ["-m", "megatron_gndpo.cli", "launch"] if launcher == "launch" else ["-m", launcher]
    return subprocess.Popen(
        [sys.executable, *start, "--nproc-per-node", "2", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """The launcher's workers by their RANK."""
    rank_of = {}
    children = subprocess.check_output(["pgrep", "-P", str(launcher_pid)]).split()
    for pid in (int(p) for p in children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank_of[int(next(v for v in environ if v.startswith(b"RANK="))[5:])] = pid
    return rank_of


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written within {timeout_s} s: {paths}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status.lower()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.distributed
def test_workers_die_with_their_launcher(tmp_path: Path) -> None:
    proc = _torchrun("-m", "tests.dist_job", "wait", str(tmp_path), out=tmp_path)
    try:
        _wait_for([tmp_path / "pid.0", tmp_path / "pid.1"], 60)
        workers = [int((tmp_path / f"pid.{r}").read_text()) for r in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)  # torchrun itself, which cannot clean up now
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = [pid for pid in workers if _alive(pid)]
    finally:
        _kill_group(proc)
    assert not orphans, f"workers {orphans} outlived their launcher"


@pytest.mark.distributed
def test_an_error_every_rank_raises_is_printed_once_with_exit_code_2(tmp_path: Path) -> None:
    proc = _torchrun("-m", "tests.dist_job", "error", str(tmp_path), out=tmp_path)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    text = out + err
    assert text.count("megatron-gndpo: error:") == 1, text[-3000:]
    assert "megatron-gndpo: error: the same problem on every rank; the fix" in text
    assert re.search(r"exitcode\s*:\s*2", err), err[-3000:]  # torchrun's summary of its workers
    assert "[rank0]:" not in err and "[rank1]:" not in err  # no worker traceback


@pytest.mark.distributed
def test_a_rank_that_follows_a_crash_does_not_exit_as_if_an_error_was_printed(
    tmp_path: Path,
) -> None:
    """Rank 1 crashes; torchrun stops rank 0, which takes SIGTERM as a request to stop at its
    next step (the trainer) and is ended by its watchdog: with exit code 1, not 2. torchrun also
    records the codes of the workers it stops, and a 2 among them would tell ``megatron-gndpo
    launch`` that an error was printed already, hiding which rank crashed (the real-Slurm
    kill test of a rollout rank, tests/test_slurm.py, failed so once)."""
    from megatron_gndpo.job.watchdog import FOLLOWED_A_CRASH_EXIT

    proc = _torchrun("-m", "tests.dist_job", "crash", str(tmp_path), out=tmp_path)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        _kill_group(proc)
    assert "RuntimeError: a crash: nothing of ours printed" in err, err[-3000:]
    # torchrun's summary: rank 1 exited with 1 (its traceback), rank 0 with the follower's code
    codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)", err, re.S))
    assert FOLLOWED_A_CRASH_EXIT != 2
    assert codes == {"1": "1", "0": str(FOLLOWED_A_CRASH_EXIT)}, err[-3000:]


# ---------------------------------------------------------------------------------------------
# The trainer on real checkpoints (one process)


def _trainer(run_dir: str, *overrides: str):  # type: ignore[no-untyped-def]
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import load_config
    from megatron_gndpo.trainer import Trainer

    cfg = load_config(TINY, [f"logging.run_dir={run_dir}", *overrides])
    validate(cfg, torch.distributed.get_world_size())
    return Trainer(cfg)


def _reset() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _corrupt_floats(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff" * 64  # NaN bit patterns inside the weights
    path.write_bytes(bytes(data))


def _attempt(fn, *args):  # type: ignore[no-untyped-def]
    """``(result or None, error text or None, stderr)`` of ``fn(*args)``; the parallel state is
    reset either way."""
    from megatron_gndpo.errors import UserError

    err = io.StringIO()
    result = error = None
    with contextlib.redirect_stderr(err):
        try:
            result = fn(*args)
        except UserError as e:
            error = f"{type(e).__name__}: {e}"
    _reset()
    return result, error, err.getvalue()


def _checkpoint_story(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    run = Path(root) / "run"
    ckpt = run / "checkpoints"
    args = ("trainer.steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=2")

    trainer = _trainer(str(run), *args)
    trainer.train()  # iterations 2 and 3 kept, latest 3
    trainer.c.logger.close()
    _reset()

    # A resume with another architecture fails and leaves model_config.yaml as it was.
    before = (ckpt / "model_config.yaml").read_text()
    _, out["mismatch_error"], _ = _attempt(
        _trainer, str(run), *args, "model.hidden_size=128", "model.ffn_hidden_size=256"
    )
    out["model_config_kept"] = (ckpt / "model_config.yaml").read_text() == before

    # Corrupt floats in the newest iteration: the run resumes from the previous one, loudly.
    _corrupt_floats(ckpt / "iter_0000003" / "__0_0.distcp")
    trainer, error, out["fallback_warning"] = _attempt(_trainer, str(run), *args)
    assert trainer is not None, error
    out["resumed_at"] = trainer.step_count
    out["latest_after_fallback"] = (ckpt / "latest").read_text().strip()
    out["aside"] = sorted(
        str(p.relative_to(ckpt)) for p in ckpt.glob("previous-*/*") if p.name != "metrics.jsonl"
    )
    # non-finite weights are never saved: nothing is written, the newest stays intact
    from megatron_gndpo.checkpoint.dist import CheckpointError

    with torch.no_grad():
        next(trainer.c.student.parameters())[0] = math.nan
    try:
        trainer._save()
        out["nan_save"] = None
    except CheckpointError as e:
        out["nan_save"] = str(e)
    out["after_nan_save"] = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("prev"))
    trainer.c.logger.close()
    _reset()

    # Without `latest`, iterations are not silently overwritten by a fresh start ...
    (ckpt / "latest").unlink()
    _, out["no_latest_error"], _ = _attempt(_trainer, str(run), *args)
    # ... unless the user asks for it; the old iterations are moved aside, not deleted.
    trainer, _, out["fresh_warning"] = _attempt(
        _trainer, str(run), *args, "checkpoint.start_fresh=true"
    )
    out["fresh_step"] = trainer.step_count
    out["fresh_left"] = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("prev"))
    out["fresh_aside"] = sorted(p.name for p in ckpt.glob("previous-*/*"))
    out["metrics_after_fresh"] = (run / "metrics.jsonl").exists()
    trainer.c.logger.close()
    _reset()
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_checkpoints_on_a_real_run_lose_nothing(tmp_path: Path) -> None:
    out = run_distributed(_checkpoint_story, 1, args=(str(tmp_path),), timeout_s=400)[0]
    # finding 3
    assert out["mismatch_error"] and "could not load" in out["mismatch_error"]
    assert "Global shape mismatch" in out["mismatch_error"]
    assert out["model_config_kept"]
    # finding 2: corrupt newest -> the newest intact one, loudly; the corrupt one kept aside
    warning = out["fallback_warning"]
    assert "megatron-gndpo: warning:" in warning
    assert "iter_0000003 is corrupt: __0_0.distcp does not match the checksum" in warning
    assert "Resuming from the newest intact checkpoint" in warning and "iter_0000002" in warning
    assert out["resumed_at"] == 2 and out["latest_after_fallback"] == "2"
    assert out["aside"] == [f"{out['aside'][0].split('/')[0]}/iter_0000003"]
    assert "refusing to save step 2: non-finite values" in out["nan_save"]
    assert "decoder" in out["nan_save"] or "embedding" in out["nan_save"]
    assert out["after_nan_save"] == [
        "iter_0000002", "latest", "latest_checkpointed_iteration.txt", "latest_train_state.pt",
        "model_config.yaml",
    ]  # fmt: skip
    # finding 1
    assert "no 'latest' file" in out["no_latest_error"]
    assert "checkpoint.load=" in out["no_latest_error"]
    assert "checkpoint.start_fresh=true" in out["no_latest_error"]
    assert out["fresh_step"] == 0
    assert out["fresh_left"] == ["model_config.yaml"]
    assert "iter_0000002" in out["fresh_aside"] and "metrics.jsonl" in out["fresh_aside"]
    assert not out["metrics_after_fresh"]
    assert "moved what this run does not continue into" in out["fresh_warning"]


# ---------------------------------------------------------------------------------------------
# The CLI under torchrun: a stopped rank during training


def _training_under_launch(
    run: Path, *overrides: str
) -> tuple[subprocess.Popen[str], dict[int, int]]:
    """The tiny config training for 1000 steps under ``megatron-gndpo launch`` (2 ranks), once
    it has logged a step; its workers' pids by rank."""
    proc = _torchrun(
        "train", "-c", str(TINY), f"logging.run_dir={run}", "trainer.steps=1000", *overrides,
        out=run.parent, launcher="launch",
    )  # fmt: skip
    try:
        _wait_for([run / "metrics.jsonl"], 240)
        return proc, _rank_pids(proc.pid)
    except BaseException:
        _kill_group(proc)
        raise


def _outside_any_launcher() -> dict[str, str]:
    """This environment without torchrun's variables: an in-process run of an earlier test
    exports them (``export_torchrun_env``), and a child started with them would take itself for
    a rank of that finished world and bind its port."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    return dict(env, PYTHONPATH=str(ROOT))


@pytest.mark.distributed
@pytest.mark.megatron
def test_train_under_launch_ends_when_a_rank_stops(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, rank_of = _training_under_launch(
        run, "trainer.heartbeat_timeout_s=4", "trainer.collective_timeout_s=60"
    )
    try:
        workers = list(rank_of.values())
        # issue 35: the job owns its run directory, rank 0 holding the lock for it ...
        holder = json.loads((run / "megatron-gndpo.lock").read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), rank_of[0])
        # ... and a second train there is refused, naming it, before it builds anything
        second = subprocess.run(
            [sys.executable, "-m", "megatron_gndpo.cli", "train", "-c", str(TINY),
             f"logging.run_dir={run}"],
            cwd=ROOT, env=_outside_any_launcher(), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            f"megatron-gndpo: error: {run} is in use by another megatron-gndpo run: pid "
            f"{rank_of[0]} on host {socket.gethostname()}"
        ) in second.stderr
        os.kill(rank_of[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - stopped
    finally:
        _kill_group(proc)
    assert proc.returncode == 2, err[-3000:]  # our error, though the watchdog killed rank 1 first
    assert elapsed < 40, f"{elapsed:.0f} s"
    assert err.count("megatron-gndpo: error: no heartbeat from rank 1") == 1, err[-3000:]
    assert "megatron-gndpo: launch:" not in err and "Sending process" not in err
    assert not any(_alive(pid) for pid in workers)
    assert not (run / "megatron-gndpo.lock").exists()  # released by rank 0 as it failed
    # console noise: DDP gets its parameter layout; the known notices are one line (rank 0),
    # and megatron's GPTModel deprecation is our one line, naming the class and how to switch
    assert "full_param_layout not provided" not in err
    assert "GPTModel IS DEPRECATED" not in err
    assert err.count("megatron-gndpo: known upstream notices") == 1
    assert err.count("set model.model_class=hybrid") == 1, err
    shutil.rmtree(run, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# `megatron-gndpo launch`: torchrun with one line instead of its ChildFailedError traceback


@pytest.mark.distributed
def test_launch_prints_an_error_every_rank_raises_once_and_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    proc = _torchrun(
        "train", "-c", str(TINY), f"logging.run_dir={tmp_path}", f"data.train={missing}",
        out=tmp_path, launcher="launch",
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    text = out + err
    assert proc.returncode == 2, text[-3000:]
    assert text.count("megatron-gndpo: error:") == 1, text[-3000:]
    assert f"prompt file {missing} does not exist" in text
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    assert "failed (exitcode" not in text  # the agent's own log line of the failure


@pytest.mark.distributed
@pytest.mark.megatron
def test_launch_names_a_killed_rank_in_one_line_with_its_exit_code(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, rank_of = _training_under_launch(run)
    try:
        os.kill(rank_of[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]  # as a shell reports a kill -9
    lines = [line for line in err.splitlines() if line.startswith("megatron-gndpo: launch:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        f"megatron-gndpo: launch: rank 1 (local rank 1 on {socket.getfqdn()}, pid {rank_of[1]}) "
        "failed first: exit code -9 (SIGKILL); the other workers were stopped"
    ), lines[0]
    assert "ChildFailedError" not in err and "Root Cause" not in err
    # issue 48, probe 14: rank 0's collective fails with gloo's "Connection closed by peer";
    # that was a 40-line traceback above the line, and is nothing now
    assert "Traceback" not in err and "[rank0]" not in err and "closed by peer" not in err, err
    assert not any(_alive(pid) for pid in rank_of.values())
    # console noise: the known upstream warnings go to the run's upstream_notices.log, said once
    assert err.count("known upstream notices") == 1, err[-3000:]
    assert "Transformer Engine and/or Apex are not installed" not in err, err[-3000:]
    assert "warnings.warn(" not in err
    shutil.rmtree(run, ignore_errors=True)


def test_launch_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_gndpo.cli import main

    assert main(["launch", "--nproc-per-node", "2", "demo"]) == 2
    assert "'demo' is not a command launch runs" in capsys.readouterr().err
    assert main(["launch", "--no-python", "train"]) == 2
    assert "leave out -m/--module and --no-python" in capsys.readouterr().err
    # issue 48, probe 15: its help was torchrun's (~100 lines of torchrun's own words)
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-gndpo launch [torchrun options] train|convert ...")
    assert "--nproc-per-node N" in out and "every torchrun option is accepted" in out
    assert "usage: torchrun" not in out and len(out.splitlines()) < 40


def test_launch_exit_codes_and_failure_line() -> None:
    from megatron_gndpo.parallel.launch import exit_code_of, failure_line

    codes = (exit_code_of(-9), exit_code_of(-15), exit_code_of(1), exit_code_of(2))
    assert codes == (137, 143, 1, 2)
    line = failure_line(rank=5, local_rank=1, host="gpu-002", pid=42, exitcode=-6)
    assert line.startswith(
        "megatron-gndpo: launch: rank 5 (local rank 1 on gpu-002, pid 42) failed first: "
        "exit code -6 (SIGABRT)"
    )
    assert "exit code 1;" in failure_line(rank=0, local_rank=0, host="h", pid=1, exitcode=1)
    line = failure_line(rank=2, local_rank=0, host="h", pid=7, exitcode=-9, role="rollout")
    assert line.startswith(
        "megatron-gndpo: launch: rank 2 (rollout rank; local rank 0 on h, pid 7) "
    )


def test_a_rank_that_only_lost_a_peer_is_never_the_one_named() -> None:
    """Issue 48, probe 14: a rank whose collective failed because another was killed exits
    with LOST_A_RANK_EXIT, quietly; the launcher names the other rank even when the one that
    lost its peer exited first."""
    from collections import namedtuple

    from megatron_gndpo.parallel.launch import LOST_A_RANK_EXIT, _first_failure, lost_a_rank

    failure = namedtuple("failure", "exitcode timestamp")
    lost = LOST_A_RANK_EXIT
    assert _first_failure({0: failure(lost, 10), 1: failure(-9, 11)})[0] == 1
    assert _first_failure({0: failure(1, 10), 1: failure(-15, 10)})[0] == 0  # a crash, first
    assert _first_failure({0: failure(lost, 12), 1: failure(lost, 11)})[0] == 1
    gloo = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:43947"
    assert lost_a_rank(RuntimeError(gloo)) == "Connection closed by peer"
    assert lost_a_rank(RuntimeError("a bug")) is None and lost_a_rank(KeyboardInterrupt()) is None


def test_launch_names_the_role_of_the_failed_rank(tmp_path: Path) -> None:
    """With rollout ranks apart (the last R of the job), the failure line says which role died:
    the cli reads R from the train command's config; anything it cannot read (another command,
    a bad config or option) and elastic sizes leave the role out."""
    from megatron_gndpo.cli import _rollout_ranks
    from megatron_gndpo.parallel.launch import _world_size, role_of

    assert [role_of(rank, 3, 1) for rank in range(3)] == ["trainer", "trainer", "rollout"]
    assert (role_of(1, 2, 0), role_of(2, None, 1), role_of(0, 2, 2)) == (None, None, None)
    config = tmp_path / "apart.yaml"
    config.write_text("rollout:\n  disaggregate:\n    ranks: 2\n")
    assert _rollout_ranks(["train", "rollout.disaggregate.ranks=1"]) == 1
    assert _rollout_ranks(["train", "--config", str(config)]) == 2
    assert _rollout_ranks(["train", "-c", str(config), "rollout.disaggregate.ranks=3"]) == 3
    assert _rollout_ranks(["train"]) == 0  # the embedded tiny config: one role
    assert _rollout_ranks(["convert", "hf-to-mcore"]) == 0
    assert _rollout_ranks(["train", "rollout.no_such_key=1"]) == 0
    assert _rollout_ranks(["train", "--config", str(tmp_path / "missing.yaml")]) == 0
    sizes = (_world_size("2", "4"), _world_size("1:4", "2"), _world_size("1", "auto"))
    assert sizes == (8, None, None)


# ---------------------------------------------------------------------------------------------
# CI: a skip for a missing package fails when MEGATRON_GNDPO_NO_SKIPS is set

_SKIPPING_TESTS = """
import pytest

def test_needs_an_absent_package():
    pytest.importorskip("no_such_package_for_megatron_gndpo")

@pytest.mark.skipif(True, reason="shellcheck is not installed")
def test_needs_an_absent_tool():
    pass

@pytest.mark.skipif(True, reason="Transformer Engine installed")
def test_runs_only_without_a_package():
    pass

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("needs a CUDA device; could not import cuda things")
"""


@pytest.mark.parametrize("strict", ["", "1"])
def test_missing_package_skips_fail_only_when_asked(tmp_path: Path, strict: str) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_skips.py").write_text(_SKIPPING_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    # the copied conftest imports the project's tests package (tests/real.py)
    env = dict(os.environ, MEGATRON_GNDPO_NO_SKIPS=strict, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False,
    )  # fmt: skip
    summary = proc.stdout.splitlines()[-1]
    if strict:
        # a skipif skips in the set-up phase, so it shows as an error there
        assert "1 failed, 2 skipped, 1 error" in summary, proc.stdout
        assert "FAILED test_skips.py::test_needs_an_absent_package" in proc.stdout
        assert "ERROR test_skips.py::test_needs_an_absent_tool" in proc.stdout
        assert "skipped for a missing package or tool" in proc.stdout
    else:
        assert "4 skipped" in summary, proc.stdout


# ---------------------------------------------------------------------------------------------
# Console noise: megatron-core's known notices collected, one line for the job (issue 35)


def test_known_megatron_notices_are_collected(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from megatron_gndpo.compat import notices

    gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")
    notices.quiet_known_notices()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(6):  # a quick demo builds six models
                gpt.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical fixes")
            gpt.warning("something else entirely")
            gpt.warning("something else entirely")
        collected = notices.collected()
    finally:
        notices.restore()
    messages = [r.getMessage() for r in caplog.records]
    # megatron's deprecation notice is collected, and replaced by one line of ours, once
    assert not any(m.startswith("GPTModel IS DEPRECATED") for m in messages)
    assert messages.count(notices.GPT_DEPRECATION[1]) == 1
    assert "set its model_class=hybrid" in notices.GPT_DEPRECATION[1]
    assert collected == [
        "megatron.core.models.gpt.gpt_model: GPTModel IS DEPRECATED. GPTModel is only accepting "
        "critical fixes"
    ]
    assert messages.count("something else entirely") == 2  # unknown messages are not touched


def test_the_gptmodel_line_names_the_models_that_run_as_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 48, probe 15: with model.model_class=hybrid the teacher still builds a GPTModel,
    and the line told the user to set model.model_class=hybrid, which was set."""
    import logging

    from megatron_gndpo.cli import _gpt_models
    from megatron_gndpo.compat import notices
    from megatron_gndpo.config import load_config

    cfg = load_config(TINY, ["model.model_class=hybrid"])
    assert _gpt_models(cfg) == ["teacher.model"]
    assert _gpt_models(load_config(TINY)) == ["model", "teacher.model"]
    notices.quiet_known_notices()
    try:
        notices.name_gpt_models(_gpt_models(cfg))
        with caplog.at_level(logging.WARNING):
            logging.getLogger("megatron.core.models.gpt.gpt_model").warning(
                "GPTModel IS DEPRECATED. GPTModel is only accepting critical fixes"
            )
    finally:
        notices.restore()
    assert [r.getMessage() for r in caplog.records] == [
        "megatron-core's GPTModel runs teacher.model (model_class=gpt), which megatron-core "
        "deprecates: set teacher.model.model_class=hybrid to run the same layers as a "
        "HybridModel (same log-probs; gpt checkpoints load into it)"
    ]


def _warn_known_and_unknown() -> None:
    import warnings

    for _ in range(3):  # megatron-core warns from several modules, on every rank
        warnings.warn(
            "Transformer Engine and Apex are not installed. Falling back to X", stacklevel=1
        )
        warnings.warn(
            "Transformer Engine and Apex are not installed. Falling back to Y", stacklevel=1
        )
        warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)
        warnings.warn("full scope is deprecated. Use empty cuda_graph_modules", stacklevel=1)
    warnings.warn("an unknown warning stays as it is", UserWarning, stacklevel=1)


@pytest.mark.parametrize(("rank", "mode", "gpu"), [
    ("0", "", False), ("1", "", False), ("0", "show", False), ("1", "show", False),
    ("0", "", True),
])  # fmt: skip
def test_known_warnings_are_one_line_for_the_job(
    rank: str,
    mode: str,
    gpu: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import warnings

    from megatron_gndpo.compat import notices

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv(notices.SHOW_ENV, mode)
    monkeypatch.setattr(notices, "_gpu_present", lambda: gpu)
    shown: list[str] = []
    with warnings.catch_warnings():  # restores the filters and warnings.showwarning
        warnings.resetwarnings()
        warnings.showwarning = lambda message, *_: shown.append(str(message))
        notices.quiet_known_notices()
        try:
            _warn_known_and_unknown()
        finally:
            notices.restore()
    lines = capsys.readouterr().err.splitlines()
    if rank == "1":
        assert lines == []  # every rank has the same: rank 0 says it
    elif mode == "show":  # asked for: one line each, once
        assert lines == [notices.FALLBACK_LINE, "known upstream notice: full scope is deprecated"]
    else:
        said = "megatron-gndpo: known upstream notices (megatron-core's and torch's deprecations"
        assert [line[: len(said)] for line in lines[-1:]] == [said]
        # on a GPU machine the missing TE/Apex is not expected: said all the same
        assert lines[:-1] == ([notices.GPU_FALLBACK_LINE] if gpu else [])
    assert shown == ["an unknown warning stays as it is"]  # to the hook it replaced, as it was
