"""The student's trainable wrapper: megatron-core DDP and (distributed) optimizer.

Everything here is megatron-core's: ``DistributedDataParallel`` with fp32 gradient buffers,
``get_megatron_optimizer`` (the distributed optimizer shards fp32 master weights and Adam state
over the data-parallel group), ``finalize_model_grads`` (DP all-reduce, tied-embedding sync across
pipeline stages, and the per-token loss scaling by the global token count).

Only the student trains, and the student's groups are megatron-core's global parallel state
(``build_student_groups``), which these components read; they take no process groups here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_gndpo.config.schema import OptimizerConfig


def _require_student_state() -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "the trainable student needs megatron-core's parallel state: build its groups with "
            "megatron_gndpo.parallel.build_student_groups() first"
        )


def wrap_ddp(model: Any, *, use_distributed_optimizer: bool) -> Any:
    """Wrap a GPTModel in megatron-core DDP and hook its gradient finalisation into the config.

    Gradients accumulate in fp32 ``param.main_grad`` buffers (not ``.grad``) and are reduced
    over the data-parallel group once per step, after the last micro-batch.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    _require_student_state()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=ddp_config,
        module=model,
        full_param_layout=_param_layout(model, ddp_config),
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def _param_layout(model: Any, ddp_config: Any) -> Any:
    """The distributed optimizer's parameter layout, precomputed as megatron-core asks its
    callers to (DDP otherwise computes the same itself and warns on every build). None without
    the distributed optimizer."""
    if not ddp_config.use_distributed_optimizer:
        return None
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer.compute_full_param_layout(
        [p for p in model.parameters() if p.requires_grad],
        None,  # one bucket: no overlapped gradient reduction
        parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        ddp_config,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(),
    )


def build_optimizer(ddp_model: Any, cfg: OptimizerConfig) -> Any:
    """megatron-core's optimizer for the wrapped student, from our OptimizerConfig."""
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    _require_student_state()
    params_dtype = ddp_model.config.params_dtype
    mcore = McoreOptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
    )
    return get_megatron_optimizer(mcore, [ddp_model])


def step_optimizer(optimizer: Any, scheduler: Any) -> dict[str, float]:
    """One optimizer step after a forward/backward, unless the global gradient norm is not finite.

    megatron-core clips by a NaN norm without complaint in bf16/fp32 (no grad scaler), which
    would corrupt the weights: the norm is checked first. It is reduced over every rank holding
    gradients, so all ranks agree to skip. Returns ``grad_norm`` (pre-clip), ``skipped``, ``lr``.
    """
    optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    lr = float(optimizer.param_groups[0]["lr"])
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return {"grad_norm": grad_norm, "skipped": 1.0, "lr": lr}
    updated, _, _ = optimizer.step()
    if updated and scheduler is not None:
        scheduler.step(increment=1)
    lr = float(optimizer.param_groups[0]["lr"])
    return {"grad_norm": grad_norm, "skipped": 0.0 if updated else 1.0, "lr": lr}


def build_scheduler(optimizer: Any, cfg: OptimizerConfig, *, total_steps: int,
                    warmup_steps: int) -> Any:  # fmt: skip
    """megatron-core's learning-rate schedule over ``total_steps`` optimizer steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.lr_schedule != "constant" else cfg.lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, warmup_steps + 1),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
