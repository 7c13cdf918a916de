"""The :class:`Method` protocol: everything that differs between estimators, in one place.

A method decides what each model scores besides the sampled tokens' log-probs (and which model
goes first), turns the scores into the update's per-token :class:`Targets`, reports the config
problems that only it can see, and (TrOPD) how the rollout is sampled. The trainer calls these
hooks and nothing else; the pure math stays in ``algorithms/``.

Tensors are ``[n, S]`` / ``[n, S, K]`` in the scoring convention (``x[:, t]`` belongs to token
``t``); ``group`` is the student's data-parallel x context-parallel group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import torch

from megatron_gndpo.algorithms.stats import global_sum
from megatron_gndpo.config.schema import AlgorithmConfig, Config
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.engine.update import Targets


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What a method's targets are computed from: this rank's rows of one step."""

    teacher: Scores
    student: Scores  # at the rollout weights ("old")
    response_mask: torch.Tensor  # [n, S] bool
    rewards: torch.Tensor | None  # [n]: verifiable rewards, None when the prompts have no answers
    group_size: int  # samples per prompt (rows of one prompt are adjacent)
    group: Any  # the student's DP x CP group: every batch statistic is global over it
    step: int  # 1-based
    tokens: torch.Tensor | None = None  # [n, S]: the sampled tokens
    teacher_written: torch.Tensor | None = None  # [n, S]: TrOPD's teacher-written prefix tokens
    # [n]: the normalisation group of each row (algorithm.teacher_stats=teacher: its teacher);
    # None: one group, the whole step batch
    stat_groups: torch.Tensor | None = None
    num_stat_groups: int = 1
    # [n, S] bool: the response tokens the teacher scored; None: all of them. A teacher with
    # its own tokenizer scores none of a span its text does not reproduce
    # (docs/methods/cross_tokenizer.md)
    scored_mask: torch.Tensor | None = None

    @property
    def distill_mask(self) -> torch.Tensor:
        """``[n, S]`` bool: the tokens a distillation score exists for (the teacher scored
        them): ``scored_mask``, else the response."""
        return self.response_mask if self.scored_mask is None else self.scored_mask


class Method(Protocol):
    """One estimator. Built from the algorithm config; must not fail on an unsound one
    (:meth:`problems` reports it)."""

    name: ClassVar[str]

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus beta: ``algorithm.entropy_coef``, else the method's default."""
        ...

    @property
    def student_first(self) -> bool:
        """Whether the student's old-log-prob pass runs before the teacher's (vOPD)."""
        ...

    @property
    def uses_gndpo_switches(self) -> bool:
        """Whether ``algorithm.gndpo_subtract_mean`` / ``gndpo_divide_std`` apply."""
        ...

    @property
    def teacher_samples(self) -> bool:
        """Whether the teacher generates (TrOPD's prefixes): it then needs a generator."""
        ...

    @property
    def uses_reward(self) -> bool:
        """Whether the advantages come (at least in part) from the verifiable reward."""
        ...

    @property
    def never_stops_advice(self) -> str:
        """Why this method does not teach a student that never samples a stop token to stop,
        and what to do (the trainer's one warning, ``rollout.metrics.EndingWatch``)."""
        ...

    @property
    def scores_spans(self) -> bool:
        """Whether the method reads the teacher only through its log-probs of the sampled
        tokens, on :attr:`StepBatch.distill_mask`: then a teacher with another tokenizer can
        stand in with its span scores (``teacher.cross_tokenizer``)."""
        ...

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        """What the teacher scores besides the sampled tokens (``student``: when it went first;
        ``seed``: of sampled teacher tokens, the same on every rank for one step)."""
        ...

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        """What the student's old-log-prob pass scores (``teacher``: when it went first)."""
        ...

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        """The update's :class:`Targets` and this method's metrics (global over ``group``)."""
        ...

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        """What cannot run with this method, each with its fix (``world_size``: when known)."""
        ...

    def top_ks(self) -> dict[str, int]:
        """The top-k sizes this method uses, by key under ``algorithm.`` (checked against the
        tokenizer's vocabulary at start-up)."""
        ...

    def prefix_share(self, step: int) -> float:
        """The share of the teacher's answer the student continues from at 1-based ``step``
        (0: ordinary on-policy rollouts)."""
        ...

    def rollout_metrics(self, step: int, teacher_written_frac: float) -> dict[str, float]:
        """Metrics of how the rollout was sampled (``step``: 1-based, the one just taken;
        ``teacher_written_frac``: the global share of response tokens the teacher wrote)."""
        ...


KD_FIRST = "train it on the teacher's answers first (sequence-level KD)"


class BaseMethod:
    """Defaults for :class:`Method`: the teacher first, the sampled tokens plus the student's
    entropy (a metric), on-policy rollouts, nothing else to check."""

    name: ClassVar[str] = ""
    default_entropy_coef: ClassVar[float] = 0.0  # beta when algorithm.entropy_coef is null

    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg

    @property
    def entropy_coef(self) -> float:
        """beta: ``algorithm.entropy_coef``, or this method's default when it is null."""
        beta = self.cfg.entropy_coef
        return self.default_entropy_coef if beta is None else beta

    @property
    def student_first(self) -> bool:
        return False

    @property
    def uses_gndpo_switches(self) -> bool:
        return False

    @property
    def teacher_samples(self) -> bool:
        return False

    @property
    def uses_reward(self) -> bool:
        return False

    @property
    def never_stops_advice(self) -> str:
        # a sampled-token distillation score (gndpo, opd, vopd; mix's distillation part)
        return (
            "The distillation score teaches stopping only through the stop tokens the student "
            "samples, so this student is not taught to stop (docs/methods/README.md, 'A "
            f"student that never stops'): {KD_FIRST}, use algorithm.estimator=tropd, or "
            "algorithm.estimator=topk_kd (the forward KL to the teacher's top-k at every "
            "position, alone or beside GNDPO's score)"
        )

    @property
    def scores_spans(self) -> bool:
        return False

    def teacher_request(self, student: Scores | None, seed: int) -> ScoreRequest | None:
        return None

    def student_request(self, teacher: Scores | None) -> ScoreRequest:
        return ScoreRequest(entropy=True)

    def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
        raise NotImplementedError

    def problems(self, cfg: Config, world_size: int | None) -> list[str]:
        return []

    def top_ks(self) -> dict[str, int]:
        return {}

    def prefix_share(self, step: int) -> float:
        return 0.0

    def rollout_metrics(self, step: int, teacher_written_frac: float) -> dict[str, float]:
        return {}


def needs_rewards(name: str, rewards: torch.Tensor | None) -> torch.Tensor:
    """The verifiable rewards an outcome estimator needs, or an error naming the fix."""
    if rewards is None:
        raise ValueError(
            f"estimator {name} needs a verifiable reward: the prompts have no answers "
            "(data.answer_key)"
        )
    return rewards


def global_mean(values: torch.Tensor, mask: torch.Tensor, group: Any) -> float:
    """Mean of ``values`` over the masked tokens of every rank of ``group`` (one all-reduce)."""
    m = mask.float()
    sums = global_sum(torch.stack([(values.float() * m).sum(), m.sum()]), group)
    return float(sums[0] / sums[1].clamp(min=1.0))
