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
