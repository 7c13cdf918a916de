"""Checkpoints: save -> kill -> load restores model and optimizer; TP=2 loads at TP=1; atomic."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_gndpo.checkpoint.dist import (
    START_FRESH,
    CheckpointError,
    latest_step,
    resolve,
    step_dir,
)
from megatron_gndpo.config.schema import OptimizerConfig, ParallelConfig
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 120
MODEL = tiny_model(vocab_size=VOCAB, max_position_embeddings=32)
OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)
SEQ, MICRO = 12, 2


def _student(tp: int, seed: int):  # type: ignore[no-untyped-def]
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.engine.optimizer import build_optimizer, wrap_ddp
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    world = torch.distributed.get_world_size()
    groups = build_student_groups(ParallelLayout(world, tp=tp), seed=seed)
    torch.manual_seed(seed)
    model = build_gpt(MODEL, ParallelConfig(tensor_parallel=tp), groups)
    ddp = wrap_ddp(model, use_distributed_optimizer=True)
    return groups, model, ddp, build_optimizer(ddp, OPTIMIZER)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(step))


def _train_step(ddp, optimizer, tokens: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, net):  # type: ignore[no-untyped-def]
        batch = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO, -1)
        out = net(batch, positions, attention_mask=None, labels=batch)
        return out, lambda o: (o.sum(), torch.tensor(o.numel(), dtype=torch.int), {})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[ddp],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=MICRO,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok
    return float(grad_norm)


def _logits(model, groups) -> torch.Tensor:  # type: ignore[no-untyped-def]
    tokens = _batch(1000)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO, -1)
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask=None)
    parts = [torch.empty_like(logits) for _ in range(groups.layout.tp)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=groups.tp)
    return torch.cat(parts, -1)[..., :VOCAB]


def _params(model) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_then_continue(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    groups, model, ddp, optimizer = _student(tp=2, seed=1)
    _train_step(ddp, optimizer, _batch(1))
    save_checkpoint(root, 1, ddp, optimizer=optimizer, extra={"data_position": 17})
    # megatron-core's writer would start a manager process here (compat/saving.py)
    children = [child.name for child in multiprocessing.active_children()]
    saved_logits = _logits(model, groups)
    saved = _params(model)
    norm = _train_step(ddp, optimizer, _batch(2))  # the step a resumed run must reproduce
    return {
        "saved": saved, "after": _params(model), "norm": norm, "logits": saved_logits,
        "children": children,
    }  # fmt: skip


def _resume_and_continue(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron_gndpo.checkpoint.dist import load_checkpoint

    _, model, ddp, optimizer = _student(tp=2, seed=99)  # different init: all must come from disk
    meta = load_checkpoint(root, ddp, optimizer=optimizer)
    loaded = _params(model)
    norm = _train_step(ddp, optimizer, _batch(2))
    return {"loaded": loaded, "after": _params(model), "norm": norm, "meta": meta}


def _load_at_tp1(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron_gndpo.checkpoint.dist import load_checkpoint

    groups, model, _, optimizer = _student(tp=1, seed=5)
    with pytest.raises(CheckpointError, match="optimizer"):
        load_checkpoint(root / Path("model_only"), model, optimizer=optimizer)
    meta = load_checkpoint(root, model)  # model only, resharded from TP=2 to TP=1
    return {"logits": _logits(model, groups), "meta": meta}


def _save_model_only(rank: int, world: int, root: str) -> None:
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    _, model, _, _ = _student(tp=1, seed=3)
    save_checkpoint(root, 0, model)


@pytest.mark.distributed
@pytest.mark.megatron
def test_save_kill_load_restores_model_and_optimizer_and_reshards(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = run_distributed(_save_then_continue, 2, args=(str(root),), timeout_s=300)
    assert latest_step(root) == 1
    # A save leaves no process behind that could outlive a killed rank.
    assert [rank["children"] for rank in first] == [[], []]

    # A save killed mid-way leaves a .tmp directory and does not move `latest`.
    (tmp_path / "ckpt" / "iter_0000002.tmp").mkdir()
    (tmp_path / "ckpt" / "iter_0000002.tmp" / "garbage").write_text("half written")
    assert latest_step(root) == 1

    resumed = run_distributed(_resume_and_continue, 2, args=(str(root),), timeout_s=300)
    for before, after in zip(first, resumed, strict=True):
        assert after["meta"]["step"] == 1 and after["meta"]["extra"] == {"data_position": 17}
        for name, tensor in before["saved"].items():
            assert torch.equal(tensor, after["loaded"][name]), f"{name} not restored"
        # Same next step => the Adam moments and step count were restored too.
        assert before["norm"] == pytest.approx(after["norm"], rel=1e-6)
        for name, tensor in before["after"].items():
            torch.testing.assert_close(tensor, after["after"][name], rtol=1e-6, atol=1e-7)

    run_distributed(_save_model_only, 1, args=(str(root / "model_only"),), timeout_s=300)
    tp1 = run_distributed(_load_at_tp1, 1, args=(str(root),), timeout_s=300)[0]
    torch.testing.assert_close(tp1["logits"], first[0]["logits"], rtol=1e-5, atol=1e-5)


def _tiny_logprobs(net) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-probs over the tiny example's 128 real tokens, ``[b, s, 128]``."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = net(tokens, torch.arange(16).expand(2, -1), None)
    return logits[..., :128].double().log_softmax(-1)


def _other_padding(rank: int, world: int, root: str) -> dict[str, object]:
    """The tiny example (128 tokens) saved with its embedding padded to 256 rows, loaded as
    init and teacher by a run padding to 128 (rows dropped) and back (rows added)."""
    from megatron_gndpo.checkpoint.convert import describe_checkpoints
    from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_gndpo.models.gpt import build_gpt
    from tests.trainers import reset_megatron, tiny_trainer

    def save(name: str, net, model) -> None:  # type: ignore[no-untyped-def]
        save_checkpoint(f"{root}/{name}", 0, net)
        describe_checkpoints(f"{root}/{name}", model)  # as training and conversion write it

    def rows(trainer) -> list[int]:  # type: ignore[no-untyped-def]
        nets = (trainer.c.student, trainer.c.teacher.model)
        return [net.output_layer.weight.shape[0] for net in nets]

    out: dict[str, object] = {}
    wide = [f"{m}.make_vocab_size_divisible_by=256" for m in ("model", "teacher.model")]
    first = tiny_trainer(f"{root}/run_wide", *wide)
    save("init", first.c.student, first.cfg.model)
    save("teacher", first.c.teacher.model, first.cfg.teacher.model)
    save_checkpoint(f"{root}/bare", 0, first.c.teacher.model)  # nothing beside it
    out["wide"] = [_tiny_logprobs(first.c.student), _tiny_logprobs(first.c.teacher.model)]
    out["wide_rows"] = rows(first)
    first.c.logger.close()
    reset_megatron()

    # Padding rows 128..255 hold random init (not zeros); model_config.yaml says they are padding.
    load = [f"checkpoint.init={root}/init", f"teacher.load={root}/teacher"]
    second = tiny_trainer(f"{root}/run_narrow", *load)
    out["narrow"] = [_tiny_logprobs(second.c.student), _tiny_logprobs(second.c.teacher.model)]
    out["narrow_rows"] = rows(second)
    try:
        load_checkpoint(f"{root}/bare", second.c.teacher.model, vocab_size=128)
    except CheckpointError as err:
        out["bare"] = str(err)
    save("narrow_init", second.c.student, second.cfg.model)
    narrow_model = second.cfg.model
    save("narrow_teacher", second.c.teacher.model, second.cfg.teacher.model)
    second.c.logger.close()
    reset_megatron()

    back = [f"checkpoint.init={root}/narrow_init", f"teacher.load={root}/narrow_teacher"]
    third = tiny_trainer(f"{root}/run_back", *wide, *back)
    out["back"] = [_tiny_logprobs(third.c.student), _tiny_logprobs(third.c.teacher.model)]
    out["back_padding"] = float(third.c.student.output_layer.weight[128:].detach().abs().max())
    try:
        load_checkpoint(f"{root}/narrow_init", third.c.student, vocab_size=200)
    except CheckpointError as err:
        out["too_few"] = str(err)
    # Zero padding rows (as converters write them) are dropped with nothing beside them.
    save_checkpoint(f"{root}/zero_padded", 0, third.c.student)
    narrow = build_gpt(narrow_model, ParallelConfig(), third.c.student_groups)
    load_checkpoint(f"{root}/zero_padded", narrow, vocab_size=128)
    out["zero_padded"] = _tiny_logprobs(narrow)
    third.c.logger.close()
    reset_megatron()
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_checkpoint_with_another_vocab_padding_loads_as_init_and_teacher(
    tmp_path: Path,
) -> None:
    out = run_distributed(_other_padding, 1, args=(str(tmp_path),), timeout_s=300)[0]
    assert out["wide_rows"] == [256, 256] and out["narrow_rows"] == [128, 128]
    for name in ("narrow", "back"):
        for original, loaded in zip(out["wide"], out[name], strict=True):  # student, teacher
            torch.testing.assert_close(loaded, original, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["zero_padded"], out["wide"][0], rtol=0, atol=1e-6)
    assert out["back_padding"] == 0.0  # rows the checkpoint lacks load as zeros
    bare = out.get("bare", "")
    assert re.search(r"embedding\.word_embeddings\.weight in .*bare/iter_0000000 has 256 rows",
                     bare), bare  # fmt: skip
    assert "rows 128..255 (128 of those it would drop) are not zero" in bare
    assert f"write its model config to {tmp_path / 'bare' / 'model_config.yaml'}" in bare
    too_few = out.get("too_few", "")
    assert "has 128 rows, fewer than the model's vocab_size (200)" in too_few, too_few


def test_latest_and_resolve_errors_name_the_fix(tmp_path: Path) -> None:
    assert latest_step(tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve(tmp_path)
    (tmp_path / "latest").write_text("abc")
    with pytest.raises(CheckpointError, match="corrupt"):
        latest_step(tmp_path)
    (tmp_path / "latest").write_text("7\n")
    with pytest.raises(CheckpointError, match="incomplete or missing"):
        latest_step(tmp_path)
    done = step_dir(tmp_path, 7)
    done.mkdir()
    (done / "megatron_gndpo.json").write_text(json.dumps({"step": 7}))
    assert latest_step(tmp_path) == 7
    assert resolve(tmp_path) == done
    assert resolve(done) == done
    # Megatron-LM's tracker, when there is no `latest`, must name a complete dist checkpoint
    other = tmp_path / "mlm"
    other.mkdir()
    (other / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(CheckpointError, match=r"tracker names step 5 but .*iter_0000005 is not a"):
        resolve(other)
    step_dir(other, 5).mkdir()
    (step_dir(other, 5) / "metadata.json").write_text("{}")
    assert resolve(other) == step_dir(other, 5)


# ---------------------------------------------------------------------------------------------
# Integrity, lineage and where a run starts (issue 15): file-system checks, no model needed


def _fake_step(
    root: Path, step: int, *, run_id: str | None = "run-a", manifest: bool = True
) -> Path:
    """A step directory as save_checkpoint leaves it, with made-up tensor files."""
    from megatron_gndpo.checkpoint.dist import _manifest

    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (directory / ".metadata").write_bytes(b"metadata of step %d" % step)
    meta = {"step": step, "run_id": run_id, "has_optimizer": True, "extra": {}}
    if manifest:
        meta["files"] = _manifest(directory)
    (directory / "megatron_gndpo.json").write_text(json.dumps(meta))
    return directory


def test_verify_step_names_each_damaged_file(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import CorruptCheckpointError, verify_step

    good = _fake_step(tmp_path, 1)
    assert verify_step(good) is True
    assert verify_step(_fake_step(tmp_path, 2, manifest=False)) is False  # older: nothing to check
    bad = _fake_step(tmp_path, 3)
    data = bytearray((bad / "__0_0.distcp").read_bytes())
    data[100:108] = b"\xff" * 8  # a few floats overwritten, same size
    (bad / "__0_0.distcp").write_bytes(bytes(data))
    (bad / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError) as err:
        verify_step(bad)
    msg = str(err.value)
    assert f"{bad} is corrupt" in msg
    assert "__0_0.distcp does not match the checksum saved with it" in msg
    assert ".metadata is missing" in msg
    truncated = _fake_step(tmp_path, 4)
    (truncated / "__0_0.distcp").write_bytes(b"short")
    with pytest.raises(
        CorruptCheckpointError, match=r"__0_0\.distcp has 5 bytes, 16384 were saved"
    ):
        verify_step(truncated)


class _Optimizer:
    """What nonfinite() reads of a megatron optimizer: the torch optimizer inside."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.optimizer = torch.optim.Adam(params)


