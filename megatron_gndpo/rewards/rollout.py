"""The verifiable reward of every row of a rollout: its response's text against its prompt's
reference answer (the RLVR estimators' reward, the evaluation's accuracy)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.rewards.verifiable import reward
from megatron_gndpo.rollout.base import Rollout


def rollout_rewards(
    rollout: Rollout, prompts: Sequence[EncodedPrompt], tokenizer: Tokenizer
) -> torch.Tensor | None:
    """``[n]`` rewards (1.0 when row ``i``'s response states its prompt's answer), or None when
    a prompt of the rollout has no answer."""
    answers = [prompts[int(i)].example.answer for i in rollout.prompt_index]
    if any(a is None for a in answers):
        return None
    texts = [tokenizer.decode(ids) for ids in rollout.responses()]
    return torch.tensor([reward(t, str(a)) for t, a in zip(texts, answers, strict=True)])
