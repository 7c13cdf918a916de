"""How much each transformer layer, and each FFN neuron, of a model matters on calibration text.

    batches = calibration_batches(sequences, pad_id=..., batch_size=8)
    keep, trace = select_layers(net, batches, num_layers=2, importance="kl")
    neurons = ffn_importance(net, batches)           # [L] tensors of [F]

Two measures of a layer's importance, both on the response tokens of calibration sequences:

- ``kl`` (the default): the layer's removal is measured directly. Starting from the whole
  model, each remaining layer is left out in turn and the mean per-token
  ``KL(p_full || p_without)`` over the vocabulary is computed; the layer whose removal costs
  least goes, and the search repeats on what is left until ``num_layers`` remain (greedy). What
  it minimises is what distillation will have to undo: the pruned model's distance from the
  teacher on the teacher's own text. Cost: ``L + (L-1) + ... + (n+1)`` forwards of the shrinking
  model over the calibration set.
- ``cosine``: Block Importance (ShortGPT, Men et al. 2024; Minitron, Muralidharan et al. 2024):
  ``BI_i = 1 - mean_t cos(x_i, x_{i+1})``, the hidden state entering and leaving layer ``i``;
  the ``num_layers`` highest are kept. One forward, whatever the depth: the choice for a deep
  model on a CPU, where the greedy search's forwards add up.

An FFN neuron's importance is the mean absolute value of its activation (the input of the
second FFN linear, ``act(x W_gate) * (x W_up)`` for SwiGLU) over the same tokens: Minitron's
activation-based width importance.

All of it runs on one process with the model at TP=1/PP=1 (``prune/run.py`` builds it so).
Legend: B = sequences of a batch, S = positions, V = vocabulary, H = hidden, F = FFN width.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

from megatron_gndpo.models.naming import decoder_blocks

Importance = Literal["kl", "cosine"]
IMPORTANCES: tuple[Importance, ...] = ("kl", "cosine")


@dataclasses.dataclass(frozen=True)
class CalibrationBatch:
    """Right-padded token ids and the positions whose next-token distribution is measured."""

    tokens: torch.Tensor  # [B, S] int64
    mask: torch.Tensor  # [B, S] bool: True where position t predicts a response token t+1
    images: torch.Tensor | None = None  # [n, 3, H, W]: a VLM's tiles of these rows, in order


def calibration_batches(
    sequences: Sequence[tuple[Sequence[int], int]],
    *,
    pad_id: int,
    batch_size: int,
    images: Sequence[torch.Tensor | None] | None = None,
) -> list[CalibrationBatch]:
    """Batches of ``sequences``, each ``(ids, prompt_length)``: the positions measured are those
    that predict a token of the response (``ids[prompt_length:]``). ``images``: a VLM's tiles
    of each sequence (``[n, 3, H, W]`` or None)."""
    if not sequences:
        raise ValueError("pruning needs at least one calibration sequence")
    batches = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for row, (ids, prompt_length) in enumerate(chunk):
            tokens[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, max(prompt_length - 1, 0) : len(ids) - 1] = True
        tiles = None
        if images is not None:
            present = [t for t in images[start : start + batch_size] if t is not None]
            tiles = torch.cat(present) if present else None
        batches.append(CalibrationBatch(tokens, mask, tiles))
    if not any(bool(b.mask.any()) for b in batches):
        raise ValueError("the calibration sequences have no response tokens to measure")
    return batches


def _language_model(net: Any) -> Any:
    """The module whose decoder is pruned: a VLM's language model, else the model itself."""
    return getattr(net, "language_model", net)


def _layers(net: Any) -> list[tuple[Any, Any]]:
    """The model's GPT layers as (attention, MLP) sublayers: one module twice for a GPTModel,
    hybrid layers 2i and 2i+1 for a HybridModel (``models/naming.py``)."""
    return decoder_blocks(_language_model(net))


