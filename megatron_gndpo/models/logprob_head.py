"""Per-token log-probs straight from the final hidden states: no model ever produces logits.

megatron-core 0.19's ``GPTModel.forward`` takes an ``output_processor`` that replaces the output
layer on the last pipeline stage. :class:`TokenLogProbs` is that processor: it feeds the final
hidden states and the (vocab-parallel) output weight to the fused, chunked
``vocab_parallel_logprobs``, so neither the student (with gradients) nor the teacher ever holds
``[tokens, vocab]`` logits, fp32 or otherwise.

    head = TokenLogProbs(vocab_size=151_665)
    logprobs_BS = model(tokens_BS, positions_BS, None, output_processor=head,
                        output_processor_context=targets_BS)     # float32 [b, s]

``targets[b, s]`` is the token whose log-prob is wanted at position ``s`` (usually
``tokens[b, s + 1]``; the caller masks the last position).

A :class:`ScoreContext` instead of the targets asks for more per position, still without
logits: log-probs of ``K`` other ids (a teacher's top-k, a guidance token), the entropy, and
(forward only) the model's own top-k. The head then returns :class:`Scores`, one ``[b, s]`` or
``[b, s, K]`` field per output asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_gndpo.parallel.logprobs import (
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
    vocab_parallel_token_stats,
)
from megatron_gndpo.parallel.vocab_stats import vocab_parallel_kl, vocab_parallel_sample


def output_inputs(
    hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """What the output layer would multiply: ``(hidden [s, b, h], weight [V/tp, h], tp_group)``.

    The weight is the tied embedding when given, else the output layer's own. With sequence
    parallelism the hidden states are gathered along the sequence; the gather's backward only
    splits (``tensor_parallel_output_grad=False``) because the fused log-prob already
    all-reduces the hidden-state gradient over TP.
    """
    weight = output_layer.weight if output_weight is None else output_weight
    tp_group = output_layer.tp_group
    if output_layer.sequence_parallel:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=tp_group
        )
    return hidden_states, weight, tp_group


@dataclasses.dataclass
class Scores:
    """One model's per-token scores: ``logprobs`` always, every other field only when asked for.

    The head returns them by position (``x[:, s]``: what position ``s`` predicts, ``[b, s]``);
    ``engine/scoring.score_batch`` by token (``x[:, t]`` belongs to token ``t``, ``[B, S]``).
    :class:`ScoreContext` (the head) and ``engine/scoring.ScoreRequest`` (a batch) say what
    each field holds. Code that moves scores (broadcasts, exchanges) iterates :meth:`items`,
    so a new field needs no second list of names.
    """

    logprobs: torch.Tensor  # [b, s] float32
    topk_ids: torch.Tensor | None = None  # [b, s, K] int64
    topk_logprobs: torch.Tensor | None = None  # [b, s, K] float32
    extra_logprobs: torch.Tensor | None = None  # [b, s, K] float32: of the extra ids
    entropy: torch.Tensor | None = None  # [b, s] float32
    kl: torch.Tensor | None = None  # [b, s] float32: KL(p || this model), full vocabulary
    sampled_ids: torch.Tensor | None = None  # [b, s] int64
    hidden: torch.Tensor | None = None  # [b, s, H], the model's dtype

    @property
    def device(self) -> torch.device:
        """Where the scores are (megatron's schedules ask a forward's output for its device to
        place an MoE model's router-loss scale)."""
        return self.logprobs.device

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(field name, tensor)`` of every field present, in field order."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Scores:
        """``fn`` applied to every field present (absent fields stay None)."""
        return dataclasses.replace(self, **{name: fn(value) for name, value in self.items()})

    def to(self, device: torch.device | str) -> Scores:
        return self.map(lambda value: value.to(device))


@dataclasses.dataclass(frozen=True)
class ScoreContext:
    """What the head computes per position beyond the targets' log-probs.

    Fields of the :class:`Scores` returned: ``logprobs [b, s]`` always; ``extra_logprobs
    [b, s, K]`` (log-probs of ``extra_ids``) when given; ``entropy [b, s]`` when asked;
    ``topk_logprobs`` and ``topk_ids [b, s, top_k]`` when ``top_k > 0``; ``hidden``, ``kl``
    and ``sampled_ids`` as below (all forward only: no gradient). The log-probs and the
    entropy are differentiable when the model runs with gradients.
    """

    targets: torch.Tensor  # [b, s] int64
    extra_ids: torch.Tensor | None = None  # [b, s, K] int64
    entropy: bool = False
    top_k: int = 0
    hidden: bool = False  # also return the final hidden states, ``hidden [b, s, H]``
    # KL(p ‖ this model) over the full vocabulary, ``kl [b, s]``: p is another model's
    # distribution at temperature 1, given by its hidden states [b, s, H_p] and its output
    # weight shard (the same vocabulary rows per TP rank as this model's)
    kl_hidden: torch.Tensor | None = None
    kl_weight: torch.Tensor | None = None
    # draw one token per position from this model (``sampled_ids [b, s]``), Gumbel-max with a
    # generator seeded by this (the same on every TP rank: the draw does not depend on TP)
    sample_seed: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogProbs:
    """GPTModel ``output_processor`` returning float32 ``[b, s]`` log-probs of the targets.

    ``vocab_size`` is the number of real token ids: embedding rows at or beyond it (TP padding,
    rows past the tokenizer) take no probability mass. ``temperature`` divides the logits.
    ``excluded_ids`` take no mass either: ids the rollout never samples (a VLM's image
    placeholder), so the policy scored and trained is the one sampled from; a target that is
    one of them (a prompt position before an image) scores as another id, to be masked out.
    """

    vocab_size: int
    chunk_tokens: int = 2048
    temperature: float = 1.0
    excluded_ids: tuple[int, ...] = ()

    def _allowed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with every excluded id replaced by the first id that is not excluded."""
        if not self.excluded_ids:
            return ids
        stand_in = next(i for i in range(self.vocab_size) if i not in self.excluded_ids)
        excluded = torch.tensor(self.excluded_ids, device=ids.device)
        return torch.where(torch.isin(ids, excluded), stand_in, ids)

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,  # [s, b, h] ([s/tp, b, h] with sequence parallelism)
        output_layer: Any,
        output_weight: torch.Tensor | None,
        context: torch.Tensor,  # targets [b, s]
        config: Any,
        **_: Any,
    ) -> torch.Tensor | Scores:
        if getattr(config, "use_mup", False):
            raise NotImplementedError("MuP logit scaling is not supported by TokenLogProbs")
        hidden_states, weight, tp_group = output_inputs(hidden_states, output_layer, output_weight)
        s, b, h = hidden_states.shape
        request = context if isinstance(context, ScoreContext) else ScoreContext(context)
        if request.targets.shape != (b, s):
            raise ValueError(
                f"targets {tuple(request.targets.shape)} do not match the model's [b, s] = "
                f"({b}, {s})"
            )
        hidden_TH = hidden_states.reshape(s * b, h)
        kwargs: dict[str, Any] = {
            "tp_group": tp_group if tp_group.size() > 1 else None,
            "vocab_size": self.vocab_size,
            "chunk_tokens": self.chunk_tokens,
            "temperature": self.temperature,
        }
        if self.excluded_ids:
            kwargs["excluded_ids"] = self.excluded_ids
        if not isinstance(context, ScoreContext):  # the hot path: sampled tokens only
            targets_T = self._allowed(_tokens_first(context))
            logprobs = vocab_parallel_logprobs(hidden_TH, weight, targets_T, **kwargs)
            return logprobs.view(s, b).transpose(0, 1)
        return self._scores(hidden_TH, weight, request, (s, b), kwargs)

    def _scores(
        self,
        hidden_TH: torch.Tensor,
        weight: torch.Tensor,
        request: ScoreContext,
        sb: tuple[int, int],
        kwargs: dict[str, Any],
    ) -> Scores:
        """The :class:`ScoreContext` outputs, ``[b, s]`` / ``[b, s, K]``."""
        targets_T = self._allowed(_tokens_first(request.targets))
        ids = targets_T.unsqueeze(-1)  # one pass for the targets, the K other ids and entropy
        if request.extra_ids is not None:
            ids = torch.cat([ids, self._allowed(_tokens_first(request.extra_ids))], -1)
        if request.entropy:
            logp_TK, entropy_T = vocab_parallel_logprobs_and_entropy(
                hidden_TH, weight, ids, **kwargs
            )
        else:
            logp_TK = vocab_parallel_logprobs(hidden_TH, weight, ids, **kwargs)
        out = Scores(logp_TK[:, 0])
        if request.extra_ids is not None:
            out.extra_logprobs = logp_TK[:, 1:]
        if request.entropy:
            out.entropy = entropy_T
        if request.hidden:
            out.hidden = hidden_TH.detach()
        if request.sample_seed is not None:
            generator = torch.Generator(device=hidden_TH.device).manual_seed(request.sample_seed)
            out.sampled_ids = vocab_parallel_sample(
                hidden_TH.detach(), weight.detach(), generator=generator, **kwargs
            )
        if request.kl_hidden is not None:
            assert request.kl_weight is not None, "kl_hidden needs kl_weight"
            # this model's logits / τ = (hidden / τ) · Wᵀ: p stays at temperature 1
            out.kl = vocab_parallel_kl(
                _tokens_first(request.kl_hidden), request.kl_weight,
                hidden_TH.detach() / self.temperature, weight.detach(),
                **(kwargs | {"temperature": 1.0}),
            )  # fmt: skip
        if request.top_k:
            stats = vocab_parallel_token_stats(
                hidden_TH.detach(), weight.detach(), targets_T, top_k=request.top_k, **kwargs
            )
            out.topk_logprobs, out.topk_ids = stats.topk_logprobs, stats.topk_ids
        return out.map(lambda value: _batch_first(value, sb))


def _tokens_first(x_bs: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` -> ``[s·b, ...]`` in the hidden states' (sequence-major) order."""
    return x_bs.transpose(0, 1).reshape(-1, *x_bs.shape[2:])


def _batch_first(x_T: torch.Tensor, sb: tuple[int, int]) -> torch.Tensor:
    """``[s·b, ...]`` -> ``[b, s, ...]``."""
    return x_T.view(*sb, *x_T.shape[1:]).transpose(0, 1)
