"""Which sampling temperature each training step uses: the base one, or the outlier steps'.

    temperature_at(cfg.rollout, step)   # step counts from 1

``rollout.outlier_interval = N`` makes steps N, 2N, ... sample at ``rollout.outlier_temperature``:
a documented, reproducible source of outlier batches (a hotter sample strays further from the
teacher, so its score RMS rises) for measuring how a method's gradient reacts to them
(docs/methods/gndpo.md, ``megatron-gndpo demo --stability``). The old log-probs are still the
student's own at temperature 1, so on those steps the score is the teacher's and the student's
view of tokens the student rarely samples.
"""

from __future__ import annotations

from megatron_gndpo.config.schema import RolloutConfig


def is_outlier_step(rollout: RolloutConfig, step: int) -> bool:
    """Whether ``step`` (from 1) is one of the schedule's outlier steps."""
    interval = rollout.outlier_interval
    return interval > 0 and step % interval == 0


def temperature_at(rollout: RolloutConfig, step: int) -> float:
    """The sampling temperature of training step ``step`` (from 1)."""
    return rollout.outlier_temperature if is_outlier_step(rollout, step) else rollout.temperature
