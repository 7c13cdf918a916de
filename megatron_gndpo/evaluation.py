"""The held-out evaluation of a run: what :meth:`Trainer.evaluate` measures.

    eval/accuracy            greedy held-out accuracy (the rows sharded over data-parallel ranks)
    eval/sampled_accuracy    with ``trainer.eval_samples`` k: k samples per prompt at temperature
                             1 (the same seeds at every evaluation), their mean reward
    eval/reverse_kl          the per-token k1 estimate of KL(student || teacher) on those samples
                             (a cross-tokenizer teacher's spans: ``eval/xtok/...`` too)

It drives the trainer's own stages (its generator, rewards, teacher and student scoring), so an
evaluation measures exactly the policy the run trains.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_gndpo import seeding
from megatron_gndpo.algorithms.metrics import sampled_eval_metrics
from megatron_gndpo.engine.cross_tokenizer import teacher_input
from megatron_gndpo.engine.scoring import ScoreRequest
from megatron_gndpo.rollout.base import SamplingParams

if TYPE_CHECKING:
    from megatron_gndpo.trainer import Trainer


def evaluate(trainer: Trainer) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts (sharded over data-parallel ranks); with
    ``trainer.eval_samples`` k, also k samples per prompt at temperature 1 (the same seeds
    at every evaluation): their accuracy and the per-token reverse KL to the teacher."""
    groups = trainer.c.student_groups
    mine = trainer.c.eval_prompts[groups.coords["dp"] :: groups.layout.dp]
    greedy = SamplingParams(
        max_new_tokens=trainer.cfg.rollout.max_response_length, temperature=0.0,
        stop_token_ids=trainer.params.stop_token_ids,
    )  # fmt: skip
    correct = torch.zeros(2, dtype=torch.float64)
    if mine:
        rollout = trainer._rollout(mine, greedy)
        rewards = trainer._rewards(rollout, mine)
        if rewards is not None:
            correct += torch.tensor([float(rewards.sum()), float(len(rewards))])
    dist.all_reduce(correct, group=groups.dp_cp)
    out = {"eval/accuracy": float(correct[0] / correct[1].clamp(min=1.0))}
    # every replica must hold a prompt: the teacher's scoring spans all ranks
    if trainer.cfg.trainer.eval_samples and len(trainer.c.eval_prompts) >= groups.layout.dp:
        out |= _sampled(trainer, mine, trainer.cfg.trainer.eval_samples)
    return out


def _sampled(trainer: Trainer, mine: list[Any], k: int) -> dict[str, float]:
    """:func:`sampled_eval_metrics` of ``k`` samples of each of this rank's held-out
    prompts ``mine`` (each holds some); every rank calls it. A prompt's seeds follow its
    place in the held-out set, so they do not depend on the data-parallel size."""
    groups = trainer.c.student_groups
    places = range(groups.coords["dp"], len(trainer.c.eval_prompts), groups.layout.dp)
    params = dataclasses.replace(
        trainer.params, temperature=1.0, samples_per_prompt=k,
        max_new_tokens=trainer.cfg.rollout.max_response_length,
    )  # fmt: skip
    seeds = [seeding.eval_seeds(trainer.cfg.trainer.seed, i, 1)[0] for i in places]
    rollout = trainer._generate(mine, [list(p.ids) for p in mine], params, seeds)
    rewards = trainer._rewards(rollout, mine)
    routing = trainer._routing  # this step's, for its metrics: the evaluation's is not
    routes, cross, group = (
        trainer.c.routes(mine, rollout.prompt_index),
        trainer.c.cross,
        groups.dp_cp,
    )
    rows, tokens, lengths = teacher_input(cross, rollout, mine, routes)
    teacher = trainer.c.teacher.score_batch(
        tokens, lengths, None, images=rollout.images, routes=routes
    )
    student = trainer._student_scores(rollout, ScoreRequest())
    trainer._routing = routing
    mask, spans = rollout.response_mask, {}
    if cross is not None and rows is not None:  # the span scores on the student's tokens
        teacher, mask, found = cross.on_student(teacher, rows, student.logprobs, mask, group)
        spans = {f"eval/{k}": found[k] for k in ("xtok/span_kl", "xtok/kl_per_token")}
    return spans | sampled_eval_metrics(
        teacher.logprobs, student.logprobs, mask, rewards, group=group
    )
