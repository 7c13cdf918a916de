"""The outlier steps: which steps they are, and the sampling temperature of each step.

    is_outlier_step(cfg.rollout, step)   # step counts from 1
    temperature_at(cfg.rollout, step)

``rollout.outlier_interval = N`` makes steps N, 2N, ... outlier steps: a documented,
reproducible source of outlier batches for measuring how a method's gradient reacts to them
(docs/methods/gndpo.md, ``megatron-gndpo demo --stability``). Such a step draws its prompts from
``data.outlier_train`` (harder or out-of-distribution prompts: the trainer's second sampler)
and/or samples at ``rollout.outlier_temperature``. A hotter sample strays further from the
teacher; its old log-probs are still the student's own at temperature 1.
"""

from __future__ import annotations

from megatron_gndpo.config.schema import RolloutConfig


def is_outlier_step(rollout: RolloutConfig, step: int) -> bool:
    """Whether ``step`` (from 1) is one of the schedule's outlier steps."""
    interval = rollout.outlier_interval
    return interval > 0 and step % interval == 0


def temperature_at(rollout: RolloutConfig, step: int) -> float:
    """The sampling temperature of training step ``step`` (from 1)."""
    hot = rollout.outlier_temperature
    return hot if hot is not None and is_outlier_step(rollout, step) else rollout.temperature
