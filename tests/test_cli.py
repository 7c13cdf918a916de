"""The ``megatron-gndpo`` command: plan, config show|validate|fields, help, exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gndpo.cli import main
from megatron_gndpo.config import load_config, to_dict
from megatron_gndpo.config.docs import iter_fields
from megatron_gndpo.methods import METHODS
from megatron_gndpo.plan import plan
from tests.examples import EXAMPLES, example_world_size

QWEN3 = Path(__file__).resolve().parent.parent / "examples" / "qwen3-8b_from_32b.yaml"
# 256 ranks: student TP=8 (DP=32), teacher TP=8 x PP=4 (DP=8); 256 x 16 sequences split over DP.
BIG = [
    "plan",
    "--world-size",
    "256",
    "--config",
    str(QWEN3),
    "parallel.tensor_parallel=8",
    "teacher.parallel.tensor_parallel=8",
    "teacher.parallel.pipeline_parallel=4",
    "rollout.prompts_per_step=256",
]
RANK_LINE = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d,]+)$")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def resolved_yaml(out: str) -> dict:
    _, sep, tail = out.partition("--- resolved config ---\n")
    assert sep, "no resolved config in the output"
    return yaml.safe_load(tail.split("\nwrote ")[0])


def test_plan_256_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *BIG)
    assert (code, err) == (0, "")
    cfg = load_config(QWEN3, BIG[5:])
    student, teacher = plan(cfg, 256)
    assert "plan for 256 ranks" in out
    assert "student: TP=8 PP=1 CP=1 DP=32 (world 256)" in out
    assert "teacher: TP=8 PP=4 CP=1 DP=8 (world 256)" in out
    assert f"({student.total_params:,})" in out
    assert f"({teacher.total_params:,})" in out
    # one row per stage: stage, layers, params per rank
    for mp in (student, teacher):
        for st in mp.stages:
            row = (
                f"{st.stage:>5}  {st.first_layer:>4}-{st.last_layer:<4}  {st.params_per_rank:>14,}"
            )
            assert row in out, row
    assert len(teacher.stages) == 4
    assert "4096 sequences per step, 128 per student data-parallel rank" in out
    assert resolved_yaml(out) == to_dict(cfg)
    plan_text = out.split("--- resolved config ---")[0]
    assert not any(RANK_LINE.match(line) for line in plan_text.splitlines())  # no --ranks


def test_plan_ranks_lists_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *BIG, "--ranks")
    assert code == 0
    cfg = load_config(QWEN3, BIG[5:])
    plan_text = out.split("--- resolved config ---")[0]
    student_text, teacher_text = plan_text.split("\nteacher: ")
    for text, mp in zip((student_text, teacher_text), plan(cfg, 256), strict=True):
        rows = [RANK_LINE.match(line) for line in text.splitlines()]
        rows = [m for m in rows if m is not None]
        assert [int(m[1]) for m in rows] == list(range(256))
        for m in rows:
            rank = int(m[1])
            coords = mp.layout.coords(rank)
            assert [int(m[i]) for i in (2, 3, 4, 5)] == [
                coords[d] for d in ("tp", "cp", "dp", "pp")
            ]
            assert int(m[6].replace(",", "")) == mp.stages[coords["pp"]].params_per_rank


def test_plan_out_writes_the_resolved_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "run"
    code, out, _ = run(capsys, *BIG, "--out", str(out_dir))
    assert code == 0
    path = out_dir / "config.yaml"
    assert f"wrote {path}" in out
    assert load_config(path) == load_config(QWEN3, BIG[5:])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_at_its_world_size(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = example_world_size(example)
    code, out, err = run(capsys, "plan", "-c", str(example), "-n", str(n))
    assert (code, err) == (0, "")
    assert f"plan for {n} ranks" in out
    assert resolved_yaml(out) == to_dict(load_config(example))


def test_bad_config_exits_2_and_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "-n", "8", "parallel.tensor_parallel=3")
    assert code == 2
    assert out == ""
    assert err.startswith("megatron-gndpo: error: invalid configuration")
    assert "tensor_parallel (3)" in err
    assert "choose sizes whose product divides it" in err


def test_unknown_key_exits_2_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "config", "show", "algorithm.kl_clp=1")
    assert code == 2
    assert "did you mean algorithm.kl_clip?" in err


def test_missing_config_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "plan", "-c", str(tmp_path / "absent.yaml"))
    assert code == 2
    assert "absent.yaml" in err and "does not exist" in err


FIELDS = list(iter_fields())


def test_every_field_has_documentation() -> None:
    assert len(FIELDS) > 50
    undocumented = [f.key for f in FIELDS if not f.doc.strip()]
    assert not undocumented, f"fields without a docstring under them in schema.py: {undocumented}"


def test_config_fields_documents_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "fields")
    assert code == 0
    missing = [f.key for f in FIELDS if f"  {f.key} (" not in out]
    assert not missing, f"keys missing from `megatron-gndpo config fields`: {missing}"
    # a doc string reaches the listing (wrapped, so compare its first words)
    for f in FIELDS:
        assert " ".join(f.doc.split()[:3]) in " ".join(out.split()), f.key


@pytest.mark.parametrize(
    "argv", [["--help"], ["plan", "--help"], ["train", "--help"], ["config", "--help"]]
)
def test_help_is_a_page_that_points_at_the_fields(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48, probe 15: the help printed ~910 lines of fields, and the command list scrolled
    away; each help now fits a screen and names where the fields are."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 60, out
    assert "`megatron-gndpo config fields`" in " ".join(out.split())


def test_help_says_which_config_each_command_starts_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 48, probe 15: ``config show`` and ``train`` both said "(default: embedded)" but
    start from different configs; config's help did not say what its actions do; train's
    --world-size was described in plan's words (the launcher sets train's world size)."""
    helps = {}
    for command in ("train", "config", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert "default: the tiny CPU example, examples/tiny_cpu.yaml" in helps["train"]
    assert "--world-size" not in helps["train"]
    for command in ("config", "plan"):
        assert "default: the release defaults, with tiny models" in helps[command]
    assert "show: print the resolved configuration" in helps["config"]
    assert "validate: check it" in helps["config"] and "fields: every field" in helps["config"]
    assert "number of ranks (GPUs) to plan for (default: 8)" in helps["plan"]
    with pytest.raises(SystemExit):  # the README's measured time, not an older 15 minutes
        main(["demo", "--help"])
    assert "over 2 seeds (about 7 minutes on 2 CPU cores" in " ".join(
        capsys.readouterr().out.split()
    )


def test_undocumented_field_is_reported_with_an_empty_doc() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Section:
        documented: int = 1
        """Has a doc."""
        undocumented: int = 2

    docs = {f.key: f.doc for f in iter_fields(Section)}
    assert docs == {"documented": "Has a doc.", "undocumented": ""}


def test_config_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "show", "algorithm.kl_clip=2.5")
    assert code == 0
    assert yaml.safe_load(out) == to_dict(load_config(None, ["algorithm.kl_clip=2.5"]))


