"""Trainers on the tiny CPU example, shared by the trainer tests (call them inside a rank of
:func:`tests.harness.run_distributed`; torch.distributed must be initialised)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = Path(__file__).parents[1] / "examples" / "tiny_cpu.yaml"


def tiny_trainer(run_dir: str, *overrides: str) -> Any:
    """A Trainer on examples/tiny_cpu.yaml with ``overrides``, validated for this world."""
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import load_config
    from megatron_gndpo.trainer import Trainer

    cfg = load_config(TINY, [f"logging.run_dir={run_dir}", *overrides])
    validate(cfg, torch.distributed.get_world_size())
    return Trainer(cfg)


def reset_megatron() -> None:
    """Forget megatron-core's global parallel state, so the next trainer builds its own."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    """A copy of every parameter of ``model``, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def two_steps(
    world: int, root: str, runs: dict[str, list[str]], saved: str
) -> dict[str, dict[str, object]]:
    """Two steps of each of ``runs`` (name -> overrides) on the tiny example: the metrics, the
    student weights that did not move and the teacher weights that did. The first run at 1 rank
    saves both models' initial weights into ``saved``/init and ``saved``/teacher (megatron
    initialises other PP layouts differently: a multi-rank run loads them instead)."""
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    out: dict[str, dict[str, object]] = {}
    for name, overrides in runs.items():
        trainer = tiny_trainer(f"{root}/{name}", *overrides)
        if world == 1 and not out:
            save_checkpoint(f"{saved}/init", 0, trainer.c.student)
            save_checkpoint(f"{saved}/teacher", 0, trainer.c.teacher.model)
        student, teacher = snapshot(trainer.c.student), snapshot(trainer.c.teacher.model)
        steps = [trainer.step() for _ in range(2)]
        out[name] = {
            "steps": steps,
            "unchanged": [
                n for n, p in trainer.c.student.named_parameters() if (p == student[n]).all()
            ],
            "teacher_moved": [
                n for n, p in trainer.c.teacher.model.named_parameters()
                if not (p == teacher[n]).all()
            ],
        }  # fmt: skip
        trainer.c.logger.close()
        reset_megatron()
    return out
