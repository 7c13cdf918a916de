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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_gndpo.parallel.logprobs import vocab_parallel_logprobs


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


@dataclasses.dataclass(frozen=True)
class TokenLogProbs:
    """GPTModel ``output_processor`` returning float32 ``[b, s]`` log-probs of the targets.

    ``vocab_size`` is the number of real token ids: embedding rows at or beyond it (TP padding,
    rows past the tokenizer) take no probability mass. ``temperature`` divides the logits.
    """

    vocab_size: int
    chunk_tokens: int = 2048
    temperature: float = 1.0

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,  # [s, b, h] ([s/tp, b, h] with sequence parallelism)
        output_layer: Any,
        output_weight: torch.Tensor | None,
        context: torch.Tensor,  # targets [b, s]
        config: Any,
        **_: Any,
    ) -> torch.Tensor:
        if getattr(config, "use_mup", False):
            raise NotImplementedError("MuP logit scaling is not supported by TokenLogProbs")
        hidden_states, weight, tp_group = output_inputs(hidden_states, output_layer, output_weight)
        s, b, h = hidden_states.shape
        targets_SB = context.transpose(0, 1)
        if targets_SB.shape != (s, b):
            raise ValueError(
                f"targets {tuple(context.shape)} do not match the model's [b, s] = ({b}, {s})"
            )
        logprobs = vocab_parallel_logprobs(
            hidden_states.reshape(s * b, h),
            weight,
            targets_SB.reshape(-1),
            tp_group=tp_group if tp_group.size() > 1 else None,
            vocab_size=self.vocab_size,
            chunk_tokens=self.chunk_tokens,
            temperature=self.temperature,
        )
        return logprobs.view(s, b).transpose(0, 1)