def test_config_validate(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "config", "validate")[:2] == (0, "config is valid\n")
    assert run(capsys, "config", "validate", "-n", "8")[:2] == (0, "config is valid for 8 ranks\n")
    bad = ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=3"]
    code, out, err = run(capsys, "config", "validate", "-n", "8", *bad)
    assert (code, out) == (2, "")
    assert "make it a multiple of 8" in err


def test_overrides_before_and_after_options(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse leaves positionals given after an option unparsed; they are overrides too.
    code, out, err = run(capsys, "plan", "trainer.steps=2", "-n", "4", "trainer.seed=3")
    assert (code, err) == (0, "")
    assert "plan for 4 ranks" in out
    resolved = resolved_yaml(out)["trainer"]
    assert (resolved["steps"], resolved["seed"]) == (2, 3)
    code, out, _ = run(capsys, "config", "show", "-n", "2", "trainer.steps=5")
    assert code == 0
    assert yaml.safe_load(out)["trainer"]["steps"] == 5


def test_unknown_option_is_still_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["config", "validate", "-n", "8", "--bogus"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_config_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "fields")
    assert code == 0
    assert "  algorithm.kl_clip (a number; default 5.0)" in out
    assert "  teacher.model.num_layers (an integer; default 4)" in out  # the teacher's default
    assert all(f"  {f.key} (" in out for f in FIELDS)
    # the names of the estimator keys come from the method registry, not the schema
    assert f"One of: {', '.join(METHODS)}." in " ".join(out.split())


def test_installed_console_script() -> None:
    script = Path(sys.executable).parent / "megatron-gndpo"
    assert script.is_file(), f"console script not installed next to {sys.executable}"
    proc = subprocess.run(
        [str(script), "plan", "-n", "8"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan for 8 ranks" in proc.stdout
    assert "student: TP=1 PP=1 CP=1 DP=8 (world 8)" in proc.stdout


# ---------------------------------------------------------------------------------------------
# One error boundary (issue 15): errors raised on purpose print once, exit 2, no traceback


def _train(tmp_path: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", "train", f"logging.run_dir={tmp_path / 'run'}",
         *overrides],
        capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_train_checks_every_path_before_building_anything(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    proc = _train(
        tmp_path, "data.train=/nonexistent/p.jsonl", "teacher.load=/nonexistent/teacher",
        "checkpoint.init=/nonexistent/init", "data.tokenizer=/nonexistent/tok.model",
        f"checkpoint.save={tmp_path / 'afile' / 'ckpt'}", timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("megatron-gndpo: error:") == 1
    for expected in (
        "data.train: prompt file /nonexistent/p.jsonl does not exist",
        "teacher.load: no checkpoint at /nonexistent/teacher",
        "checkpoint.init: no checkpoint at /nonexistent/init",
        "data.tokenizer: tokenizer /nonexistent/tok.model does not exist",
        f"checkpoint.save: {tmp_path / 'afile' / 'ckpt'} cannot be created: "
        f"{tmp_path / 'afile'} is a file",
    ):
        assert expected in proc.stderr, expected
    assert "GPTModel" not in proc.stderr  # nothing was built
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_bad_collective_timeout_is_one_message_not_a_traceback(
    tmp_path: Path, value: str
) -> None:
    """A timeout <= 0 once reached the rendezvous as it was (a 0 ms store timeout: C++ frames
    and a traceback, issue 15's probe c07); the world now starts with the default and the
    config check reports the key."""
    proc = _train(tmp_path, "trainer.steps=1", f"trainer.collective_timeout_s={value}",
                  timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "socket" not in proc.stderr
    assert f"trainer.collective_timeout_s must be > 0, got {float(value)}" in proc.stderr


@pytest.mark.megatron
def test_prompts_left_out_for_length_are_said_on_the_console(tmp_path: Path) -> None:
    """Before: only ``prompts/skipped_too_long`` in metrics.jsonl (issue 15's probe d06); and
    nothing at all about a training set smaller than a step (issue 48's probe 5)."""
    data = tmp_path / "p.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(7)]
    rows.append({"prompt": "1+" * 40 + "1=", "answer": "41"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _train(tmp_path, f"data.train={data}", "trainer.steps=1", "rollout.prompts_per_step=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("1 of 8 training prompts are longer than "
                             "rollout.max_prompt_length=48 tokens") == 1  # fmt: skip
    # issue 48, probe 5: fewer prompts than a step takes is said too, once
    assert proc.stderr.count(f"data.train ({data}) has 7 usable prompts, fewer than "
                             "rollout.prompts_per_step=8: each step repeats them (8 draws from "
                             "7 usable prompts)") == 1  # fmt: skip


@pytest.mark.megatron
def test_a_malformed_prompt_file_is_one_message_not_a_traceback(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=?", "answer": "2"}\n{"prompt": "2+2=",\n')
    proc = _train(tmp_path, f"data.train={data}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[rank0]:" not in proc.stderr.replace(
        "[rank0]:W", ""
    )  # torch's own start-up notice is prefixed [rank0]:W...
    assert proc.stderr.count("megatron-gndpo: error:") == 1
    assert f"megatron-gndpo: error: {data}:2: invalid JSON" in proc.stderr
    assert "GPTModel" not in proc.stderr  # the data is read before the models are built


@pytest.mark.megatron
def test_an_outcome_estimator_on_prompts_without_answers_stops_before_the_models(
    tmp_path: Path,
) -> None:
    """Issue 48, probe 11: the right message, but as a traceback at step 1, after the build."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(4)))
    proc = _train(tmp_path, f"data.train={data}", "algorithm.estimator=grpo")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("megatron-gndpo: error:") == 1
    assert (
        f"megatron-gndpo: error: algorithm.estimator=grpo trains on the verifiable reward, but 4 "
        f"of the 4 prompts of data.train ({data}) have no answer (the first: {data}:1) under "
        "data.answer_key='answer': add the answers" in proc.stderr
    )
    assert "GPTModel" not in proc.stderr  # before the models are built


def test_unexpected_exceptions_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_gndpo.cli as cli

    def broken(args: object) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_cmd_plan", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["plan"])


def test_a_user_error_from_any_command_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import megatron_gndpo.cli as cli
    from megatron_gndpo.errors import MissingFileError

    def missing(args: object) -> int:
        raise MissingFileError("prompt file x.jsonl does not exist; fix data.train")

    monkeypatch.setattr(cli, "_cmd_plan", missing)
    code, out, err = run(capsys, "plan")
    assert (code, out) == (2, "")
    assert err == "megatron-gndpo: error: prompt file x.jsonl does not exist; fix data.train\n"


def test_new_reliability_keys_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "config", "validate", "trainer.heartbeat_timeout_s=700",
        "checkpoint.start_fresh=true", "checkpoint.load=/somewhere",
    )  # fmt: skip
    assert code == 2
    assert "trainer.heartbeat_timeout_s (700.0) must be below trainer.collective_timeout_s" in err
    assert "checkpoint.start_fresh=true starts at step 1 but checkpoint.load names" in err


def test_plan_refuses_hardware_numbers_that_are_not_finite(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 48, probe 10, the command line's side: ``--gpu-memory-gib inf`` planned on."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--gpu-memory-gib", "inf"])
    assert exc.value.code == 2
    assert "--gpu-memory-gib: must be a finite number > 0, got inf" in capsys.readouterr().err


@pytest.mark.megatron
def test_the_first_ctrl_c_during_train_saves_the_step(tmp_path: Path) -> None:
    """Issue 48, probe 15: Ctrl-C during ``train`` stopped without saving (SIGTERM saved). The
    first Ctrl-C now ends the step, saves it and says so; exit 130 as for any Ctrl-C."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_gndpo.cli", "train", f"logging.run_dir={run_dir}",
         "trainer.steps=1000"],
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    saved = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert err.endswith(
        "megatron-gndpo: Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again stops "
        f"at once)\nmegatron-gndpo: interrupted (Ctrl-C): step {saved} is saved in "
        f"{run_dir / 'checkpoints'}, and the same command resumes from it\n"
    ), err[-3000:]


def test_the_demo_computes_with_its_own_thread_count_and_gives_it_back() -> None:
    """The demo's numbers depend on the thread count (docs/demo/RESULTS.md): it computes with
    --threads (2 by default, whatever the machine has) and restores the caller's afterwards."""
    import torch

    from megatron_gndpo import cli

    seen: dict[str, object] = {}

    def record(args: object) -> int:
        seen["torch"], seen["env"] = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
        return 0

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    original = cli._cmd_demo_pinned
    cli._cmd_demo_pinned = record  # type: ignore[assignment]
    try:
        args = cli.build_parser().parse_args(["demo", "--quick"])
        assert args.threads == cli.DEMO_THREADS == 2
        assert cli._cmd_demo(args) == 0 and seen == {"torch": 2, "env": "2"}
        args = cli.build_parser().parse_args(["demo", "--threads", "1"])
        assert cli._cmd_demo(args) == 0 and seen == {"torch": 1, "env": "1"}
    finally:
        cli._cmd_demo_pinned = original  # type: ignore[assignment]
    assert (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")) == (before, env)
