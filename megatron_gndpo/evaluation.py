"""The held-out evaluation: what a policy does on prompts it does not train on.

    eval/accuracy            greedy held-out accuracy (the prompts sharded over data-parallel ranks)
    eval/sampled_accuracy    with ``samples`` k: k samples per prompt at temperature 1 (the same
                             seeds at every evaluation), their mean reward
    eval/reverse_kl          the per-token k1 estimate of KL(student || teacher) on those samples
                             (a cross-tokenizer teacher's spans: ``eval/xtok/...`` too)

:func:`evaluate` takes what it measures with: any rollout engine, the tokenizer and, for the
sampled metrics, a :class:`~megatron_gndpo.scorer.RolloutScorer` (the run's teachers and
student). The trainer evaluates with its own generator and scorer, so an evaluation measures
exactly the policy the run trains; the demo and the benchmarks call it on any model with
``MegatronGenerator.for_model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_gndpo import seeding
from megatron_gndpo.algorithms.metrics import sampled_eval_metrics
from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rewards.rollout import rollout_rewards
from megatron_gndpo.rollout.base import Generator, SamplingParams, generate_for
from megatron_gndpo.rollout.greedy import greedy
from megatron_gndpo.scorer import RolloutScorer


def evaluate(
    generator: Generator,
    tokenizer: Tokenizer,
    prompts: Sequence[EncodedPrompt],
    groups: ParallelGroups,
    params: SamplingParams,
    *,
    scorer: RolloutScorer | None = None,
    samples: int = 0,
    seed: int = 0,
    replay: bool = False,
    vision: bool = False,
    answer_match: str = "final",
) -> dict[str, float]:
    """Greedy accuracy on ``prompts`` (the whole held-out set; each data-parallel rank of
    ``groups`` generates its share, the counts summed over the DP x CP group), answers of at most
    ``params.max_new_tokens`` stopping at ``params.stop_token_ids``. With ``samples`` k and a
    ``scorer``, also k samples per prompt at temperature 1 (``params``' other settings; seeds
    from ``seed`` and each prompt's place in the set): their accuracy and the per-token reverse
    KL to the teacher (``replay``: an MoE student's pass replays the sampler's experts).
    ``vision``: a vision-language student (the prompts' images go along). ``answer_match``: how
    an answer is checked (data.answer_match; rewards/rollout.py). Every rank calls it."""
    accuracy = greedy_accuracy(
        generator, tokenizer, prompts, groups, max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids, vision=vision, answer_match=answer_match,
    )  # fmt: skip
    out = {"eval/accuracy": accuracy}
    # every replica must hold a prompt: the teacher's scoring spans all ranks
    if samples and scorer is not None and len(prompts) >= groups.layout.dp:
        sampling = dataclasses.replace(params, temperature=1.0, samples_per_prompt=samples)
        out |= _sampled(
            generator, tokenizer, prompts, groups, sampling, scorer, seed, replay=replay,
            vision=vision, answer_match=answer_match,
        )  # fmt: skip
    return out


def greedy_accuracy(
    generator: Generator,
    tokenizer: Tokenizer,
    prompts: Sequence[EncodedPrompt],
    groups: ParallelGroups,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    batch_size: int | None = None,
    vision: bool = False,
    answer_match: str = "final",
) -> float:
    """The share of ``prompts`` whose greedy answer states their reference answer: each
    data-parallel rank of ``groups`` answers its share, ``batch_size`` prompts at a time (None:
    all at once), and the counts are summed over the DP x CP group (0 when no prompt has an
    answer). Every rank calls it."""
    mine = list(prompts[groups.coords["dp"] :: groups.layout.dp])
    plain = greedy(max_new_tokens, stop_token_ids)
    correct = torch.zeros(2, dtype=torch.float64)  # [correct, total]
    size = batch_size or max(len(mine), 1)
    for start in range(0, len(mine), size):
        batch = mine[start : start + size]
        rollout = generate_for(generator, batch, plain, [0] * len(batch), vision=vision)
        # greedy: the seeds are unused
        rewards = rollout_rewards(rollout, batch, tokenizer, match=answer_match)
        if rewards is not None:
            correct += torch.tensor([float(rewards.sum()), float(len(rewards))])
    dist.all_reduce(correct, group=groups.dp_cp)
    return float(correct[0] / correct[1].clamp(min=1.0))


def _sampled(
    generator: Generator,
    tokenizer: Tokenizer,
    prompts: Sequence[EncodedPrompt],
    groups: ParallelGroups,
    params: SamplingParams,
    scorer: RolloutScorer,
    seed: int,
    *,
    replay: bool,
    vision: bool,
    answer_match: str,
) -> dict[str, float]:
    """:func:`sampled_eval_metrics` of ``params.samples_per_prompt`` samples of each of this
    rank's held-out prompts (each rank holds some); every rank calls it. A prompt's seeds follow
    its place in the held-out set, so they do not depend on the data-parallel size."""
    places = range(groups.coords["dp"], len(prompts), groups.layout.dp)
    mine = [prompts[i] for i in places]
    seeds = [seeding.eval_seeds(seed, i, 1)[0] for i in places]
    rollout = generate_for(generator, mine, params, seeds, vision=vision)
    rewards = rollout_rewards(rollout, mine, tokenizer, match=answer_match)
    routes = scorer.teachers.routes(mine, rollout.prompt_index)
    scored = scorer.score(rollout, mine, routes, replay=replay)
    spans = {}
    if scorer.cross is not None:  # the span scores on the student's tokens
        spans = {f"eval/{k}": scored.metrics[k] for k in ("xtok/span_kl", "xtok/kl_per_token")}
    return spans | sampled_eval_metrics(
        scored.teacher.logprobs, scored.student.logprobs, scored.scored, rewards,
        group=groups.dp_cp,
    )  # fmt: skip
