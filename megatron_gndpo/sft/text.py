"""SFT of a language model (GPTModel or HybridModel, as ``model.model_class`` says).

A sequence is a chat-templated prompt followed by its response and EOS (:func:`encode_sft`); a
micro-batch is right-padded ``tokens``, next-token ``targets`` and the response ``mask``
(:func:`micro_batch`). Legend as in ``sft/loop.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.models.build import build_model
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups


@dataclasses.dataclass(frozen=True)
class SFTSequence:
    """A chat-templated prompt followed by its response (which ends with EOS)."""

    tokens: tuple[int, ...]
    prompt_length: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_length < len(self.tokens):
            raise ValueError(
                f"an SFT sequence needs a non-empty prompt and response; got prompt_length="
                f"{self.prompt_length} of {len(self.tokens)} tokens"
            )


def encode_sft(tokenizer: Tokenizer, pairs: Iterable[tuple[str, str]]) -> list[SFTSequence]:
    """``(prompt, response)`` texts -> chat template + response ids + EOS."""
    out = []
    for prompt, response in pairs:
        ids = tokenizer.apply_chat_template(prompt)
        out.append(SFTSequence((*ids, *tokenizer.encode(response), tokenizer.eos_id), len(ids)))
    return out


def micro_batch(
    sequences: Sequence[SFTSequence], pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Right-padded ``tokens``, next-token ``targets`` and response ``mask``, each ``[b, L]``;
    ``L`` a multiple of ``multiple`` (the TP size under sequence parallelism)."""
    width = -(-max(len(s.tokens) for s in sequences) // multiple) * multiple
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
        # position t predicts token t + 1: response tokens are prompt_length .. len - 1
        mask[i, s.prompt_length - 1 : len(s.tokens) - 1] = True
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    return {"tokens": tokens, "targets": targets, "mask": mask}


def head_logprobs(
    net: Any, mb: dict[str, torch.Tensor], head: TokenLogProbs, *inputs: Any
) -> torch.Tensor:
    """``net``'s log-probs of ``mb["targets"]`` through the fused ``head``, ``[b, L]``:
    ``net(*inputs, tokens, positions, None)`` (``inputs``: what a family's model takes first)."""
    positions = torch.arange(mb["tokens"].shape[1], device=mb["tokens"].device)
    logprobs_bL: torch.Tensor = net(
        *inputs, mb["tokens"], positions.expand_as(mb["tokens"]), None,
        output_processor=head, output_processor_context=mb["targets"],
    )  # fmt: skip
    return logprobs_bL


class TextFamily:
    """A language model: built by ``models/build.py``, called on tokens and positions."""

    def build(self, model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups) -> Any:
        return build_model(model, parallel, groups)

    def batch(
        self, sequences: Sequence[SFTSequence], pad_id: int, multiple: int
    ) -> dict[str, torch.Tensor]:
        return micro_batch(sequences, pad_id, multiple)

    def logprobs(self, net: Any, mb: dict[str, torch.Tensor], head: TokenLogProbs) -> torch.Tensor:
        return head_logprobs(net, mb, head)


TEXT = TextFamily()
