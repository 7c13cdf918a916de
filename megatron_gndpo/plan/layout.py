"""Both models' layouts on the job's ranks: each pipeline stage's layers, parameters and ranks
(:func:`plan_model`), and which ranks train and which only generate (:func:`rank_split`,
rollout.disaggregate)."""

from __future__ import annotations

import dataclasses
import math

from megatron_gndpo.checks.rules import split_problems
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import (
    Config,
    ModelConfig,
    ParallelConfig,
    TeacherConfig,
    teacher_sections,
)
from megatron_gndpo.parallel.groups import ParallelLayout, layout_of
from megatron_gndpo.plan.params import stage_expert_params, stage_params, total_params


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    first_layer: int
    last_layer: int
    params_per_rank: int
    ranks: range  # contiguous: pp is megatron's slowest dimension
    expert_params_per_rank: int = 0  # of params_per_rank: routed experts (MoE)


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    name: str
    layout: ParallelLayout
    total_params: int
    padded_vocab: int
    stages: tuple[StagePlan, ...]


def plan_model(name: str, model: ModelConfig, parallel: ParallelConfig, world: int) -> ModelPlan:
    layout = layout_of(parallel, world)
    per_stage = model.num_layers // layout.pp
    stages = []
    per_stage_ranks = world // layout.pp  # pp is the slowest dimension: a stage is contiguous
    for stage in range(layout.pp):
        ranks = range(stage * per_stage_ranks, (stage + 1) * per_stage_ranks)
        stages.append(
            StagePlan(
                stage=stage,
                first_layer=stage * per_stage,
                last_layer=(stage + 1) * per_stage - 1,
                params_per_rank=stage_params(model, layout, stage),
                ranks=ranks,
                expert_params_per_rank=stage_expert_params(model, layout, stage),
            )
        )
    return ModelPlan(
        name=name,
        layout=layout,
        total_params=total_params(model),
        padded_vocab=model.padded_vocab_size(layout.tp),
        stages=tuple(stages),
    )


def plan(cfg: Config, world_size: int) -> tuple[ModelPlan, ModelPlan | None]:
    """Plans of the student and the (first colocated) teacher (validate the config first), on
    the trainer's ranks (all of them unless rollout.disaggregate takes the last ones)."""
    teachers = teacher_plans(cfg, world_size)
    trainer = rank_split(cfg, world_size).trainer_ranks
    student = plan_model("student", cfg.model, cfg.parallel, trainer)
    return student, teachers[0] if teachers else None


def colocated_teachers(cfg: Config) -> list[TeacherConfig]:
    """The teachers whose weights live on the job's ranks apart from the student's (not behind a
    server, not the student itself: teacher.weights=live)."""
    return [t for _, t in teacher_sections(cfg) if t.server is None and t.weights != "live"]


def teacher_plans(cfg: Config, world_size: int) -> list[ModelPlan]:
    """A plan per colocated teacher, each on its own layout (several: ``teacher NAME``), on the
    trainer's ranks."""
    trainer = rank_split(cfg, world_size).trainer_ranks
    return [
        plan_model(_teacher_label(t), t.model, t.parallel, trainer) for t in colocated_teachers(cfg)
    ]


@dataclasses.dataclass(frozen=True)
class RankSplit:
    """Which ranks train and which only generate (rollout.disaggregate): the first
    ``trainer_ranks`` hold the student's and the teachers' layouts, the last ``rollout_ranks``
    form ``rollout_replicas`` copies of the student at ``rollout_tp``. Colocated: no rollout
    ranks, every rank does both."""

    world_size: int
    rollout_ranks: int  # R
    rollout_tp: int
    trainer_dp: int  # the student's data-parallel size on the trainer ranks

    @property
    def trainer_ranks(self) -> int:  # T = world - R
        return self.world_size - self.rollout_ranks

    @property
    def rollout_replicas(self) -> int:
        return self.rollout_ranks // self.rollout_tp

    @property
    def blocks_per_replica(self) -> int:
        """Trainer replicas' blocks of rows the busiest rollout replica generates (trainer
        replica d is served by rollout replica d mod rollout_replicas)."""
        return -(-self.trainer_dp // self.rollout_replicas) if self.rollout_ranks else 1


def _layout_problems(cfg: Config, world: int) -> list[str]:
    """The student's and the colocated teachers' layouts that do not divide ``world`` ranks."""
    sections = [("parallel", cfg.parallel)]
    sections += [(f"{key}.parallel", t.parallel) for key, t in teacher_sections(cfg)]
    problems = []
    for name, parallel in sections:
        try:
            layout_of(parallel, world)
        except ConfigError as err:
            problems.append(f"{name}: {err}")
    return problems


def valid_rollout_ranks(cfg: Config, world_size: int) -> list[int]:
    """Every R (0 < R < world, a multiple of the rollout TP) whose trainer ranks W - R hold the
    layouts and split the prompts into whole per-replica shares (``config validate``'s rule)."""
    tp = cfg.rollout.disaggregate.tensor_parallel
    p = cfg.parallel
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    # The trainer's ranks are model_parallel x dp with dp dividing prompts_per_step: try those
    # (as many as prompts_per_step has divisors), not every R below the world size.
    out = []
    for dp in _divisors(cfg.rollout.prompts_per_step):
        r = world_size - model_parallel * dp
        if r <= 0 or r % tp or _layout_problems(cfg, world_size - r):
            continue
        if cfg.rollout.prompts_per_step % layout_of(cfg.parallel, world_size - r).dp:
            continue
        out.append(r)
    return sorted(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def rank_split(cfg: Config, world_size: int) -> RankSplit:
    """The trainer / rollout split of ``world_size`` ranks; a ConfigError naming the fix when
    the rollout ranks leave none to train or the layouts do not divide the trainer's ranks.

    (These checks live here, not in checks/rules.py, so that ``plan`` names valid R values.)
    """
    d = cfg.rollout.disaggregate
    if not d.enabled:
        return RankSplit(world_size, 0, 1, layout_of(cfg.parallel, world_size).dp)
    split = split_problems(d, world_size)
    if split:
        raise ConfigError(split[0])
    trainer = world_size - d.ranks
    problems = _layout_problems(cfg, trainer)
    if problems:
        valid = valid_rollout_ranks(cfg, world_size)
        fix = (
            f"set rollout.disaggregate.ranks to one of {valid}"
            if valid
            else "no R < world_size fits these layouts; change the layouts or the world size"
        )
        raise ConfigError(
            f"the trainer's {trainer} ranks ({world_size} - rollout.disaggregate.ranks "
            f"{d.ranks}) do not hold the layouts: {'; '.join(problems)}; {fix}"
        )
    return RankSplit(world_size, d.ranks, d.tensor_parallel, layout_of(cfg.parallel, trainer).dp)


def _teacher_label(t: TeacherConfig) -> str:
    name = getattr(t, "name", "")
    return f"teacher {name}" if name else "teacher"
