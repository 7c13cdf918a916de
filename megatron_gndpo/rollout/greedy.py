"""Greedy answers of any generator to many prompts, in batches (prune's calibration text, the
demo's and the benchmarks' evaluations, ``evaluation.py``).

    generator = MegatronGenerator.for_model(model, groups, tokenizer)
    answers = greedy_answers(generator, [tokenizer.apply_chat_template(p) for p in prompts],
                             max_new_tokens=64, stop_token_ids=(tokenizer.eos_id,))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_gndpo.rollout.base import Generator, SamplingParams

# Rows generated in lock-step; bounds the KV cache and the padding of finished rows.
DEFAULT_BATCH_SIZE = 64


@dataclasses.dataclass(frozen=True)
class Answer:
    """One prompt's greedy answer: ``ids`` the prompt then the response."""

    ids: list[int]
    prompt_length: int
    finished: bool  # it ended with a stop token (else it was cut at max_new_tokens)

    @property
    def response(self) -> list[int]:
        return self.ids[self.prompt_length :]


def greedy(max_new_tokens: int, stop_token_ids: Sequence[int]) -> SamplingParams:
    """Greedy decoding (temperature 0) up to ``max_new_tokens``, stopping at ``stop_token_ids``."""
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids)
    )


def greedy_answers(
    generator: Generator,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    batch_size: int = DEFAULT_BATCH_SIZE,
    images: Sequence[Any] | None = None,
) -> list[Answer]:
    """The greedy answer to each prompt (token ids), ``batch_size`` prompts at a time;
    ``images``: each prompt's images (a vision-language model's generator)."""
    params = greedy(max_new_tokens, stop_token_ids)
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start : start + batch_size]]
        pictures = None if images is None else list(images[start : start + batch_size])
        seeds = [0] * len(batch)  # greedy: unused
        rollout = generator.generate(batch, params, seeds=seeds, images=pictures)
        for i, end in enumerate(rollout.lengths.tolist()):
            out.append(
                Answer(
                    rollout.tokens[i, :end].tolist(),
                    int(rollout.prompt_lengths[i]),
                    bool(rollout.finished[i]),
                )
            )
    return out
