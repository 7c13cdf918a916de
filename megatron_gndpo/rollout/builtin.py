"""Built-in rollouts on the student's own megatron-core weights, with a KV cache.

No extra package, no weight sync (the generator reads the trained model itself), any TP/PP
layout, CPU or GPU. Two decoding paths share the bookkeeping and the sampling:

- ``decoder="lean"`` (the default): :class:`~megatron_gndpo.rollout.decode.CachedDecoder`
  runs the model's own megatron modules with keys rotated once into a slot cache. Each row
  advances from its own prompt end; a finished row leaves the batch at once (the last slots
  move into the holes) and, when ``max_batch_rows`` holds back rows, a pending row is
  prefilled into the freed slot, so the batch stays full.
- ``decoder="megatron"``: megatron's ``StaticInferenceContext`` through the forward-only
  schedule, all rows in lock-step (prefill up to the shortest prompt, then one position per
  forward; a longer prompt's rows keep their prompt tokens meanwhile). The lean path uses it
  by itself for models it does not cover (see ``decode.unsupported_reason``).

Both run with sequence parallelism switched off (``decode.sequence_parallel_off``): a decode
step's one position per row cannot be split over the TP ranks.

The last pipeline stage turns each row's last hidden state into full-vocabulary logits and
samples there, on the model's device (:func:`~megatron_gndpo.rollout.base.sample_next`); only
the token ids and their log-probs go to the host and to the other stages, so all ranks of a
model replica record the same tokens. Row ``r``'s ``j``-th response token uses the ``j``-th draw
of its own stream (:class:`~megatron_gndpo.rollout.base.RowStreams`) on both paths.

Legend: B = rows, R = rows in a step, S = sequence positions, V = vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.models import routing
from megatron_gndpo.models.logprob_head import output_inputs
from megatron_gndpo.parallel.groups import ParallelGroups, schedule_groups
from megatron_gndpo.rollout.base import (
    InPlaceGenerator,
    Rollout,
    RowStreams,
    SamplingParams,
    sample_next,
    text_only,
)
from megatron_gndpo.rollout.decode import (
    CachedDecoder,
    SlotCache,
    inner_model,
    sequence_parallel_off,
    unsupported_reason,
)

log = logging.getLogger(__name__)

Decoder = Literal["lean", "megatron"]


@dataclasses.dataclass(frozen=True)
class LastTokenLogits:
    """float32 ``[b, V]`` sampling logits of the rows' last positions.

    The TP vocabulary shards are gathered (:meth:`gathered`, which the lean decoder calls with
    its own logit shards); embedding rows at or beyond ``vocab_size`` (padding) are set to -inf
    so they are never sampled. Called as a GPTModel ``output_processor`` (megatron's static
    path) it takes the last position of the chunk.
    """

    vocab_size: int

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,  # [s, b, h] (sequence-parallel: [s/tp, b, h])
        output_layer: Any,
        output_weight: torch.Tensor | None,
        **_: Any,
    ) -> torch.Tensor:
        hidden_states, weight, tp_group = output_inputs(hidden_states, output_layer, output_weight)
        return self.gathered(hidden_states[-1] @ weight.t(), tp_group)

    def gathered(self, logits_bv: torch.Tensor, tp_group: Any) -> torch.Tensor:
        """This TP rank's vocabulary shard ``[b, V/tp]`` -> float32 ``[b, V]``, padding masked."""
        logits_bV = logits_bv.float()
        if tp_group.size() > 1:
            shards = [torch.empty_like(logits_bV) for _ in range(tp_group.size())]
            dist.all_gather(shards, logits_bV.contiguous(), group=tp_group)
            logits_bV = torch.cat(shards, dim=-1)
        logits_bV[:, self.vocab_size :] = float("-inf")
        return logits_bV


