"""Greedy accuracy of a megatron-core GPT on held-out problems with verifiable answers.

Greedy decoding (temperature 0, stop at EOS) with the built-in KV-cached generator, the
response decoded and checked by :func:`megatron_gndpo.rewards.verifiable.reward`. Any model and
layout: ``groups`` are the model's own; problems are sharded over its data-parallel ranks and
the counts summed over its DP x CP group (TP ranks of a replica generate the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rewards.verifiable import reward
from megatron_gndpo.rollout.base import SamplingParams
from megatron_gndpo.rollout.builtin import MegatronGenerator

# Rows generated in lock-step; bounds the KV cache and the padding of finished rows.
DEFAULT_BATCH_SIZE = 64


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
    # TODO(house): shared greedy decode
    inner = getattr(model, "module", model)
    generator = MegatronGenerator(
        inner, groups, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
        max_sequence_length=int(inner.max_sequence_length),
    )  # fmt: skip
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_id,)
    )
    texts = []
    for start in range(0, len(prompts), batch_size):
        ids = [tokenizer.apply_chat_template(p) for p in prompts[start : start + batch_size]]
        rollout = generator.generate(ids, params, seeds=[0] * len(ids))  # greedy: seeds unused
        for i, end in enumerate(rollout.lengths.tolist()):
            response = rollout.tokens[i, int(rollout.prompt_lengths[i]) : end].tolist()
            texts.append(tokenizer.decode(response))
    return texts


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
    mine = examples[groups.coords["dp"] :: groups.layout.dp]
    counts = torch.zeros(2, dtype=torch.float64)  # [correct, total]
    if mine:
        texts = greedy_texts(
            model, groups, tokenizer, [e.prompt for e in mine],
            max_new_tokens=max_new_tokens, batch_size=batch_size,
        )  # fmt: skip
        correct = sum(reward(t, str(e.answer)) for t, e in zip(texts, mine, strict=True))
        counts += torch.tensor([correct, float(len(mine))], dtype=torch.float64)
    dist.all_reduce(counts, group=groups.dp_cp)
    return float(counts[0] / counts[1])
