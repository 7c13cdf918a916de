"""What a hostile but realistic user found (issue 35), at unit level: each mistake is refused
with one line naming the fix, nothing already written is lost, nothing hangs.

The end-to-end story on a real run (the tiny config, one process: a step skipped by the filter
and saved, a rewritten prompt file, a planted pickle, conversion mistakes) is
``test_a_hostile_session_on_a_real_run`` at the bottom; the multi-rank lock is checked in
tests/test_reliability.py (a second ``train`` beside a running 2-rank job), the served teacher's
replies and waits in tests/test_served_teacher.py.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_cpu.yaml"
MARKER_NAME = "pwned"


# ---------------------------------------------------------------------------------------------
# 1. One owner per run directory


def _holder(path: Path, **fields: Any) -> None:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "then"} | fields
    path.write_text(json.dumps(holder))


def test_a_run_directory_has_one_owner_and_a_stale_lock_is_taken_over(tmp_path: Path) -> None:
    from megatron_gndpo.job.runlock import LOCK_FILE, RunDirLockedError, RunLock, stale_reason

    said: list[str] = []
    lock = RunLock([tmp_path], "train", say=said.append)
    lock.acquire()
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    assert holder["proc_start"] and holder["started"] and holder["command"] == "train"
    # a second command, here or anywhere: refused, naming the holder and the fix
    with pytest.raises(RunDirLockedError) as refused:
        RunLock([tmp_path], "train").acquire()
    message = str(refused.value)
    assert (
        f"{tmp_path} is in use by another megatron-gndpo run: pid {os.getpid()} on host" in message
    )
    assert f"rm {tmp_path / LOCK_FILE}" in message and "logging.run_dir" in message
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()  # released at exit

    # stale: the holder's pid is dead (a kill -9) -> taken over, with a warning
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _holder(tmp_path / LOCK_FILE, pid=dead.pid)
    with RunLock([tmp_path], "train", say=said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"pid {dead.pid} on host" in said[0]
    assert "it is no longer running: taking it over" in said[0]

    me = {"host": "here", "pid": 1, "boot_id": "b", "slurm_job": "77", "slurm_restart": 1}
    other = {"host": "there", "pid": 123, "slurm_job": "77", "slurm_restart": 0}
    assert "Slurm requeued its job 77" in (stale_reason(other, me) or "")  # a requeue elsewhere
    assert stale_reason(other | {"slurm_job": None}, me) is None  # another host: refused
    assert stale_reason(other | {"slurm_restart": 1}, me) is None  # the same start: alive
    # an unreadable lock file: named as such, refused (not silently ignored)
    (tmp_path / LOCK_FILE).write_text("{not json")
    os.utime(tmp_path / LOCK_FILE, (time.time() - 60, time.time() - 60))
    with pytest.raises(RunDirLockedError, match="an unreadable lock file"):
        RunLock([tmp_path], "train").acquire()


# ---------------------------------------------------------------------------------------------
# 2. Conversion never overwrites what it did not write


def _fake_step(root: Path, step: int, *, has_optimizer: bool) -> Path:
    directory = root / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    meta = {"step": step, "run_id": "r" if has_optimizer else None, "has_optimizer": has_optimizer}
    (directory / "megatron_gndpo.json").write_text(json.dumps(meta))
    return directory


def test_conversion_refuses_outputs_it_would_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_gndpo.checkpoint.convert_cli import check_output
    from megatron_gndpo.checkpoint.dist import _not_a_resume_point
    from megatron_gndpo.cli import main
    from megatron_gndpo.errors import ConversionError

    users = tmp_path / "mine"
    users.mkdir()
    (users / "config.json").write_text("{}")  # the user's own file
    with pytest.raises(
        ConversionError, match=r"is not empty \(it holds config\.json\).*--overwrite"
    ):
        check_output(users, overwrite=False)
    check_output(users, overwrite=True)  # asked for
    check_output(tmp_path / "new", overwrite=False)
    run = tmp_path / "run" / "checkpoints"
    _fake_step(run, 2, has_optimizer=True)
    for overwrite in (False, True):  # a run's checkpoints: never
        with pytest.raises(ConversionError, match=r"holds a training run's checkpoints \(newest"):
            check_output(run, overwrite=overwrite)
    # through the command: one line, exit 2, nothing written
    argv = ["convert", "hf-to-mcore", "--hf-dir", str(tmp_path), "--out", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("megatron-gndpo: error:") == 1 and "Traceback" not in err
    assert "a conversion never writes there" in err
    assert sorted(p.name for p in run.iterdir()) == ["iter_0000002"]
    assert main(["convert", "mcore-to-hf", "--mcore-dir", str(run), "--out", str(users)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (users / "config.json").read_text() == "{}"
    # the model-only message names the intact training step beside it
    converted = _fake_step(run, 0, has_optimizer=False)
    message = _not_a_resume_point(converted, foreign=False)
    assert f"also holds {run / 'iter_0000002'}, a complete training checkpoint" in message
    assert f"echo 2 > {run / 'latest'}" in message


# ---------------------------------------------------------------------------------------------
# 3. Another tokenizer is refused on resume


def test_resume_with_another_tokenizer_is_refused_with_the_fix(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import CheckpointError
    from megatron_gndpo.checkpoint.resume import TokenizerStamp, restore_run_state

    saved = TokenizerStamp("tok_a", "aaaa").state_dict()
    restore_run_state({"tokenizer": TokenizerStamp("tok_b", "aaaa")}, {"tokenizer": saved})
    with pytest.raises(CheckpointError) as refused:
        restore_run_state(
            {"tokenizer": TokenizerStamp("tok_b", "bbbb")}, {"tokenizer": saved}, tmp_path
        )
    message = str(refused.value)
    assert message.startswith(f"cannot resume from {tmp_path}: the checkpoint was trained with")
    assert "tokenizer tok_a and this run's data.tokenizer (tok_b) has another vocabulary" in message
    assert "checkpoint.init" in message
    restore_run_state({"tokenizer": TokenizerStamp("tok_b", "bbbb")}, {})  # saved before stamps


# ---------------------------------------------------------------------------------------------
# 4. Loading a checkpoint runs no pickled code


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _dcp_checkpoint(directory: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)


def _dcp_load(directory: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)


def test_a_planted_pickle_runs_nothing_in_a_checkpoint_load(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_gndpo.compat import safe_pickle

    # the patch is still needed: the installed torch unpickles both without restriction
    assert safe_pickle.still_unrestricted() == {"read_metadata": True, "load_bytes": True}
    marker = tmp_path / MARKER_NAME
    # (a) a planted .metadata (the manifest's checksum can be planted with it)
    good = tmp_path / "metadata"
    _dcp_checkpoint(good, {"w": torch.ones(3)})
    _dcp_load(good, {"w": torch.zeros(3)})  # what a checkpoint needs still loads
    with safe_pickle.restricted_unpickling():
        out: dict[str, Any] = {"w": torch.zeros(3), "obj": io.BytesIO()}
        args = argparse.Namespace(lr=1e-3)  # Megatron-LM's args, in our common state too
        _dcp_checkpoint(tmp_path / "ok", {"w": torch.ones(3), "obj": args})
        _dcp_load(tmp_path / "ok", out)
        assert out["obj"] == args and out["w"].sum() == 3
    (good / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with safe_pickle.restricted_unpickling(), pytest.raises(CheckpointException) as err:
        _dcp_load(good, {"w": torch.zeros(3)})  # torch wraps the refusal
    assert "holds a pickled posix.system, which a safe load does not run" in str(err.value)
    assert safe_pickle.TRUST_ENV in str(err.value) and not marker.exists()
    # (b) a planted non-tensor item (megatron's common state is one)
    item = tmp_path / "item"
    _dcp_checkpoint(item, {"obj": _Planted(marker)})
    with safe_pickle.restricted_unpickling(), pytest.raises(CheckpointException) as failed:
        _dcp_load(item, {"obj": io.BytesIO()})
    assert "posix.system" in str(failed.value) and not marker.exists()
    # without the restriction it runs: what the patch is for
    _dcp_load(item, {"obj": io.BytesIO()})
    assert marker.exists()


def test_in_flight_batches_load_without_unpickling_code(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from megatron_gndpo.rollout.base import Rollout
    from megatron_gndpo.rollout.remote import INFLIGHT_DIR, Result, load_inflight, save_inflight

    rollout = Rollout(
        tokens=torch.arange(6).view(2, 3), prompt_lengths=torch.tensor([1, 1]),
        lengths=torch.tensor([3, 2]), sampler_logprobs=torch.zeros(2, 3),
        prompt_index=torch.tensor([0, 0]), finished=torch.tensor([True, False]),
    )  # fmt: skip
    result = Result(batch=3, replica=0, rollout=rollout, version=1, seconds=0.5)
    remote = SimpleNamespace(leader=True, replica=0, inflight=lambda: {3: result})
    save_inflight(tmp_path, remote, {3: ("train", [4, 5])})  # type: ignore[arg-type]
    torch.load(tmp_path / INFLIGHT_DIR / "dp0.pt", weights_only=True)  # plain data only
    ((loaded, drawn),) = load_inflight(tmp_path, 0).values()
    assert drawn == ("train", [4, 5]) and loaded.version == 1 and loaded.batch == 3
    assert torch.equal(loaded.rollout.tokens, rollout.tokens)
    # a file written before (pickled dataclasses) still loads, and nothing else would
    torch.save({3: (result, ("train", [4, 5]))}, tmp_path / INFLIGHT_DIR / "dp0.pt")
    ((loaded, drawn),) = load_inflight(tmp_path, 0).values()
    assert drawn == ("train", [4, 5]) and torch.equal(loaded.rollout.tokens, rollout.tokens)


# ---------------------------------------------------------------------------------------------
# 6. ~ and $VAR in paths


def test_home_and_variables_in_paths_are_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_gndpo.config import ConfigError, load_config

    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("ROOT", "/data")
    cfg = load_config(None, [
        "logging.run_dir=~/x", "data.train=$ROOT/p.jsonl", "checkpoint.save=${ROOT}/ck",
        "teacher.load=~/teacher",
    ])  # fmt: skip
    assert cfg.logging.run_dir == "/home/u/x" and cfg.data.train == "/data/p.jsonl"
    assert cfg.checkpoint.save == "/data/ck" and cfg.teacher.load == "/home/u/teacher"
    assert load_config(None, ["data.prompt_key=$ROOT"]).data.prompt_key == "$ROOT"  # not a path
    monkeypatch.delenv("NOPE", raising=False)
    with pytest.raises(
        ConfigError, match=r"logging\.run_dir=\$NOPE/run: the environment variable NOPE is not set"
    ):
        load_config(None, ["logging.run_dir=$NOPE/run"])


# ---------------------------------------------------------------------------------------------
# 7. Duplicate keys in a record


def test_a_key_given_twice_in_a_jsonl_record_is_an_error(tmp_path: Path) -> None:
    from megatron_gndpo.data import load_prompts
    from megatron_gndpo.errors import DataError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1 + 1 = ?", "answer": "2"}\n{"prompt": "a", "prompt": "b"}\n')
    with pytest.raises(
        DataError, match=r"p\.jsonl:2: the key 'prompt' appears twice in the record"
    ):
        load_prompts(str(path))


def test_the_sampler_refuses_other_prompts_of_the_same_count() -> None:
    from megatron_gndpo.data import PromptSampler
    from megatron_gndpo.errors import DataError

    def sampler(fingerprint: str | None) -> PromptSampler:
        return PromptSampler(
            8, prompts_per_step=2, dp_rank=0, dp_size=1, seed=1, fingerprint=fingerprint,
            source="data.train (p.jsonl)",
        )  # fmt: skip

    state = sampler("aaa").state_dict()
    sampler("aaa").load_state_dict(state)
    sampler(None).load_state_dict(state)
    with pytest.raises(DataError, match=r"data\.train \(p\.jsonl\) holds 8 prompts, as many as"):
        sampler("bbb").load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# 9. plan at any world size


def test_plan_time_does_not_grow_with_the_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_gndpo.cli import main
    from megatron_gndpo.parallel.groups import ParallelLayout

    for layout in (ParallelLayout(16, tp=2, pp=2), ParallelLayout(24, tp=2, cp=3, pp=2, ep=2)):
        for rank in range(layout.world_size):
            for dims in (("tp",), ("cp", "dp"), ("pp",), ("ep",), ("edp",), ("tp", "cp")):
                assert list(layout.group_range(rank, dims)) == layout.group_of(rank, dims)
    started = time.perf_counter()
    world = "1000000000"
    one = "rollout.samples_per_prompt=1"
    assert main(["plan", "-n", world, "rollout.prompts_per_step=1000000000", one]) == 0
    assert main(["plan", "-n", world, "rollout.prompts_per_step=500000000", one,
                 "rollout.disaggregate.ranks=500000000"]) == 0  # fmt: skip
    assert time.perf_counter() - started < 20  # was minutes (n = 1e5: 5 s)
    out = capsys.readouterr().out
    assert "0,1,2,3,...,999999999 (1000000000 ranks)" in out
    assert "ranks 500000000-999999999 only generate" in out
    assert main(["plan", "-n", world, "--ranks"]) == 2
    assert "--ranks lists every rank, one line each: at most 65,536" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 11. Ctrl-C


def test_ctrl_c_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_gndpo import cli

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_config", interrupted)
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["config", "show"]) == 130
    assert capsys.readouterr().err == "megatron-gndpo: interrupted (Ctrl-C)\n"


# ---------------------------------------------------------------------------------------------
# 12. Paths that are not files; upstream notices


def test_paths_that_are_not_files_say_what_they_are(tmp_path: Path) -> None:
    from megatron_gndpo.checks import check_paths
    from megatron_gndpo.config import ConfigError, load_config
    from megatron_gndpo.data import load_prompts
    from megatron_gndpo.errors import MissingFileError

    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"prompts\.jsonl is a directory, not a file"):
        check_paths(load_config(None, [f"data.train={folder}", f"logging.run_dir={tmp_path}"]))
    with pytest.raises(MissingFileError, match="is a directory, not a file"):
        load_prompts(str(folder))
    with pytest.raises(ConfigError, match="is a directory; name a YAML file"):
        load_config(tmp_path)
    # a pipe (what `<(...)` gives, as /dev/fd/N) is read like a file, without a suffix
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    check_paths(load_config(None, [f"data.train={fifo}", f"logging.run_dir={tmp_path}"]))
    pid = os.fork()
    if pid == 0:  # the writer end, as the shell's process substitution
        with open(fifo, "w") as f:
            f.write('{"prompt": "1 + 2 = ?", "answer": "3"}\n')
        os._exit(0)
    try:
        (example,) = load_prompts(str(fifo))
    finally:
        os.waitpid(pid, 0)
    assert (example.prompt, example.answer) == ("1 + 2 = ?", "3")
    read, write = os.pipe()
    os.write(write, b"trainer:\n  steps: 3\n")
    os.close(write)
    try:
        assert load_config(f"/dev/fd/{read}").trainer.steps == 3  # `--config <(...)`
    finally:
        os.close(read)


def test_known_notices_are_one_line_and_a_log_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging
    import warnings

    from megatron_gndpo.compat import notices

    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(notices.SHOW_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        notices.quiet_known_notices()
        try:
            for _ in range(3):
                warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)
                logging.getLogger("megatron.core.models.gpt.gpt_model").warning(
                    "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes"
                )
            notices.log_to(tmp_path / notices.NOTICES_FILE)
            warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", stacklevel=1)
        finally:
            notices.restore()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPTModel" not in err, err
    assert err.startswith("megatron-gndpo: known upstream notices (megatron-core's and torch's")
    logged = (tmp_path / notices.NOTICES_FILE).read_text().splitlines()
    assert logged == [
        notices.FALLBACK_LINE,
        "megatron.core.models.gpt.gpt_model: GPTModel IS DEPRECATED. GPTModel is only accepting "
        "critical bug fixes",
        "known upstream notice: `torch.distributed.all_gather_into_tensor` is deprecated",
    ]


# ---------------------------------------------------------------------------------------------
# Issue 48: what a hostile user found in the newer features (probe numbers as in the issue)


def test_a_run_locks_its_checkpoint_directory_too(tmp_path: Path) -> None:
    """Probe 4: while run A trained in R, a run with its own run directory but
    checkpoint.save=R/checkpoints was accepted, moved A's checkpoints aside and wrote A's steps."""
    from megatron_gndpo.cli import _lock_run_dirs
    from megatron_gndpo.config import load_config
    from megatron_gndpo.job.runlock import LOCK_FILE, RunDirLockedError

    a = load_config(None, [f"logging.run_dir={tmp_path / 'R'}"])
    others = f"checkpoint.save={tmp_path / 'R' / 'checkpoints'}"
    b = load_config(None, [f"logging.run_dir={tmp_path / 'R2'}", others])
    lock = _lock_run_dirs(a, 0)
    assert lock is not None
    try:
        with pytest.raises(RunDirLockedError) as refused:
            _lock_run_dirs(b, 0)
        assert str(refused.value).startswith(
            f"{tmp_path / 'R' / 'checkpoints'} is in use by another megatron-gndpo run: pid "
            f"{os.getpid()}"
        )
        assert not (tmp_path / "R2" / LOCK_FILE).exists()  # what B took, B gave back
    finally:
        lock.release()
    assert not list(tmp_path.rglob(LOCK_FILE))


def test_a_lock_that_cannot_be_taken_over_or_created_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe 13: a stale lock that cannot be renamed was a PermissionError traceback from
    runlock._take. Here the rename and the creation fail as they do on an immutable file or a
    read-only directory, for any user; :func:`test_a_real_immutable_lock_is_one_line` makes the
    file immutable for real (``chattr +i``, as root)."""
    import errno

    from megatron_gndpo.job import runlock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _holder(tmp_path / runlock.LOCK_FILE, pid=dead.pid)

    def immutable(src: Any, dst: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(runlock.os, "rename", immutable)
    with pytest.raises(runlock.RunDirLockedError) as refused:
        runlock.RunLock([tmp_path], "train").acquire()
    lock = tmp_path / runlock.LOCK_FILE
    assert str(refused.value) == (
        f"{lock} names pid {dead.pid} on host {socket.gethostname()} (started then), and it is "
        "no longer running, but the lock cannot be taken over: renaming it failed (Operation not "
        f"permitted). Remove it yourself: rm -f {lock} (an immutable file needs chattr -i {lock} "
        "first)"
    )
    monkeypatch.undo()
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(runlock.RunLock, "_create", lambda self, path: immutable(path, path))
    with pytest.raises(runlock.RunDirLockedError, match=r"cannot create the lock file .*ro/"):
        runlock.RunLock([tmp_path / "ro"], "train").acquire()


def test_the_demos_tokenizer_directory_is_its_sentencepiece_model(tmp_path: Path) -> None:
    """Probe 8: ``--tokenizer DIR`` / ``teacher.tokenizer=DIR`` on the demo's tokenizer directory
    (its tokenizer.json is the demo's note, not a Hugging Face tokenizer): KeyError 'added_tokens'
    from transformers, 26-36 lines."""
    from megatron_gndpo.data.tasks import chains
    from megatron_gndpo.data.tokenizer import SentencePieceTokenizer, load_tokenizer
    from megatron_gndpo.demo.tokenizer import task_corpus, train_tokenizer
    from megatron_gndpo.errors import DataError

    problems = chains.generate(100, seed=3, difficulty=chains.DEFAULT_DIFFICULTY)
    trained = train_tokenizer(
        tmp_path / "demo", task_corpus((p.prompt, p.solution) for p in problems)
    )
    loaded = load_tokenizer(str(tmp_path / "demo"))
    assert isinstance(loaded, SentencePieceTokenizer)
    assert loaded.fingerprint() == trained.fingerprint()
    note = tmp_path / "note_only"  # a tokenizer.json that is no tokenizer, and nothing else
    note.mkdir()
    (note / "tokenizer.json").write_text((tmp_path / "demo" / "tokenizer.json").read_text())
    with pytest.raises(DataError, match=r"tokenizer\.json is not a Hugging Face tokenizer"):
        load_tokenizer(str(note))


@pytest.mark.parametrize("how", ["enospc", "torch"])
def test_a_full_disk_at_save_is_one_line_naming_the_disk_and_the_intact_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Probe 9: a full disk at save printed 45 lines and two CheckpointException tracebacks.
    Both ways a full disk makes the write fail, each on its own: ``OSError(ENOSPC)``, and
    torch's CheckpointException around its zip writer's RuntimeError, which has no errno (what a
    real 3 MB tmpfs gives: :func:`test_a_real_full_disk_stops_a_run_in_one_line`, which needs
    root), and the same failures on a disk with room, which keep their own errors."""
    import errno
    import shutil as shutil_module
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_gndpo.checkpoint import disk, dist
    from megatron_gndpo.checkpoint.errors import CheckpointError

    root = tmp_path / "checkpoints"
    intact = _fake_step(root, 1, has_optimizer=True)
    (root / "latest").write_text("1\n")
    (intact / "__0_0.distcp").write_bytes(b"w" * 4096)

    def full_disk(tmp: Path, *args: Any) -> None:
        (tmp / "__0_0.distcp").write_bytes(b"w" * 100)  # half a step
        if how == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})

    usage = namedtuple("usage", "total used free")
    room = shutil_module.disk_usage
    monkeypatch.setattr(dist, "_write_step", full_disk)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda _: usage(3 << 20, 3 << 20, 0))
    with pytest.raises(CheckpointError) as err:
        dist.save_checkpoint(root, 2, torch.nn.Linear(4, 4))
    assert str(err.value) == (
        f"cannot save step 2: the disk of {root} is full (mounted at {disk._mount_point(root)}, "
        "3.0 MiB: 0 bytes left when the save stopped). Nothing of step 2 was kept and nothing "
        f"saved before was touched: the newest checkpoint, {intact}, is intact and the same "
        "command resumes from it. Free space there, or point checkpoint.save at a larger disk "
        "(checkpoint.keep_last=1 keeps one step)"
    )
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "latest"]
    # a failure on a disk with room to spare is no full disk: it keeps its own error
    monkeypatch.setattr(disk.shutil, "disk_usage", room)

    def broken(tmp: Path, *args: Any) -> None:
        if how == "enospc":
            raise OSError(errno.EIO, "Input/output error")
        raise CheckpointException("write", {0: (RuntimeError("a bug"), None)})

    monkeypatch.setattr(dist, "_write_step", broken)
    with pytest.raises(OSError if how == "enospc" else CheckpointException):
        dist.save_checkpoint(root, 2, torch.nn.Linear(4, 4))
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "latest"]


def test_a_truncated_config_json_is_one_line_before_any_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probe 12: ``convert hf-to-mcore`` on a truncated config.json was a JSONDecodeError
    traceback (29 lines), after the distributed start-up."""
    import torch.distributed as dist

    from megatron_gndpo.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_si')
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"megatron-gndpo: error: {hf / 'config.json'} is not valid JSON (Unterminated string "
        "starting at: line 1, column 25): the file is truncated or damaged; copy or download it "
        "again\n"
    ), err
    assert "Traceback" not in err and not dist.is_initialized()


