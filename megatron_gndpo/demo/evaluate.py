"""Greedy accuracy of a megatron-core model on held-out problems with verifiable answers.

The run's evaluation (``megatron_gndpo/evaluation.py``) on any model and layout: greedy decoding
(temperature 0, stop at EOS) with the built-in KV-cached generator, each prompt in the
tokenizer's chat template, the response checked by :func:`megatron_gndpo.rewards.verifiable
.reward`. ``groups`` are the model's own; problems are sharded over its data-parallel ranks and
the counts summed over its DP x CP group (TP ranks of a replica generate the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from megatron_gndpo import evaluation
from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.builtin import MegatronGenerator
from megatron_gndpo.rollout.greedy import DEFAULT_BATCH_SIZE, greedy_answers


class Example(Protocol):
    """Anything with a prompt and a reference answer (a task Problem, a PromptExample)."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str | None: ...


def greedy_texts(
    model: Any,
    groups: ParallelGroups,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> list[str]:
    """The decoded greedy response to each prompt (all of them, on every rank that calls)."""
    answers = greedy_answers(
        MegatronGenerator.for_model(model, groups, tokenizer),
        [tokenizer.apply_chat_template(p) for p in prompts], max_new_tokens=max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,), batch_size=batch_size,
    )  # fmt: skip
    return [tokenizer.decode(a.response) for a in answers]


def greedy_accuracy(
    model: Any,
    groups: ParallelGroups,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    *,
    max_new_tokens: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> float:
    """Fraction of ``examples`` whose greedy response states the reference answer."""
    if not examples:
        raise ValueError("greedy_accuracy needs at least one example")
    if any(e.answer is None for e in examples):
        raise ValueError("every example needs a reference answer to be checked")
    prompts = [
        EncodedPrompt(PromptExample(e.prompt, e.answer, i), tokenizer.apply_chat_template(e.prompt))
        for i, e in enumerate(examples)
    ]
    return evaluation.greedy_accuracy(
        MegatronGenerator.for_model(model, groups, tokenizer), tokenizer, prompts, groups,
        max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,),
        batch_size=batch_size,
    )  # fmt: skip
