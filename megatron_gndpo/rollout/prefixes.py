"""Rollouts continued from teacher-written prefixes: TrOPD's off-policy guidance
(docs/methods/tropd.md). The method decides the share (``Method.prefix_share``); this module
samples.

The teacher answers each prompt once (its own random streams), the first ``share`` of each
answer is kept, and the student samples its continuations from there; the result reads as one
rollout of the original prompts whose responses start with the teacher's tokens
(:func:`~megatron_gndpo.rollout.base.with_teacher_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_gndpo import seeding
from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.rollout.base import Rollout, SamplingParams, with_teacher_prefix

# The student's generator on given ids (each prompt's ids, maybe extended), params and seeds.
StudentGenerate = Callable[[list[list[int]], SamplingParams, list[int]], Rollout]


# The teacher's answers (ids, its stop token included) to prompts, one sample each:
# (prompts, params, seeds, images) -> answers; a local teacher's ``generate``
# (:class:`~megatron_gndpo.teacher.local.LocalTeacher`).
TeacherWrite = Callable[
    [list[list[int]], SamplingParams, list[int], list[PromptImages | None] | None],
    list[list[int]],
]


def continue_teacher_prefixes(
    prompts: list[list[int]],
    share: float,
    *,
    teacher: TeacherWrite,
    generate: StudentGenerate,
    params: SamplingParams,
    configured: SamplingParams,
    seeds: list[int],
    images: list[PromptImages | None] | None = None,
) -> Rollout:
    """The step's rollout of ``prompts`` (this rank's ids) continued from the first ``share``
    of the teacher's answer to each. ``params``: this step's sampling (its temperature);
    ``configured``: the configured parameters (the teacher samples with these, once per prompt;
    the response budget counts the prefix); ``seeds``: one per prompt, as on-policy."""
    once = dataclasses.replace(configured, samples_per_prompt=1)
    answers = teacher(prompts, once, [seeding.teacher_answer_seed(s) for s in seeds], images)
    prefixes = [a[: int(share * len(a))] for a in answers]
    room = configured.max_new_tokens - min(len(x) for x in prefixes)
    continued = generate(
        [[*p, *x] for p, x in zip(prompts, prefixes, strict=True)],
        dataclasses.replace(params, max_new_tokens=room),
        seeds,
    )
    rollout = with_teacher_prefix(continued, [len(x) for x in prefixes], configured.max_new_tokens)
    rollout.images = continued.images
    return rollout
