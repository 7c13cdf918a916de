"""The rollout contract: token ids in; token ids, response mask and sampler log-probs out.

Legend: N = sequences (prompts x samples per prompt), S = padded sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from megatron_gndpo.config.schema import RolloutConfig
from megatron_gndpo.data.datasets import EncodedPrompt, PromptImages, tiles_of
from megatron_gndpo.seeding import sample_seed


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
    sampler's log-prob of ``tokens[i, t]`` on the tokens it sampled (``sampled_mask``), 0
    elsewhere. Samples of one
    prompt are contiguous rows (GRPO groups).
    """

    tokens: torch.Tensor  # [N, S] int64
    prompt_lengths: torch.Tensor  # [N] int64
    lengths: torch.Tensor  # [N] int64
    sampler_logprobs: torch.Tensor  # [N, S] float32
    prompt_index: torch.Tensor  # [N] int64
    finished: torch.Tensor  # [N] bool
    # [N, S] bool: response tokens the teacher wrote (TrOPD's off-policy prefix); None: none
    teacher_written: torch.Tensor | None = None
    # per row, its prompt's image tiles [n, 3, H, W] (a vision model's rollout); None: text only
    images: list[torch.Tensor | None] | None = None
    # [N, S, L, k] int16: an MoE student's experts at each position as the sampler routed them
    # (this pipeline stage's MoE layers; models/routing.py); None: not recorded
    routing: torch.Tensor | None = None

    @property
    def response_mask(self) -> torch.Tensor:
        """``[N, S]`` bool: True on response tokens (up to and including the stop token)."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (positions >= self.prompt_lengths[:, None]) & (positions < self.lengths[:, None])

    @property
    def sampled_mask(self) -> torch.Tensor:
        """``[N, S]`` bool: the response tokens the student's sampler drew, the ones with a
        ``sampler_logprobs`` entry (the response less any ``teacher_written`` prefix)."""
        mask = self.response_mask
        return mask if self.teacher_written is None else mask & ~self.teacher_written

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths

    def responses(self) -> list[list[int]]:
        """Each row's response ids (its stop token included when it finished)."""
        return [
            self.tokens[i, int(self.prompt_lengths[i]) : int(n)].tolist()
            for i, n in enumerate(self.lengths.tolist())
        ]


class EngineWeights(Protocol):
    """A rollout engine's own copy of the student's weights (vLLM): what a weight sync pushes
    into (``weight_sync/``) and what the check after it probes (``weight_sync/check.py``)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Take full Hugging Face-named tensors (whole layers a call)."""
        ...

    def weight_parts(self) -> frozenset[str] | None:
        """The parts of a vision-language student it takes weights of (None: all of them)."""
        ...

    def prompt_logprobs(self, tokens: Sequence[int]) -> torch.Tensor:
        """Its log-probs of ``tokens[1:]``, each given the tokens before it."""
        ...


class Generator(Protocol):
    """What the trainer needs from a rollout engine: samples, and the engine's lifecycle.

    An engine samples from the trained weights themselves (the built-in generator: no copy to
    update, nothing to free: :class:`InPlaceGenerator`), or holds its own copy
    (:meth:`own_weights`; vLLM): then the trainer wakes it, pushes the weights after each update
    and lets it sleep after sampling, so its memory goes to scoring and training.
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        images: Sequence[PromptImages | None] | None = None,
    ) -> Rollout:
        """Sample ``params.samples_per_prompt`` responses for each prompt (token ids).

        ``seeds[i]`` seeds prompt i's samples alone, so a prompt's samples do not depend on
        which rank samples it or on what else is in the batch. ``images[i]`` are prompt i's
        images (a vision-language model; their placeholders are in the ids); None: text only.
        """
        ...

    def sleep(self) -> None:
        """Free what the engine holds between rollouts (after sampling)."""
        ...

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (before the weights are pushed)."""
        ...

    def own_weights(self) -> EngineWeights | None:
        """The engine's own copy of the weights, which the trainer updates after each step;
        None when it samples from the trained weights themselves."""
        ...


class InPlaceGenerator:
    """The lifecycle of an engine that samples from the trained weights themselves: there is
    no copy to update and nothing to free between rollouts."""

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    def own_weights(self) -> EngineWeights | None:
        return None