# ---------------------------------------------------------------------------------------------
# The story on a real run (one process each, the tiny config): items 3, 4, 7, 10, 11, 12


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _prompts(path: Path, offset: int) -> None:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{i} + {offset} = ?", "answer": str(i + offset)}) + "\n"
            for i in range(8)
        )
    )


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.megatron
def test_a_hostile_session_on_a_real_run(tmp_path: Path) -> None:
    data, run = tmp_path / "p.jsonl", tmp_path / "run"
    _prompts(data, 0)
    train = (
        "train", "-c", str(TINY), f"logging.run_dir={run}", f"data.train={data}",
        "algorithm.estimator=grpo", "algorithm.filter.drop_zero_variance_groups=true",
    )  # fmt: skip
    # 10: every step skipped (all rewards 0 on the random tiny model) is said, and saved
    first = _cli(*train, "trainer.steps=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 1 skipped: algorithm.filter dropped every row (zero_variance 100%)" in first.stderr
    step1 = run / "checkpoints" / "iter_0000001"
    assert not list((run / "checkpoints").glob("*.tmp"))
    extra = json.loads((step1 / "megatron_gndpo.json").read_text())["extra"]
    assert len(extra["tokenizer"]["fingerprint"]) == 64  # 3: the vocabulary, for the resume
    assert len(extra["sampler"]["fingerprint"]) == 64  # 7: the prompts' content
    # 12: upstream notices are one line, the rest in the run's log file
    upstream = [ln for ln in first.stderr.splitlines() if "upstream" in ln or "DEPRECATED" in ln]
    assert upstream == [
        "megatron-gndpo: known upstream notices (megatron-core's and torch's deprecations and "
        f"CPU fallbacks, expected here) are collected in {run / 'upstream_notices.log'}"
    ], first.stderr
    assert "GPTModel IS DEPRECATED" in (run / "upstream_notices.log").read_text()
    assert not (run / "megatron-gndpo.lock").exists()  # 1: released at the end

    # 7: the prompt file rewritten with as many records
    _prompts(data, 1)
    line = _one_error(_cli(*train, "trainer.steps=2", cwd=tmp_path))
    assert f"cannot resume from {step1}: data.train ({data}) holds 8 prompts" in line
    _prompts(data, 0)
    # 11: converting a training checkpoint without --family: one line, exit 2
    out = tmp_path / "hf"
    line = _one_error(
        _cli("convert", "mcore-to-hf", "--mcore-dir", str(step1.parent), "--out", str(out),
             cwd=tmp_path)
    )  # fmt: skip
    assert "pass --family (one of llama, qwen2, qwen3, qwen3_moe)" in line
    # 10: the run resumes from the step it saved without an optimizer step
    second = _cli(*train, "trainer.steps=2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {step1} at step 1" in second.stdout
    # 4: a planted .metadata, its checksum planted too: refused, and nothing runs
    step2 = run / "checkpoints" / "iter_0000002"
    marker = tmp_path / MARKER_NAME
    (step2 / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    meta = json.loads((step2 / "megatron_gndpo.json").read_text())
    meta["files"][".metadata"] = {
        "bytes": (step2 / ".metadata").stat().st_size,
        "sha256": hashlib.sha256((step2 / ".metadata").read_bytes()).hexdigest(),
    }
    (step2 / "megatron_gndpo.json").write_text(json.dumps(meta))
    line = _one_error(_cli(*train, "trainer.steps=3", cwd=tmp_path))
    assert f"cannot load {step2}: {step2 / '.metadata'} holds a pickled posix.system" in line
    assert not marker.exists()


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount, chattr): CI runs as root")


def test_a_real_full_disk_stops_a_run_in_one_line(tmp_path: Path) -> None:
    """Probe 9 on a real disk: the tiny run saving every step on a 3 MB tmpfs fills it at step
    2; one line names the disk and the intact step 1, which stays as it was."""
    _as_root()
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        run = disk / "run"
        proc = _cli(
            "train", f"logging.run_dir={run}", "checkpoint.save_interval=1", "trainer.steps=6",
            cwd=tmp_path,
        )  # fmt: skip
        line = _one_error(proc)
        saved = run / "checkpoints"
        assert (
            f"cannot save step 2: the disk of {saved} is full (mounted at {disk}, 3.0 MiB" in line
        )
        assert f"the newest checkpoint, {saved / 'iter_0000001'}, is intact" in line
        assert not [p for p in saved.iterdir() if p.name.startswith("iter_0000002")]
        assert (saved / "latest").read_text().strip() == "1"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_real_immutable_lock_is_one_line(tmp_path: Path) -> None:
    """Probe 13 for real: a stale lock made immutable (``chattr +i``) cannot be taken over; one
    line says how to remove it."""
    _as_root()
    from megatron_gndpo.job import runlock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / runlock.LOCK_FILE
    _holder(lock, pid=dead.pid)
    if subprocess.run(["chattr", "+i", str(lock)], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable attribute")
    try:
        with pytest.raises(runlock.RunDirLockedError, match=r"cannot be taken over.*chattr -i"):
            runlock.RunLock([tmp_path], "train").acquire()
    finally:
        subprocess.run(["chattr", "-i", str(lock)], check=True)
