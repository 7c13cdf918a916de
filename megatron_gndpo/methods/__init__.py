"""One module per method family, each a :class:`~megatron_gndpo.methods.base.Method`.

``METHODS`` maps ``algorithm.estimator`` to its method; the trainer holds
``build_method(cfg.algorithm)`` and asks it what to score, in which order, what the update
receives and how to sample. Adding a method is one module and one line here (docs/DESIGN.md,
"How to add a method"): validation and the config reference (:func:`config_names`) read the
names from the registry.

    module      methods
    distill     gndpo, opd           (per-token score; also mix's distillation part)
    outcome     grpo, reinforce_pp   (verifiable reward; also mix's outcome part)
    mix         mix
    vopd        vopd                 (also a distillation part of mix)
    tgpo        tgpo
    tropd       tropd
    topk_kd     topk_kd              (a divergence on the teacher's top-k; beside gndpo or opd)
"""

from __future__ import annotations

from megatron_gndpo.config.schema import AlgorithmConfig, Config
from megatron_gndpo.methods.base import BaseMethod, Method, StepBatch, Targets
from megatron_gndpo.methods.distill import GNDPO, OPD
from megatron_gndpo.methods.mix import DISTILL_PARTS, OUTCOME_PARTS, Mix
from megatron_gndpo.methods.outcome import GRPO, ReinforcePP
from megatron_gndpo.methods.tgpo import TGPO
from megatron_gndpo.methods.topk_kd import TopKKD
from megatron_gndpo.methods.tropd import TrOPD
from megatron_gndpo.methods.vopd import VOPD

METHODS: dict[str, type[BaseMethod]] = {
    m.name: m for m in (GNDPO, OPD, GRPO, ReinforcePP, VOPD, Mix, TGPO, TrOPD, TopKKD)
}


def config_names() -> dict[str, tuple[str, ...]]:
    """The names each estimator key takes, by dotted key, from the registries: the config
    reference (``megatron-gndpo config fields``, docs/CONFIG.md) lists them, since ``config/``
    imports nothing of the package."""
    return {
        "algorithm.estimator": tuple(METHODS),
        "algorithm.distill_estimator": tuple(DISTILL_PARTS),
        "algorithm.outcome_estimator": tuple(OUTCOME_PARTS),
    }


def build_method(cfg: AlgorithmConfig) -> Method:
    """The method ``cfg.estimator`` names (a validated config names a known one)."""
    try:
        kind = METHODS[cfg.estimator]
    except KeyError:
        raise ValueError(
            f"unknown estimator {cfg.estimator!r}; use one of {', '.join(METHODS)}"
        ) from None
    return kind(cfg)


def method_problems(cfg: Config, world_size: int | None = None) -> list[str]:
    """What cannot run with the configured method, each with its fix; ``world_size`` (when
    known, > 0) adds the checks that depend on the layouts."""
    a = cfg.algorithm
    if a.estimator not in METHODS:
        return [
            f"algorithm.estimator: unknown name {a.estimator!r}; use one of {', '.join(METHODS)}"
        ]
    method = build_method(a)
    p = []
    off = [
        f"algorithm.{key}=false"
        for key, on in (("gndpo_subtract_mean", a.gndpo_subtract_mean),
                        ("gndpo_divide_std", a.gndpo_divide_std))
        if not on
    ]  # fmt: skip
    if off and not method.uses_gndpo_switches:
        p.append(f"{' and '.join(off)} applies to the gndpo estimator only; set it to true")
    return p + method.problems(cfg, world_size)


__all__ = [
    "METHODS",
    "BaseMethod",
    "Method",
    "StepBatch",
    "Targets",
    "build_method",
    "config_names",
    "method_problems",
]