@contextlib.contextmanager
def only_layers(net: Any, keep: Sequence[int]) -> Iterator[None]:
    """Run ``net`` with only its layers ``keep`` (in order), as the pruned model would; the
    model's own layer list is restored on exit."""
    owner = _language_model(net).decoder
    everything, blocks = owner.layers, _layers(net)
    kept = [m for i in keep for m in dict.fromkeys(blocks[i])]  # a GPT layer once
    owner.layers = torch.nn.ModuleList(kept)
    try:
        yield
    finally:
        owner.layers = everything


def _device(net: Any) -> torch.device:
    return next(net.parameters()).device


def _logits(net: Any, batch: CalibrationBatch, vocab_size: int) -> torch.Tensor:
    """float32 logits ``[B, S, V]`` of a TP=1 model (a VLM with the batch's images), the
    vocabulary padding cut off."""
    device = _device(net)
    tokens_BS = batch.tokens.to(device)
    positions = torch.arange(tokens_BS.shape[1], device=device).expand_as(tokens_BS)
    if hasattr(net, "language_model"):  # images embedded at their placeholders first
        images = None if batch.images is None else batch.images.to(device)
        logits = net(images, tokens_BS, positions, None)
    else:  # causal: right padding is harmless
        logits = net(tokens_BS, positions, attention_mask=None)
    return logits[..., :vocab_size].float()


@torch.no_grad()
def reference_logprobs(
    net: Any, batches: Sequence[CalibrationBatch], vocab_size: int
) -> list[torch.Tensor]:
    """The whole model's log-probs ``[T, V]`` at each batch's measured positions."""
    return [_logits(net, b, vocab_size)[b.mask.to(_device(net))].log_softmax(-1) for b in batches]


@torch.no_grad()
def kl_from_reference(
    net: Any,
    batches: Sequence[CalibrationBatch],
    reference: Sequence[torch.Tensor],
    vocab_size: int,
) -> float:
    """Mean per-token ``KL(reference || net)`` over the measured positions (nats)."""
    total, count = 0.0, 0
    for b, ref_TV in zip(batches, reference, strict=True):
        logp_TV = _logits(net, b, vocab_size)[b.mask.to(_device(net))].log_softmax(-1)
        total += float((ref_TV.exp() * (ref_TV - logp_TV)).sum())
        count += ref_TV.shape[0]
    return total / max(count, 1)


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """Which layers a pruned model keeps, and what the search measured on the way."""

    keep: tuple[int, ...]  # the teacher's layer indices, in order
    importance: Importance
    scores: dict[str, Any]  # kl: the KL of each removal tried per round; cosine: BI per layer
    kl: float  # the kept layers' KL from the whole model on the calibration tokens


@torch.no_grad()
def select_layers(
    net: Any,
    batches: Sequence[CalibrationBatch],
    *,
    num_layers: int,
    vocab_size: int,
    importance: Importance = "kl",
) -> LayerChoice:
    """The ``num_layers`` layers of ``net`` to keep, by ``importance`` (module docstring)."""
    total = len(_layers(net))
    if not 1 <= num_layers <= total:
        raise ValueError(f"cannot keep {num_layers} of {total} layers: keep 1 to {total}")
    if importance not in IMPORTANCES:
        raise ValueError(f"unknown importance {importance!r}; use one of {IMPORTANCES}")
    net.eval()
    reference = reference_logprobs(net, batches, vocab_size)
    if importance == "cosine":
        bi = block_importance(net, batches)
        order = sorted(range(total), key=lambda i: bi[i], reverse=True)
        keep = tuple(sorted(order[:num_layers]))
        scores: dict[str, Any] = {"block_importance": bi}
    else:
        keep, rounds = _greedy_kl(net, batches, reference, num_layers, vocab_size)
        scores = {"rounds": rounds}
    with only_layers(net, keep):
        kl = kl_from_reference(net, batches, reference, vocab_size)
    return LayerChoice(keep=keep, importance=importance, scores=scores, kl=kl)