class _Rows:
    """Every row's tokens, sampler log-probs and length as the steps write them (host)."""

    def __init__(self, rows: list[list[int]], total: int, pad_id: int, params: SamplingParams):
        self.prompt_lengths = torch.tensor([len(r) for r in rows])
        self.tokens = torch.full((len(rows), total), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            self.tokens[i, : len(r)] = torch.tensor(r)
        self.logprobs = torch.zeros(len(rows), total)
        self.lengths = self.prompt_lengths.clone()
        self.budget_end = torch.clamp(self.prompt_lengths + params.max_new_tokens, max=total)
        self.finished = torch.zeros(len(rows), dtype=torch.bool)
        self.stop_ids = torch.tensor(params.stop_token_ids or (-1,))
        self.routing: torch.Tensor | None = None  # [B, total, L, k]: an MoE model's experts

    def generated(self, rows_R: torch.Tensor) -> torch.Tensor:
        """How many tokens each row has sampled so far: the index of its next draw."""
        return self.lengths[rows_R] - self.prompt_lengths[rows_R]

    def record(
        self, rows_R: torch.Tensor, ids_R: torch.Tensor, logp_R: torch.Tensor
    ) -> torch.Tensor:
        """Append one sampled token to each row; True where the row is now done."""
        at = self.lengths[rows_R]
        self.tokens[rows_R, at] = ids_R
        self.logprobs[rows_R, at] = logp_R
        self.lengths[rows_R] = at + 1
        stopped = torch.isin(ids_R, self.stop_ids)
        self.finished[rows_R] = stopped
        return stopped | (at + 1 >= self.budget_end[rows_R])

    def rollout(self, prompts: int, samples_per_prompt: int) -> Rollout:
        width = int(self.lengths.max())
        return Rollout(
            tokens=self.tokens[:, :width].clone(),
            prompt_lengths=self.prompt_lengths,
            lengths=self.lengths,
            sampler_logprobs=self.logprobs[:, :width].clone(),
            prompt_index=torch.arange(prompts).repeat_interleave(samples_per_prompt),
            finished=self.finished,
            routing=None if self.routing is None else self.routing[:, :width].clone(),
        )


class MegatronGenerator(InPlaceGenerator):
    """:class:`Generator` on a megatron-core GPTModel (the student's, or any model + groups).

    ``max_batch_rows`` caps how many rows decode together (None: all at once); the others wait
    and take the slots of finished rows (the lean decoder only). ``decoder`` picks the decoding
    path (module docstring). ``record_routing``: an MoE model's rollouts carry each token's
    experts (``Rollout.routing``, models/routing.py; the lock-step path, which MoE models take).
    """

    def __init__(
        self,
        model: Any,
        groups: ParallelGroups,
        *,
        vocab_size: int,
        pad_id: int,
        max_sequence_length: int,
        max_batch_rows: int | None = None,
        decoder: Decoder = "lean",
        record_routing: bool = False,
    ) -> None:
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be at least 1 (or None), got {max_batch_rows}")
        if decoder not in ("lean", "megatron"):
            raise ValueError(f"decoder must be 'lean' or 'megatron', got {decoder!r}")
        self.model = model
        self.groups = groups
        self.head = LastTokenLogits(vocab_size)
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.max_sequence_length = max_sequence_length
        self.max_batch_rows = max_batch_rows
        self.decoder = decoder
        self.record_routing = record_routing
        self._cached_decoder: CachedDecoder | None = None
        # built once: a decode runs one schedule per token
        self._schedule_groups = schedule_groups(groups, model.config)

    @classmethod
    def for_model(cls, model: Any, groups: ParallelGroups, tokenizer: Any) -> MegatronGenerator:
        """A generator for ``model`` (or its DDP wrapper) on ``groups`` that samples the ids of
        ``tokenizer`` and pads with its pad id, up to the model's own sequence length."""
        inner = getattr(model, "module", model)
        return cls(
            inner, groups, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
            max_sequence_length=int(inner.max_sequence_length),
        )  # fmt: skip

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        images: Sequence[PromptImages | None] | None = None,
    ) -> Rollout:
        text_only(images, "the built-in text generator")
        return self._generate(prompts, params, seeds)

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> Rollout:
        rows = [list(p) for p in prompts for _ in range(params.samples_per_prompt)]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token (check the chat template)")
        longest = max(len(r) for r in rows)
        total = min(longest + params.max_new_tokens, self.max_sequence_length)
        if longest >= total:
            raise ValueError(
                f"a prompt of {longest} tokens leaves no room to generate within "
                f"max_position_embeddings={self.max_sequence_length}; shorten the prompts "
                "(rollout.max_prompt_length)"
            )
        if len(seeds) != len(prompts):
            raise ValueError(f"need one seed per prompt, got {len(seeds)} for {len(prompts)}")
        state = _Rows(rows, total, self.pad_id, params)
        # row r's j-th response token uses draws[r, j], whichever path and batch it is in
        draws = RowStreams(seeds, params.samples_per_prompt).draws(params.max_new_tokens)
        # decided before sequence parallelism is off: the trainer's passes run with it
        record = self.record_routing and routing.tracks_routing(self._language_model())
        was_training = self.model.training
        self.model.eval()
        try:
            with sequence_parallel_off(self.model):
                decoder = self._lean_decoder()
                if decoder is None:
                    with torch.no_grad():
                        self._lockstep(state, params, draws, record)
                else:  # nothing made here is kept but the host-side tokens: no autograd books
                    with torch.inference_mode():
                        self._continuous(decoder, state, params, draws)
        finally:
            self.model.train(was_training)
        return state.rollout(len(prompts), params.samples_per_prompt)

    # -- the lean path: rows at their own positions in a slot cache -----------------------

    def _lean_decoder(self) -> CachedDecoder | None:
        if self.decoder != "lean":
            return None
        if self._cached_decoder is None:
            language_model = self._language_model()
            reason = unsupported_reason(language_model)
            if reason is not None:
                log.warning("built-in rollouts use megatron's static inference path: %s", reason)
                self.decoder = "megatron"
                return None
            self._cached_decoder = CachedDecoder(
                language_model, self.groups, self.head, max_length=self.max_sequence_length
            )
        return self._cached_decoder

    def _continuous(
        self, decoder: CachedDecoder, state: _Rows, params: SamplingParams, draws: torch.Tensor
    ) -> None:
        n_rows, total = state.tokens.shape
        capacity = min(n_rows, self.max_batch_rows or n_rows)
        cache = decoder.new_cache(capacity, total)
        decoder.prepare(capacity)
        try:
            self._fill_and_decode(decoder, cache, state, params, draws)
        finally:
            decoder.release()

    def _fill_and_decode(
        self,
        decoder: CachedDecoder,
        cache: SlotCache,
        state: _Rows,
        params: SamplingParams,
        draws: torch.Tensor,
    ) -> None:
        """Until every row is done: prefill pending rows into free slots, else decode a step."""
        n_rows = state.tokens.shape[0]
        capacity = cache.keys[0].shape[0] if cache.keys else n_rows
        pending = collections.deque(range(n_rows))
        live: list[int] = []  # live[s]: the row in slot s (slots 0..len-1 are full)
        while pending or live:
            if pending and len(live) < capacity:  # fill the free slots: prefill whole prompts
                new = [pending.popleft() for _ in range(min(capacity - len(live), len(pending)))]
                rows_R = torch.tensor(new)
                prompt_lengths = state.prompt_lengths[rows_R]
                tokens_RT = state.tokens[rows_R, : int(prompt_lengths.max())]
                logits = decoder.prefill(
                    cache, len(live), tokens_RT, prompt_lengths - 1,
                    self._prefill_embeddings(new, tokens_RT),
                )  # fmt: skip
                live += new
            else:  # one position per live row: its last token
                rows_R = torch.tensor(live)
                positions = state.lengths[rows_R] - 1
                logits = decoder.decode(cache, state.tokens[rows_R, positions], positions)
            ids, logp = self._sample(logits, params, draws[rows_R, state.generated(rows_R)])
            done = state.record(rows_R, ids, logp)
            if bool(done.any()):
                live = _compact(cache, live, set(rows_R[done].tolist()))

    def _prefill_embeddings(self, rows: list[int], tokens_RT: torch.Tensor) -> torch.Tensor | None:
        """The first stage's input embeddings ``[T, R, h]`` for a prefill; None: the tokens'."""
        return None

    def _language_model(self) -> Any:
        """The GPTModel that decodes (a VLM's language model)."""
        return inner_model(self.model)

    # -- sampling, on the last stage --------------------------------------------------------

    def _sample(
        self, logits_RV: torch.Tensor | None, params: SamplingParams, uniform_R: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on the last stage; every rank gets the ids and log-probs (host, ``[R]``)."""
        device = next(self.model.parameters()).device
        if logits_RV is not None:
            ids, logp = sample_next(logits_RV, params, uniform_R)
            packed = torch.stack((ids.double(), logp.double()))  # ids < 2**53: exact
        else:
            packed = torch.empty(2, uniform_R.shape[0], dtype=torch.float64, device=device)
        if self.groups.layout.pp > 1:  # every stage records the same tokens
            last = dist.get_process_group_ranks(self.groups.pp)[-1]
            dist.broadcast(packed, src=last, group=self.groups.pp)
        packed = packed.cpu()
        return packed[0].long(), packed[1].float()

    # -- megatron's static path: all rows in lock-step --------------------------------------

    def _lockstep(
        self, state: _Rows, params: SamplingParams, draws: torch.Tensor, record: bool
    ) -> None:
        """``record``: keep each token's experts (an MoE model whose routing is tracked)."""
        model = self._language_model()
        if not record:
            self._lockstep_steps(state, params, draws, None)
            return
        with routing.recording(model) as replays:  # each forward's experts, kept per position
            rows, total = state.tokens.shape
            state.routing = routing.empty_routing(rows, total, len(replays), routing.topk(model))
            self._lockstep_steps(state, params, draws, replays)

    def _lockstep_steps(
        self, state: _Rows, params: SamplingParams, draws: torch.Tensor, replays: list[Any] | None
    ) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        batch, total = state.tokens.shape
        context = StaticInferenceContext(batch, total)
        done = torch.zeros(batch, dtype=torch.bool)
        start, end = 0, int(state.prompt_lengths.min())
        device = next(self.model.parameters()).device
        while True:
            busy = end < total and not bool(done.all())
            # an MoE model's EP ranks exchange tokens in every forward: all step until all are
            # done, a rank whose own rows are done with an idle forward of their first tokens
            # (no KV cache; its result is dropped)
            if not self.groups.expert_max(int(busy), device):
                break
            if not busy:
                self._forward_last(state.tokens[:, :1], 0, None)
                continue
            logits_BV = self._forward_last(state.tokens[:, start:end], start, context)
            if state.routing is not None and replays is not None:  # what the sampler routed
                k = state.routing.shape[-1]
                state.routing[:, start:end] = routing.recorded(replays, batch, end - start, k)
            context.sequence_len_offset += end - start
            rows_R = ((state.prompt_lengths <= end) & ~done).nonzero()[:, 0]
            if rows_R.numel():
                logits_RV = None if logits_BV is None else logits_BV[rows_R.to(logits_BV.device)]
                ids, logp = self._sample(logits_RV, params, draws[rows_R, state.generated(rows_R)])
                done[rows_R] = state.record(rows_R, ids, logp)
            start, end = end, end + 1

    def _forward_last(
        self, chunk_BS: torch.Tensor, offset: int, context: Any
    ) -> torch.Tensor | None:
        """Logits ``[B, V]`` of the chunk's last position on the last stage; None elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = next(self.model.parameters()).device
        positions = torch.arange(offset, offset + chunk_BS.shape[1]).expand_as(chunk_BS)
        batch = [(chunk_BS.to(device), positions.to(device))]

        def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
            tokens, pos = next(data_iterator)
            out = self._call_model(net, tokens, pos, context)
            return out, lambda output, non_loss_data=True: output

        outputs = get_forward_backward_func(pp_size=self.groups.layout.pp)(
            forward_step_func=forward_step,
            data_iterator=iter(batch),
            model=[self.model],
            num_microbatches=1,
            seq_length=chunk_BS.shape[1],
            micro_batch_size=chunk_BS.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
            **self._schedule_groups,
        )
        return outputs[0] if self.groups.is_last_stage else None

    def _call_model(
        self, net: Any, tokens_BS: torch.Tensor, positions_BS: torch.Tensor, context: Any
    ) -> torch.Tensor:
        """One forward of the chunk (subclasses add inputs, e.g. images)."""
        out: torch.Tensor = net(
            tokens_BS, positions_BS, None, inference_context=context, output_processor=self.head
        )
        return out


def _compact(cache: SlotCache, live: list[int], done: set[int]) -> list[int]:
    """Drop the done rows from the batch: the last live slots move into their holes."""
    kept = [s for s, row in enumerate(live) if row not in done]
    holes = [s for s in range(len(kept)) if live[s] in done]
    movers = [s for s in kept if s >= len(kept)]
    cache.move(holes, movers)
    compacted = live[: len(kept)]
    for hole, mover in zip(holes, movers, strict=True):
        compacted[hole] = live[mover]
    return compacted
