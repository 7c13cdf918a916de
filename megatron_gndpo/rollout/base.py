"""The rollout contract: token ids in; token ids, response mask and sampler log-probs out.

Legend: N = sequences (prompts x samples per prompt), S = padded sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_gndpo.config.schema import RolloutConfig


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy decoding (evaluation)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    samples_per_prompt: int = 1

    @classmethod
    def from_config(cls, rollout: RolloutConfig, *, eos_id: int) -> SamplingParams:
        return cls(
            max_new_tokens=rollout.max_response_length,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_token_ids=tuple(dict.fromkeys((eos_id, *rollout.stop_token_ids))),
            samples_per_prompt=rollout.samples_per_prompt,
        )


@dataclasses.dataclass
class Rollout:
    """Sampled sequences, right-padded: row i is prompt ``prompt_index[i]``'s k-th sample.

    ``tokens[i, :prompt_lengths[i]]`` is the prompt, ``tokens[i, prompt_lengths[i]:lengths[i]]``
    the response (its stop token included when ``finished[i]``). ``sampler_logprobs[i, t]`` is the
    sampler's log-prob of ``tokens[i, t]`` on response positions, 0 elsewhere. Samples of one
    prompt are contiguous rows (GRPO groups).
    """

    tokens: torch.Tensor  # [N, S] int64
    prompt_lengths: torch.Tensor  # [N] int64
    lengths: torch.Tensor  # [N] int64
    sampler_logprobs: torch.Tensor  # [N, S] float32
    prompt_index: torch.Tensor  # [N] int64
    finished: torch.Tensor  # [N] bool

    @property
    def response_mask(self) -> torch.Tensor:
        """``[N, S]`` bool: True on response tokens (up to and including the stop token)."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (positions >= self.prompt_lengths[:, None]) & (positions < self.lengths[:, None])

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths


class Generator(Protocol):
    """What the trainer needs from a rollout engine."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int
    ) -> Rollout:
        """Sample ``params.samples_per_prompt`` responses for each prompt (token ids)."""
        ...


def sample_next(
    logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step: ``(token ids [B], their log-probs under the sampling distribution)``.

    Temperature, then top-k, then top-p (nucleus) truncation; greedy for temperature 0. The
    log-prob is that of the distribution actually sampled from (what an engine reports).
    """
    logits = logits_BV.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.zeros_like(ids, dtype=torch.float32)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    logprobs = logits.log_softmax(-1)
    ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)