def test_nonfinite_names_weights_and_optimizer_state() -> None:
    from megatron_gndpo.checkpoint.dist import nonfinite

    model = torch.nn.Linear(3, 2)
    optimizer = _Optimizer(list(model.parameters()))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.optimizer.step()
    assert nonfinite(model, optimizer) == []
    state = optimizer.optimizer.state[model.bias]
    state["exp_avg_sq"][0] = math.inf
    assert nonfinite(model, optimizer) == ["optimizer exp_avg_sq"]
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    assert nonfinite(model, optimizer) == [
        "optimizer exp_avg_sq",
        "optimizer master weights",
        "weight",
    ]


def test_save_refuses_non_finite_weights_and_writes_nothing(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    _fake_step(tmp_path, 2)
    (tmp_path / "latest").write_text("2\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.bias[1] = math.nan
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 3, model, run_id="run-a")
    msg = str(err.value)
    assert "refusing to save step 3: non-finite values (NaN or inf) in bias" in msg
    assert f"Nothing was written; the newest checkpoint, {step_dir(tmp_path, 2)}, is intact" in msg
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_save_refuses_to_overwrite_another_runs_step(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    _fake_step(tmp_path, 5, run_id="run-a")
    with pytest.raises(CheckpointError, match=r"belongs to another run \(run id run-a\)"):
        save_checkpoint(tmp_path, 5, torch.nn.Linear(2, 2), run_id="run-b")


def test_prune_keeps_other_runs_and_older_versions_steps(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import _prune, complete_steps

    for step, run in ((1, "run-a"), (2, "run-b"), (3, "run-a"), (4, None), (5, "run-a")):
        _fake_step(tmp_path, step, run_id=run)
    (tmp_path / "iter_0000006.tmp").mkdir()
    _prune(tmp_path, 1, "run-a")
    assert complete_steps(tmp_path) == [2, 4, 5]  # run-a's 1 and 3 only
    assert not (tmp_path / "iter_0000006.tmp").exists()


def test_latest_errors_point_at_a_complete_step_not_at_deleting(tmp_path: Path) -> None:
    _fake_step(tmp_path, 3)
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(CheckpointError) as err:
        latest_step(tmp_path, instead=START_FRESH)  # a run resuming from its save directory
    msg = str(err.value)
    assert "delete" not in msg  # deleting `latest` used to start over on top of the iterations
    assert f"echo 3 > {tmp_path / 'latest'}" in msg and "checkpoint.start_fresh=true" in msg
    with pytest.raises(CheckpointError) as err:  # reading a checkpoint (a teacher, prune)
        latest_step(tmp_path)
    assert "name a complete iter_* step directory instead of its root" in str(err.value)
    assert "checkpoint.start_fresh" not in str(err.value)
    (tmp_path / "latest").write_text("9\n")
    with pytest.raises(CheckpointError, match=rf"echo 3 > {re.escape(str(tmp_path))}/latest"):
        latest_step(tmp_path)


def test_plan_start_refuses_a_silent_fresh_start_over_iterations(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.resume import plan_start
    from megatron_gndpo.config.schema import CheckpointConfig

    save = tmp_path / "ckpt"
    assert plan_start(CheckpointConfig(), save).candidates == ()  # nothing there: step 0
    for step in (1, 2):
        _fake_step(save, step)
    with pytest.raises(CheckpointError) as err:  # `latest` deleted, iterations remain
        plan_start(CheckpointConfig(), save)
    msg = str(err.value)
    assert "holds 2 iteration(s) (steps 1, 2) but no 'latest' file" in msg
    assert f"checkpoint.load={step_dir(save, 2)}" in msg and "checkpoint.start_fresh=true" in msg
    fresh = plan_start(CheckpointConfig(start_fresh=True), save)
    assert fresh.start_fresh and fresh.candidates == ()
    (save / "latest").write_text("2\n")
    assert plan_start(CheckpointConfig(), save).candidates == (step_dir(save, 2), step_dir(save, 1))
    rollback = plan_start(CheckpointConfig(load=str(step_dir(save, 1))), save)
    assert rollback.candidates == (step_dir(save, 1),) and rollback.explicit
    other = tmp_path / "other"
    _fake_step(other, 7)
    with pytest.raises(CheckpointError, match=r"outside the save directory .* already holds"):
        plan_start(CheckpointConfig(load=str(step_dir(other, 7))), save)
    empty = tmp_path / "empty"
    assert plan_start(CheckpointConfig(load=str(other / "iter_0000007")), empty).candidates == (
        step_dir(other, 7),
    )


def test_resume_falls_back_loudly_past_corrupt_steps_only(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.dist import CorruptCheckpointError
    from megatron_gndpo.checkpoint.resume import StartPlan, resume_from

    steps = [_fake_step(tmp_path, s) for s in (3, 2, 1)]
    plan = StartPlan(tmp_path, tuple(steps), explicit=False, start_fresh=False)  # newest first
    said: list[str] = []

    def load(directory: Path) -> dict[str, object]:
        if directory.name in ("iter_0000003", "iter_0000002"):
            raise CorruptCheckpointError(f"{directory} is corrupt: __0_0.distcp is missing")
        return {"step": 1, "run_id": "run-a", "verified": True, "extra": {}}

    resumed = resume_from(plan, load, say=said.append)
    assert (resumed.step, resumed.run_id, resumed.directory) == (1, "run-a", step_dir(tmp_path, 1))
    assert len(said) == 1
    assert "iter_0000003 is corrupt" in said[0] and "iter_0000002 is corrupt" in said[0]
    assert (
        f"Resuming from the newest intact checkpoint, {step_dir(tmp_path, 1)} (step 1)" in said[0]
    )

    def all_corrupt(directory: Path) -> dict[str, object]:
        raise CorruptCheckpointError(f"{directory} is corrupt: it is")

    with pytest.raises(CheckpointError, match="no intact checkpoint to resume from"):
        resume_from(plan, all_corrupt, say=said.append)

    def mismatch(directory: Path) -> dict[str, object]:  # another architecture: no fallback
        raise CheckpointError(f"could not load {directory}: Global shape mismatch")

    with pytest.raises(CheckpointError, match="Global shape mismatch") as err:
        resume_from(plan, mismatch, say=said.append)
    assert "saved without checksums" not in str(err.value)

    # checkpoint.verify=false: a truncated file fails like a mismatch (EOFError); the error says
    # how to tell them apart and names the previous step (issue 15's probe p08)
    def truncated(directory: Path) -> dict[str, object]:
        raise CheckpointError(f"could not load {directory}: EOFError")

    with pytest.raises(CheckpointError, match="EOFError") as err:
        resume_from(plan, truncated, verify=False)
    message = str(err.value)
    assert "checkpoint.verify=true" in message, message
    assert f"checkpoint.load={step_dir(tmp_path, 2)}" in message, message
    # and what it loads unverified is said as such, not as "saved by an older version"
    said.clear()
    resume_from(plan, lambda d: {"step": 3, "run_id": "a", "verified": False, "extra": {}},
                say=said.append, verify=False)  # fmt: skip
    assert said == [f"{step_dir(tmp_path, 3)} loaded without checking its checksums "
                    "(checkpoint.verify=false)"]  # fmt: skip


def test_set_aside_moves_what_the_run_does_not_continue(tmp_path: Path) -> None:
    from megatron_gndpo.checkpoint.resume import Resumed, StartPlan, set_aside

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        _fake_step(save, step)
    (save / "latest").write_text("3\n")
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    plan = StartPlan(save, (step_dir(save, 3),), explicit=False, start_fresh=False)
    # resumed at step 1 (2 and 3 corrupt, or a rollback): they move aside with the metrics
    aside = set_aside(plan, Resumed(1, "run-a", step_dir(save, 1)), metrics)
    assert aside is not None and aside.parent == save and aside.name.startswith("previous-")
    assert sorted(p.name for p in aside.iterdir()) == [
        "iter_0000002",
        "iter_0000003",
        "metrics.jsonl",
    ]
    assert (save / "latest").read_text().strip() == "1" and metrics.exists()
    # the trackers of Megatron-LM and Megatron-Bridge follow `latest`
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert torch.load(save / "latest_train_state.pt", weights_only=True)["step"].item() == 1
    # a fresh start moves everything, metrics included
    fresh = StartPlan(save, (), explicit=False, start_fresh=True)
    aside = set_aside(fresh, Resumed(0, "run-b", None), metrics)
    assert aside is not None
    assert sorted(p.name for p in aside.iterdir()) == [
        "iter_0000001", "latest", "latest_checkpointed_iteration.txt", "latest_train_state.pt",
        "metrics.jsonl",
    ]  # fmt: skip
    assert sorted(p.name for p in save.iterdir()) == sorted(p.name for p in save.glob("previous-*"))
    assert not metrics.exists()
    assert set_aside(fresh, Resumed(0, "run-c", None), metrics) is None  # nothing left to move


def test_vocab_rows_problem_names_rows_and_the_fix() -> None:
    from megatron_gndpo.checkpoint.vocab_rows import vocab_rows_problem

    key = "output_layer.weight"
    saved = {key: ((256, 8), torch.float32)}

    def problem(shape: tuple[int, ...], **kw) -> str:  # type: ignore[no-untyped-def]
        args = {"vocab_size": 100, "saved_vocab": None, "read": _no_read,
                "config_path": Path("ck/model_config.yaml")} | kw  # fmt: skip
        return vocab_rows_problem(Path("ck/iter_0000001"), {key: shape}, saved, **args)

    assert problem((256, 8)) == ""  # same rows: nothing read
    assert problem((128, 16)) == ""  # another width: the other tensors' shape check refuses it
    assert "fewer than the model's vocab_size (300): rows 256..299 would load" in problem(
        (384, 8), vocab_size=300
    )
    assert problem((128, 8), saved_vocab=120) == ""  # rows 128..255 are padding of 120 tokens
    assert "tokens 128..199 would be dropped. Set vocab_size to 200" in problem(
        (128, 8), saved_vocab=200
    )
    tail = torch.zeros(256, 8)
    assert problem((128, 8), read=lambda _: tail) == ""  # zero rows are padding
    tail[130, 3] = tail[140, 0] = 1.0
    assert "rows 130..140 (2 of those it would drop) are not zero" in problem(
        (128, 8), read=lambda _: tail
    )


def _no_read(key: str) -> torch.Tensor:
    raise AssertionError(f"{key} was read")


# ---------------------------------------------------------------------------------------------
# What Megatron-LM and Megatron-Bridge read beside the tensors (checkpoint/interop.py)

# args fields Megatron-LM reads: load_args_from_checkpoint (model args), check_checkpoint_args,
# load_checkpoint (layout, what the checkpoint holds); megatron/training/checkpointing.py
_MEGATRON_LM_ARGS = {
    "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
    "num_query_groups": 2, "group_query_attention": True, "kv_channels": 8,
    "max_position_embeddings": 32, "position_embedding_type": "rope",
    "add_position_embedding": False, "use_rotary_position_embeddings": True, "swiglu": True,
    "normalization": "RMSNorm", "add_bias_linear": False, "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": True, "make_vocab_size_divisible_by": 64,
    "padded_vocab_size": 128, "params_dtype": torch.float32, "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1, "world_size": 1, "data_parallel_size": 1,
    "no_save_optim": True, "no_save_rng": True, "consumed_train_samples": 0,
}  # fmt: skip
# TrainState.state_dict() of megatron/bridge/training/state.py: name -> dtype
_BRIDGE_TRAIN_STATE = {
    "step": torch.int64, "consumed_train_samples": torch.int64,
    "skipped_train_samples": torch.int64, "consumed_valid_samples": torch.int64,
    "floating_point_operations_so_far": torch.float64, "do_train": torch.bool,
    "do_valid": torch.bool, "do_test": torch.bool,
}  # fmt: skip


def _save_for_other_tools(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron.core import dist_checkpointing

    from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world), seed=1)
    model = build_gpt(MODEL, ParallelConfig(), groups)
    save_checkpoint(root, 3, model, model_config=MODEL)
    step = str(step_dir(root, 3))
    common = dist_checkpointing.load_common_state_dict(step)
    fresh = build_gpt(MODEL, ParallelConfig(), groups)
    meta = load_checkpoint(root, fresh)  # ours still loads it, every new file checksummed
    # The same step as the other tools leave it (no megatron_gndpo.json, no `latest`): found
    # through Megatron-LM's or Megatron-Bridge's tracker, loaded as initial weights.
    foreign = {}
    for tool, tracker in (("mlm", "latest_checkpointed_iteration.txt"),
                          ("bridge", "latest_train_state.pt")):  # fmt: skip
        shutil.copytree(step, f"{root}_{tool}/iter_0000003")
        Path(f"{root}_{tool}/iter_0000003/megatron_gndpo.json").unlink()
        shutil.copy(Path(root) / tracker, f"{root}_{tool}/{tracker}")
        other = build_gpt(MODEL, ParallelConfig(), groups)
        loaded = load_checkpoint(f"{root}_{tool}", other)
        foreign[tool] = (loaded["step"], loaded["verified"], all(
            torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters(), strict=True)
        ))  # fmt: skip
    return {
        "foreign": foreign,
        "is_dist": dist_checkpointing.check_is_distributed_checkpoint(step),
        "args": vars(common["args"]), "version": common["checkpoint_version"],
        "iteration": common["iteration"], "verified": meta["verified"],
        "content": dist_checkpointing.load_content_metadata(preloaded_state_dict=common),
        "same": all(torch.equal(p, q) for p, q in
                    zip(model.parameters(), fresh.parameters(), strict=True)),
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_save_carries_what_megatron_lm_and_bridge_read(tmp_path: Path) -> None:
    import yaml

    root = tmp_path / "ckpt"
    out = run_distributed(_save_for_other_tools, 1, args=(str(root),), timeout_s=300)[0]
    step = step_dir(root, 3)
    # Megatron-LM: the tracker (read_metadata: int of the stripped text), a torch_dist step,
    # and args / checkpoint_version / iteration / content metadata in its common state.
    assert int((root / "latest_checkpointed_iteration.txt").read_text().strip()) == 3
    assert out["is_dist"] and out["version"] == 3.0 and out["iteration"] == 3
    args = out["args"]
    assert isinstance(args, dict)
    assert {k: args.get(k) for k in _MEGATRON_LM_ARGS} == _MEGATRON_LM_ARGS
    assert out["content"] == {"distrib_optim_sharding_type": "dp_reshardable"}
    # Megatron-Bridge: train_state.pt in the step and latest_train_state.pt at the root, loaded
    # as read_train_state does (weights_only); run_config.yaml's model and checkpoint sections.
    for path in (root / "latest_train_state.pt", step / "train_state.pt"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert {k: v.dtype for k, v in state.items()} == _BRIDGE_TRAIN_STATE, path
        assert state["step"].item() == 3
    run_config = yaml.safe_load((step / "run_config.yaml").read_text())
    provider = run_config["model"]
    assert provider["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    assert provider["tensor_model_parallel_size"] == provider["pipeline_model_parallel_size"] == 1
    assert provider["vocab_size"] == VOCAB and provider["should_pad_vocab"] is False
    assert provider["params_dtype"] == {"_target_": "torch.float32", "_call_": False}
    assert provider["activation_func"] == {"_target_": "torch.nn.functional.silu", "_call_": False}
    assert provider["num_query_groups"] == 2 and provider["kv_channels"] == 8
    assert provider["share_embeddings_and_output_weights"] is False
    checkpoint = run_config["checkpoint"]
    assert checkpoint["save_optim"] is checkpoint["save_rng"] is False
    assert checkpoint["fully_parallel_save"] is False
    assert out["verified"] and out["same"]
    assert out["foreign"] == {"mlm": (3, False, True), "bridge": (3, False, True)}
    files = json.loads((step / "megatron_gndpo.json").read_text())["files"]
    assert {"run_config.yaml", "train_state.pt"} <= set(files)
    assert not list(root.glob("*.tmp"))
