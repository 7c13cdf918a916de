"""The verifiable reward of every row of a rollout: its response's text against its prompt's
reference answer (the RLVR estimators' reward, the evaluation's accuracy), matched as
``data.answer_match`` says: ``final`` the final answer the response states (verifiable.py),
``first_sentence`` a short answer in its first sentence (short_answer.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.rewards.short_answer import short_answer_reward
from megatron_gndpo.rewards.verifiable import reward
from megatron_gndpo.rollout.base import Rollout

MATCHES: dict[str, Callable[[str, str], float]] = {
    "final": reward,
    "first_sentence": short_answer_reward,
}


def rollout_rewards(
    rollout: Rollout,
    prompts: Sequence[EncodedPrompt],
    tokenizer: Tokenizer,
    *,
    match: str = "final",
) -> torch.Tensor | None:
    """``[n]`` rewards (1.0 when row ``i``'s response states its prompt's answer), or None when
    a prompt of the rollout has no answer."""
    answers = [prompts[int(i)].example.answer for i in rollout.prompt_index]
    if any(a is None for a in answers):
        return None
    texts = [tokenizer.decode(ids) for ids in rollout.responses()]
    score = MATCHES[match]
    return torch.tensor([score(t, str(a)) for t, a in zip(texts, answers, strict=True)])