def _greedy_kl(
    net: Any,
    batches: Sequence[CalibrationBatch],
    reference: Sequence[torch.Tensor],
    num_layers: int,
    vocab_size: int,
) -> tuple[tuple[int, ...], list[dict[str, float]]]:
    """Drop, one at a time, the layer whose removal moves the model least from ``reference``."""
    keep = list(range(len(_layers(net))))
    rounds: list[dict[str, float]] = []
    while len(keep) > num_layers:
        tried = {}
        for layer in keep:
            with only_layers(net, [i for i in keep if i != layer]):
                tried[layer] = kl_from_reference(net, batches, reference, vocab_size)
        rounds.append({str(k): v for k, v in tried.items()})
        keep.remove(min(tried, key=tried.__getitem__))
    return tuple(keep), rounds


@torch.no_grad()
def block_importance(net: Any, batches: Sequence[CalibrationBatch]) -> list[float]:
    """``1 - mean cos(input, output)`` of each layer's hidden states on the measured tokens."""
    layers = _layers(net)
    sums = [0.0] * len(layers)
    current: dict[str, torch.Tensor] = {}

    def enter(index: int) -> Any:
        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x: torch.Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            current[f"in{index}"] = x

        return record

    def leave(index: int) -> Any:
        def record(module: Any, args: tuple[Any, ...], out: Any) -> None:
            x_in, x_out = current.pop(f"in{index}"), out[0] if isinstance(out, tuple) else out
            mask_SB = current["mask"]  # hidden states are [S, B, H]
            cos = torch.nn.functional.cosine_similarity(
                x_in[mask_SB].float(), x_out[mask_SB].float(), dim=-1
            )
            sums[index] += float((1.0 - cos).sum())

        return record

    handles = []
    for i, (attention, mlp) in enumerate(layers):  # a layer's input, its MLP's output
        handles.append(attention.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(mlp.register_forward_hook(leave(i)))
    count = _run_hooked(net, batches, handles, current)
    return [s / max(count, 1) for s in sums]


@torch.no_grad()
def ffn_importance(net: Any, batches: Sequence[CalibrationBatch]) -> list[torch.Tensor]:
    """Per layer, ``[F]`` the mean absolute activation of each FFN neuron on the measured
    tokens (the input of ``mlp.linear_fc2``)."""
    layers = _layers(net)
    sums: list[torch.Tensor | None] = [None] * len(layers)
    current: dict[str, torch.Tensor] = {}

    def hook(index: int) -> Any:
        def record(module: Any, args: tuple[Any, ...]) -> None:
            x_SBF = args[0]
            total = x_SBF[current["mask"]].float().abs().sum(0)
            sums[index] = total if sums[index] is None else sums[index] + total

        return record

    handles = []
    for i, (_, layer) in enumerate(layers):
        fc2 = getattr(getattr(layer, "mlp", None), "linear_fc2", None)
        if fc2 is None:
            raise ValueError(
                f"layer {i} has no dense FFN (mlp.linear_fc2): width pruning takes dense models"
            )
        handles.append(fc2.register_forward_pre_hook(hook(i)))
    count = _run_hooked(net, batches, handles, current)
    return [(s if s is not None else torch.zeros(0)).cpu() / max(count, 1) for s in sums]


def _run_hooked(
    net: Any, batches: Sequence[CalibrationBatch], handles: list[Any], current: dict[str, Any]
) -> int:
    """Run every batch through ``net`` for the hooks ``handles`` to record, each batch's
    measured tokens in ``current["mask"]`` (``[S, B]``, as the hidden states); then remove the
    hooks. Returns the number of measured tokens."""
    count = 0
    try:
        for b in batches:
            current["mask"] = b.mask.t().to(_device(net))
            _logits(net, b, 1)
            count += int(b.mask.sum())
    finally:
        for h in handles:
            h.remove()
    return count
