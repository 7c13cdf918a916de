"""Checkpoints: save -> kill -> load restores model and optimizer; TP=2 loads at TP=1; atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_gndpo.checkpoint.dist import (
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
    saved_logits = _logits(model, groups)
    saved = _params(model)
    norm = _train_step(ddp, optimizer, _batch(2))  # the step a resumed run must reproduce
    return {"saved": saved, "after": _params(model), "norm": norm, "logits": saved_logits}


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