def generate_for(
    generator: Generator,
    prompts: Sequence[EncodedPrompt],
    params: SamplingParams,
    seeds: Sequence[int],
    *,
    vision: bool,
    ids: Sequence[Sequence[int]] | None = None,
) -> Rollout:
    """``generator``'s rollout of encoded ``prompts`` (``ids``: their ids, maybe extended; by
    default their own); a vision-language student (``vision``) gets the prompts' images and its
    rows carry their tiles (``Rollout.images``)."""
    ids = [list(p.ids) for p in prompts] if ids is None else ids
    if not vision:
        return generator.generate(ids, params, seeds=seeds)
    images = [p.images for p in prompts]
    rollout = generator.generate(ids, params, seeds=seeds, images=images)
    rollout.images = [tiles_of(images[int(i)]) for i in rollout.prompt_index]
    return rollout


def text_only(images: Sequence[PromptImages | None] | None, engine: str) -> None:
    """Fail clearly when a text-only engine is handed images."""
    if images is not None and any(i is not None for i in images):
        raise ValueError(
            f"{engine} generates text only but the prompts carry images; a vision-language "
            "student needs model.vision set (the multimodal generator)"
        )


class RowStreams:
    """One independent random stream per row: sample k of prompt i is seeded by (seeds[i], k).

    A row's ``j``-th draw decides its ``j``-th response token, whatever the other rows do, so
    a row's sample depends on its seed alone (not on the batch, its slot or the layout).
    """

    def __init__(self, seeds: Sequence[int], samples_per_prompt: int) -> None:
        self.generators = [
            torch.Generator().manual_seed(sample_seed(seed, k))
            for seed in seeds
            for k in range(samples_per_prompt)
        ]

    def uniform(self) -> torch.Tensor:
        """One draw in [0, 1) per row, ``[B]`` float64."""
        return torch.stack(
            [torch.rand((), generator=g, dtype=torch.float64) for g in self.generators]
        )

    def draws(self, count: int) -> torch.Tensor:
        """Each row's next ``count`` draws at once, ``[B, count]`` float64 (column j is what
        the j-th call of :meth:`uniform` would give: a batch of draws is the same stream)."""
        return torch.stack(
            [torch.rand(count, generator=g, dtype=torch.float64) for g in self.generators]
        )


def sample_next(
    logits_BV: torch.Tensor, params: SamplingParams, uniform_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step: ``(token ids [B], their log-probs under the sampling distribution)``.

    Temperature, then top-k, then top-p (nucleus) truncation; greedy for temperature 0. The
    token is drawn by inverting the cumulative distribution (float64) at ``uniform_B`` (one draw
    per row from :class:`RowStreams`). The log-prob is that of the distribution actually
    sampled from (what an engine reports). Runs on the logits' device (``uniform_B`` is moved
    there): only the ids and log-probs need to leave it.
    """
    logits = logits_BV.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.zeros_like(ids, dtype=torch.float32)
    if params.temperature != 1.0:  # x / 1.0 == x: skip a pass over [B, V]
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
    cdf = logprobs.double().exp_().cumsum_(-1)
    uniform = uniform_B.to(device=cdf.device, dtype=torch.float64)
    u = (uniform * cdf[:, -1]).unsqueeze(-1)  # scale: the cdf may end at 1 - 1e-16
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    # a zero-probability token is never chosen: step back to the last token with mass
    ids = torch.where(torch.isinf(logprobs.gather(-1, ids[:, None]).squeeze(-1)),
                      logprobs.argmax(-1), ids)  # fmt: skip
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)


def with_teacher_prefix(
    rollout: Rollout, prefix_lengths: Sequence[int], max_response_length: int
) -> Rollout:
    """A rollout continued from teacher-written prefixes, as one with the prefix in the response.

    ``rollout`` was generated from ``prompt + prefix`` (``prefix_lengths[i]`` tokens for prompt
    ``i``); the result has the original prompt lengths, marks the prefix as ``teacher_written``
    and cuts each response to ``max_response_length`` tokens (a cut row is not finished).
    """
    prefix = torch.tensor(list(prefix_lengths), dtype=torch.long)[rollout.prompt_index]
    prompt_lengths = rollout.prompt_lengths - prefix
    lengths = torch.minimum(rollout.lengths, prompt_lengths + max_response_length)
    finished = rollout.finished & (lengths == rollout.lengths)
    width = int(lengths.max())
    positions = torch.arange(width)
    inside = positions[None, :] < lengths[:, None]
    written = (positions[None, :] >= prompt_lengths[:, None]) & (
        positions[None, :] < rollout.prompt_lengths[:, None]
    )
    return Rollout(
        tokens=torch.where(inside, rollout.tokens[:, :width], 0),
        prompt_lengths=prompt_lengths,
        lengths=lengths,
        sampler_logprobs=torch.where(inside, rollout.sampler_logprobs[:, :width], 0.0),
        prompt_index=rollout.prompt_index,
        finished=finished,
        teacher_written=written,
        routing=None if rollout.routing is None else rollout.routing[:, :width],
    )
