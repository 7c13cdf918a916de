"""Built-in rollouts on the student's own megatron-core weights, with a static KV cache.

No extra package, no weight sync (the generator reads the trained model itself), any TP/PP
layout, CPU or GPU. All rows of a batch advance in lock-step, as in megatron's static engine:
the prompts are prefilled up to the shortest one in a single forward, then one position per
forward; a row whose prompt is longer keeps its prompt token at that position instead of a
sample. Each forward goes through megatron-core's forward-only schedule (so stages exchange
activations as in training) with megatron's ``StaticInferenceContext`` holding the KV cache;
the last stage turns the last position's hidden state into full-vocabulary logits (``[B, V]``,
small) and every stage receives them, so all ranks of a model replica sample the same tokens
from the same per-row random streams.

Legend: B = rows, S = sequence positions, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.engine.scoring import schedule_groups
from megatron_gndpo.models.logprob_head import output_inputs
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.rollout.base import (
    Rollout,
    RowStreams,
    SamplingParams,
    sample_next,
    text_only,
)


@dataclasses.dataclass(frozen=True)
class LastTokenLogits:
    """GPTModel ``output_processor``: float32 ``[b, V]`` logits of the last position only.

    The TP vocabulary shards are gathered; embedding rows at or beyond ``vocab_size`` (padding)
    are set to -inf so they are never sampled.
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
        logits_bV = (hidden_states[-1] @ weight.t()).float()  # [b, V/tp]
        if tp_group.size() > 1:
            shards = [torch.empty_like(logits_bV) for _ in range(tp_group.size())]
            dist.all_gather(shards, logits_bV.contiguous(), group=tp_group)
            logits_bV = torch.cat(shards, dim=-1)
        logits_bV[:, self.vocab_size :] = float("-inf")
        return logits_bV


class MegatronGenerator:
    """:class:`Generator` on a megatron-core GPTModel (the student's, or any model + groups)."""

    def __init__(
        self,
        model: Any,
        groups: ParallelGroups,
        *,
        vocab_size: int,
        pad_id: int,
        max_sequence_length: int,
    ) -> None:
        self.model = model
        self.groups = groups
        self.head = LastTokenLogits(vocab_size)
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.max_sequence_length = max_sequence_length
        # built once: a decode runs one schedule per token
        self._schedule_groups = schedule_groups(groups, model.config)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        images: Sequence[PromptImages | None] | None = None,
    ) -> Rollout:
        from megatron.core.inference.contexts import StaticInferenceContext

        text_only(images, "the built-in text generator")

        rows = [list(p) for p in prompts for _ in range(params.samples_per_prompt)]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token (check the chat template)")
        prompt_len = torch.tensor([len(r) for r in rows])
        total = min(int(prompt_len.max()) + params.max_new_tokens, self.max_sequence_length)
        if int(prompt_len.max()) >= total:
            raise ValueError(
                f"a prompt of {int(prompt_len.max())} tokens leaves no room to generate within "
                f"max_position_embeddings={self.max_sequence_length}; shorten the prompts "
                "(rollout.max_prompt_length)"
            )
        batch = len(rows)
        tokens = torch.full((batch, total), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        sampler_logprobs = torch.zeros(batch, total)
        lengths = torch.full((batch,), total, dtype=torch.long)
        budget_end = torch.clamp(prompt_len + params.max_new_tokens, max=total)
        done = torch.zeros(batch, dtype=torch.bool)
        finished = torch.zeros(batch, dtype=torch.bool)
        stop_ids = torch.tensor(params.stop_token_ids or (-1,))
        if len(seeds) != len(prompts):
            raise ValueError(f"need one seed per prompt, got {len(seeds)} for {len(prompts)}")
        streams = RowStreams(seeds, params.samples_per_prompt)
        context = StaticInferenceContext(batch, total)

        start, end = 0, int(prompt_len.min())
        was_training = self.model.training
        self.model.eval()
        try:
            while end < total and not bool(done.all()):
                logits_BV = self._forward_last(tokens[:, start:end], start, context)
                context.sequence_len_offset += end - start
                sampled, logp = sample_next(logits_BV, params, streams.uniform())
                generating = (prompt_len <= end) & ~done
                tokens[:, end] = torch.where(generating, sampled, tokens[:, end])
                tokens[done, end] = self.pad_id
                sampler_logprobs[:, end] = torch.where(generating, logp, 0.0)
                stopped = generating & torch.isin(sampled, stop_ids)
                truncated = generating & ~stopped & (end + 1 >= budget_end)
                lengths = torch.where(stopped | truncated, end + 1, lengths)
                finished |= stopped
                done |= stopped | truncated
                start, end = end, end + 1
        finally:
            self.model.train(was_training)
        width = int(lengths.max())
        return Rollout(
            tokens=tokens[:, :width].clone(),
            prompt_lengths=prompt_len,
            lengths=lengths,
            sampler_logprobs=sampler_logprobs[:, :width].clone(),
            prompt_index=torch.arange(len(prompts)).repeat_interleave(params.samples_per_prompt),
            finished=finished,
        )

    def _forward_last(self, chunk_BS: torch.Tensor, offset: int, context: Any) -> torch.Tensor:
        """Logits ``[B, V]`` of the chunk's last position, on every rank of the replica."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = next(self.model.parameters()).device
        positions = torch.arange(offset, offset + chunk_BS.shape[1]).expand_as(chunk_BS)
        batch = [(chunk_BS.to(device), positions.to(device))]

        def forward_step(data_iterator: Any, net: Any) -> tuple[torch.Tensor, Any]:
            tokens, pos = next(data_iterator)
            out = self._call_model(net, tokens, pos, context)
            return out, lambda output, non_loss_data=True: output

        layout = self.groups.layout
        with torch.no_grad():
            outputs = get_forward_backward_func(pp_size=layout.pp)(
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
        logits = outputs[0] if self.groups.is_last_stage else None
        if layout.pp > 1:  # every stage samples the same tokens: give it the logits
            if logits is None:
                logits = torch.empty(chunk_BS.shape[0], self._width(), device=device)
            last = dist.get_process_group_ranks(self.groups.pp)[-1]
            dist.broadcast(logits, src=last, group=self.groups.pp)
        assert logits is not None
        return logits.cpu()

    def _call_model(
        self, net: Any, tokens_BS: torch.Tensor, positions_BS: torch.Tensor, context: Any
    ) -> torch.Tensor:
        """One forward of the chunk (subclasses add inputs, e.g. images)."""
        out: torch.Tensor = net(
            tokens_BS, positions_BS, None, inference_context=context, output_processor=self.head
        )
        return out

    def _width(self) -> int:
        """Width of the gathered logits: the padded vocabulary of the model."""
        inner = getattr(self.model, "module", self.model)
        return int(inner.vocab_size)
