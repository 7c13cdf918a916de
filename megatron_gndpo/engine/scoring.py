"""Forward-only scoring of a rollout batch at any TP/PP: per-token log-probs, never logits.

Used for the teacher's log-probs and the student's "old" log-probs. The batch is split into
micro-batches by a token budget and run through megatron-core's forward-only pipeline schedule
on the model's own process groups (the teacher's layout may differ from the student's); the last
pipeline stage returns the log-probs (see :func:`broadcast_from_last_stage` for other stages).

Two ways to fill a micro-batch, with the same numbers (tests check it):

- padded: rows of similar length together, right-padded to the longest row of the micro-batch;
- packed: several rows concatenated into one, with a block-diagonal causal attention mask. RoPE
  depends only on relative positions, which the packing preserves inside each segment; learned
  absolute positions get per-segment position ids.

Under sequence parallelism megatron splits a micro-batch's sequence over the TP ranks, so its
length is padded to a multiple of the TP size (:func:`sequence_multiple`; the update pads alike).

A :class:`ScoreRequest` asks for more than each token's log-prob, on the same pass: the model's
top-k at every position, or the log-probs of other given ids (a vOPD teacher scores the
student's top-k ids; TGPO/TrOPD students are trained towards the teacher's top-k). The results
come back as one typed :class:`Scores` (defined beside the head that fills it,
``models/logprob_head.py``), from the head through the pipeline broadcast and the teacher's
exchange to the method: no string-keyed dicts on the way.

Legend: B = rows, S = padded row length, L = micro-batch row length, K = ids per position.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo import seeding
from megatron_gndpo.models.inputs import forward_args
from megatron_gndpo.models.logprob_head import ScoreContext, Scores, TokenLogProbs
from megatron_gndpo.models.routing import RoutingPass
from megatron_gndpo.parallel.groups import ParallelGroups, schedule_groups


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """What :func:`score_batch` computes per token beyond its log-prob (scoring convention).

    ``top_k``: the model's ``top_k`` most likely ids at token ``t``'s position (given
    ``tokens[:t]``) and their log-probs. ``extra_ids [B, S, K]``: ids whose log-probs are wanted
    at token ``t``'s position (0 where unused; must be valid ids). ``entropy``: the entropy of
    the model's distribution at token ``t``'s position. ``hidden``: the final hidden states
    that predict token ``t`` (``hidden [B, S, H]``, the model's dtype; last stage only, never
    broadcast). ``full_kl``: ``kl [B, S]`` = KL(p ‖ this model) over the full vocabulary, p
    given by ``kl_hidden [B, S, H_p]`` (another model's ``hidden``) and ``kl_weight`` (its
    output-weight shard), both needed on the last stage only. ``sample_seed``:
    ``sampled_ids [B, S]``, a token drawn from the model at token ``t``'s position (each
    micro-batch seeds its draw from ``sample_seed`` and its first row).
    """

    top_k: int = 0
    extra_ids: torch.Tensor | None = None
    entropy: bool = False
    hidden: bool = False
    full_kl: bool = False
    kl_hidden: torch.Tensor | None = None
    kl_weight: torch.Tensor | None = None
    sample_seed: int | None = None

    def template(self, rows: int, width: int) -> Scores:
        """The :class:`Scores` that :func:`score_batch` returns for ``[rows, width]``, as
        tensors on the meta device (shapes and dtypes, no data); ``hidden``, whose size is the
        model's, is left out (it stays on the last stage)."""
        k, extra, seed = self.top_k, self.extra_ids, self.sample_seed

        def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        return Scores(
            meta(rows, width),
            topk_ids=meta(rows, width, k, dtype=torch.int64) if k else None,
            topk_logprobs=meta(rows, width, k) if k else None,
            extra_logprobs=None if extra is None else meta(rows, width, extra.shape[-1]),
            entropy=meta(rows, width) if self.entropy else None,
            kl=meta(rows, width) if self.full_kl else None,
            sampled_ids=None if seed is None else meta(rows, width, dtype=torch.int64),
        )

    def specs(self, rows: int, width: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every :class:`Scores` field of :meth:`template`, by field name."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self.template(rows, width).items()}


def required(value: torch.Tensor | None, what: str) -> torch.Tensor:
    """``value``, which the method's :class:`ScoreRequest` must have asked for."""
    if value is None:
        raise ValueError(f"{what} was not scored: the method's ScoreRequest must ask for it")
    return value


def plan_padded(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``token_budget`` padded tokens.

    Rows are taken longest first, so rows of similar length share a micro-batch and little is
    padding; a row longer than the budget forms a micro-batch alone.
    """
    _check_budget(token_budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for row in order:
        if batches:
            current = batches[-1]
            longest = lengths[current[0]]  # rows arrive longest first
            if (len(current) + 1) * longest <= token_budget:
                current.append(row)
                continue
        batches.append([row])
    return batches


def plan_packed(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Rows packed (first fit, longest first) into bins of at most ``token_budget`` tokens."""
    _check_budget(token_budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for row in order:
        for k, free in enumerate(room):
            if lengths[row] <= free:
                bins[k].append(row)
                room[k] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(token_budget - lengths[row])
    return bins


def _check_budget(token_budget: int) -> None:
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")


@dataclasses.dataclass
class _MicroBatch:
    rows: list[int]
    tokens: torch.Tensor  # [b, L]
    positions: torch.Tensor  # [b, L]
    targets: torch.Tensor  # [b, L]: the next token at each position (0 where none)
    attention_mask: torch.Tensor | None  # [b, 1, L, L], True = masked; None = plain causal
    segments: list[tuple[int, int, int]]  # (row, batch index, start) of each original row
    extra: torch.Tensor | None = None  # [b, L, K]: the extra ids of the next token's position
    kl_hidden: torch.Tensor | None = None  # [b, L, H_p]: p's hidden states at each position
    images: torch.Tensor | None = None  # [N, 3, H, W]: the rows' image tiles, row by row

    def context(self, request: ScoreRequest | None, device: torch.device) -> Any:
        """The head's context: the targets alone, or a :class:`ScoreContext`."""
        targets = self.targets.to(device)
        if request is None:
            return targets
        extra = None if self.extra is None else self.extra.to(device)
        kl_hidden = None if self.kl_hidden is None else self.kl_hidden.to(device)
        sample_seed = None
        if request.sample_seed is not None:  # one stream per micro-batch, by its first row
            sample_seed = seeding.sample_seed(request.sample_seed, self.rows[0])
        return ScoreContext(
            targets, extra_ids=extra, entropy=request.entropy, top_k=request.top_k,
            hidden=request.hidden, kl_hidden=kl_hidden, kl_weight=request.kl_weight,
            sample_seed=sample_seed,
        )  # fmt: skip


def _next_position_extras(
    extra_BSK: torch.Tensor | None,
    rows: list[int],
    lengths: list[int],
    placement: list[tuple[int, int]],
    shape: tuple[int, int],
) -> torch.Tensor | None:
    """Per-token extras (ids, hidden states) moved to the position that predicts their token:
    ``out[p] = extra[p + 1]``."""
    if extra_BSK is None:
        return None
    out = torch.zeros(*shape, extra_BSK.shape[-1], dtype=extra_BSK.dtype)
    for r, (index, start) in zip(rows, placement, strict=True):
        n = lengths[r]
        out[index, start : start + n - 1] = extra_BSK[r, 1:n]
    return out


def sequence_multiple(model: Any) -> int:
    """What a micro-batch's length must be a multiple of: the TP size under sequence
    parallelism (megatron splits the sequence over the TP ranks), else 1."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return int(config.tensor_model_parallel_size) if config.sequence_parallel else 1


def padded_positions(width: int, multiple: int) -> torch.Tensor:
    """Position ids ``[L]`` of a micro-batch of ``width`` real columns padded to a multiple of
    ``multiple``: the padding columns (whose outputs are dropped, and which no real position
    attends to) sit at position 0, so they never pass a learned position table's end."""
    positions = torch.arange(-(-width // multiple) * multiple)
    positions[width:] = 0
    return positions


def _padded_micro_batch(
    tokens_BS: torch.Tensor,
    lengths: list[int],
    rows: list[int],
    extra: torch.Tensor | None,
    kl_hidden: torch.Tensor | None = None,
    pad: int = 0,
    multiple: int = 1,
) -> _MicroBatch:
    positions_L = padded_positions(max(lengths[r] for r in rows), multiple)
    width = positions_L.shape[0]
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : lengths[r]] = tokens_BS[r, : lengths[r]]
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    positions = positions_L.unsqueeze(0).expand(len(rows), -1)
    segments = [(r, i, 0) for i, r in enumerate(rows)]
    placement = [(i, 0) for i in range(len(rows))]
    shape = (len(rows), width)
    extras = _next_position_extras(extra, rows, lengths, placement, shape)
    hidden = _next_position_extras(kl_hidden, rows, lengths, placement, shape)
    return _MicroBatch(rows, tokens, positions, targets, None, segments, extras, hidden)


def _packed_micro_batch(
    tokens_BS: torch.Tensor,
    lengths: list[int],
    rows: list[int],
    extra: torch.Tensor | None,
    kl_hidden: torch.Tensor | None = None,
    multiple: int = 1,
) -> _MicroBatch:
    total = -(-sum(lengths[r] for r in rows) // multiple) * multiple
    tokens = torch.zeros(1, total, dtype=torch.long)
    targets = torch.zeros_like(tokens)
    positions = torch.zeros_like(tokens)  # the padding to a multiple: position 0
    # the padding to a multiple is a segment of its own (no real row attends to it, and its
    # queries see a key, their own: no all-masked softmax row)
    segment_id = torch.full((total,), len(rows), dtype=torch.long)
    segments, start = [], 0
    for k, r in enumerate(rows):
        n = lengths[r]
        tokens[0, start : start + n] = tokens_BS[r, :n]
        targets[0, start : start + n - 1] = tokens_BS[r, 1:n]
        positions[0, start : start + n] = torch.arange(n)
        segment_id[start : start + n] = k
        segments.append((r, 0, start))
        start += n
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    same_segment = segment_id.unsqueeze(0) == segment_id.unsqueeze(1)
    mask = ~(causal & same_segment)  # megatron convention: True = masked out
    placement = [(0, start) for _, _, start in segments]
    extras = _next_position_extras(extra, rows, lengths, placement, (1, total))
    hidden = _next_position_extras(kl_hidden, rows, lengths, placement, (1, total))
    mask_11LL = mask.view(1, 1, total, total)
    return _MicroBatch(rows, tokens, positions, targets, mask_11LL, segments, extras, hidden)


def score_tokens(
    model: Any,
    groups: ParallelGroups,
    tokens_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    head: TokenLogProbs,
    token_budget: int,
    pack: bool = False,
) -> torch.Tensor | None:
    """Log-probs of every token given its prefix, float32 ``[B, S]``, on the last stage.

    ``out[b, t] = log p(tokens[b, t] | tokens[b, :t])`` for ``1 <= t < lengths[b]``; 0 at t = 0
    and at padding. Every rank of the model's layout calls it with the same rows of its data
    shard (TP ranks of one pipeline hold the same rows); ranks off the last stage get None.
    """
    scores = score_batch(
        model, groups, tokens_BS, lengths_B, head=head, token_budget=token_budget, pack=pack
    )
    return None if scores is None else scores.logprobs


def score_batch(
    model: Any,
    groups: ParallelGroups,
    tokens_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    head: TokenLogProbs,
    token_budget: int,
    pack: bool = False,
    request: ScoreRequest | None = None,
    images: Sequence[torch.Tensor | None] | None = None,
    routing: RoutingPass | None = None,
) -> Scores | None:
    """:func:`score_tokens` plus what ``request`` asks for: :class:`Scores` ``[B, S]`` /
    ``[B, S, K]`` (as :meth:`ScoreRequest.template`, and ``hidden`` when asked); every field is
    0 at t = 0 and at padding.
    ``images``: for a vision-language model, each row's image tiles (None for a row without);
    the ids already hold their placeholders, so positions are those of the ids.
    ``routing``: an MoE model's routers replay or record the rows' experts (models/routing.py).
    """
    lengths = _checked_lengths(tokens_BS, lengths_B, request)
    if images is not None and pack:
        raise ValueError("rows with images are scored padded, not packed (pack_sequences=false)")
    device = next(model.parameters()).device
    micro_batches = _micro_batches(
        model, tokens_BS, lengths, token_budget=token_budget, pack=pack, request=request,
        images=images,
    )  # fmt: skip
    # an MoE model's EP ranks exchange tokens in every forward: equally many micro-batches on
    # each (idle ones repeat the last, their results dropped)
    count = groups.expert_max(len(micro_batches), device)
    idle = dataclasses.replace(micro_batches[-1], segments=[])
    micro_batches += [idle] * (count - len(micro_batches))

    def forward_step(data_iterator: Any, net: Any) -> tuple[Any, Any]:
        mb = next(data_iterator)
        mask = None if mb.attention_mask is None else mb.attention_mask.to(device)
        tiles = None if mb.images is None else mb.images.to(device)
        inputs = forward_args(
            mb.tokens.to(device), mb.positions.to(device), mask, vision=images is not None,
            images=tiles,
        )  # fmt: skip
        b, s = mb.tokens.shape
        if routing is not None:
            routing.before(mb.segments, b, s, device)
        output = net(
            *inputs, output_processor=head, output_processor_context=mb.context(request, device)
        )
        if routing is not None:
            routing.after(mb.segments, b, s)
        return output, lambda output, non_loss_data=True: _detached(output)

    outputs = _forward_only(model, groups, micro_batches, forward_step, routing)
    if not groups.is_last_stage:
        return None
    return _assembled(outputs, micro_batches, lengths, request, tokens_BS)


def _checked_lengths(
    tokens_BS: torch.Tensor, lengths_B: torch.Tensor, request: ScoreRequest | None
) -> list[int]:
    """The rows' lengths, once the shapes of the tokens, lengths and extra ids agree."""
    if tokens_BS.dim() != 2 or lengths_B.shape != tokens_BS.shape[:1]:
        raise ValueError(
            f"expected tokens [B, S] and lengths [B], got {tuple(tokens_BS.shape)} and "
            f"{tuple(lengths_B.shape)}"
        )
    extra = None if request is None else request.extra_ids
    if extra is not None and extra.shape[:2] != tokens_BS.shape:
        raise ValueError(
            f"extra_ids {tuple(extra.shape)} must be [B, S, K] with [B, S] = "
            f"{tuple(tokens_BS.shape)}"
        )
    lengths = [int(n) for n in lengths_B.tolist()]
    if any(n < 1 or n > tokens_BS.shape[1] for n in lengths):
        raise ValueError(f"every length must be in [1, {tokens_BS.shape[1]}], got {lengths}")
    return lengths


def _micro_batches(
    model: Any,
    tokens_BS: torch.Tensor,
    lengths: list[int],
    *,
    token_budget: int,
    pack: bool,
    request: ScoreRequest | None,
    images: Sequence[torch.Tensor | None] | None,
) -> list[_MicroBatch]:
    """The rows in micro-batches of at most ``token_budget`` tokens, padded or packed; a VLM's
    rows padded with an id that is not its image placeholder, each with its rows' tiles."""
    plan = plan_packed if pack else plan_padded
    extra = None if request is None or request.extra_ids is None else request.extra_ids.cpu()
    kl_hidden = None if request is None or request.kl_hidden is None else request.kl_hidden.cpu()
    multiple, tokens = sequence_multiple(model), tokens_BS.cpu()
    if pack:
        return [
            _packed_micro_batch(tokens, lengths, rows, extra, kl_hidden, multiple=multiple)
            for rows in plan(lengths, token_budget)
        ]
    pad = 0
    if images is not None:
        from megatron.core.utils import get_attr_wrapped_model

        pad = pad_id_for(get_attr_wrapped_model(model, "image_token_index"))
    out = [
        _padded_micro_batch(tokens, lengths, rows, extra, kl_hidden, pad, multiple)
        for rows in plan(lengths, token_budget)
    ]
    if images is not None:
        for mb in out:
            mb.images = row_images(images, mb.rows)
    return out


def _forward_only(
    model: Any,
    groups: ParallelGroups,
    micro_batches: list[_MicroBatch],
    forward_step: Any,
    routing: RoutingPass | None,
) -> list[Any]:
    """megatron-core's forward-only schedule over ``micro_batches`` on the model's own groups,
    in eval mode and without gradients; the last stage's outputs (none elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    was_training = model.training
    model.eval()
    try:
        routers: contextlib.AbstractContextManager[Any] = (
            routing.active() if routing else contextlib.nullcontext()
        )
        with torch.no_grad(), routers:
            return list(
                get_forward_backward_func(pp_size=groups.layout.pp)(
                    forward_step_func=forward_step,
                    data_iterator=iter(micro_batches),
                    model=[model],
                    num_microbatches=len(micro_batches),
                    seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
                    micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
                    forward_only=True,
                    collect_non_loss_data=True,
                    **schedule_groups(groups, model.config),
                )
            )
    finally:
        model.train(was_training)


def _assembled(
    outputs: list[Any],
    micro_batches: list[_MicroBatch],
    lengths: list[int],
    request: ScoreRequest | None,
    tokens_BS: torch.Tensor,
) -> Scores:
    """The micro-batches' outputs back in their rows, each value at the token it scores."""
    template = (request or ScoreRequest()).template(*tokens_BS.shape)
    if request is not None and request.hidden and outputs:
        hidden_bLH = required(outputs[0].hidden, "hidden")
        template.hidden = torch.empty(
            (*tokens_BS.shape, hidden_bLH.shape[-1]), dtype=hidden_bLH.dtype, device="meta"
        )
    out = template.map(lambda t: torch.zeros_like(t, device="cpu"))
    for mb, output in zip(micro_batches, outputs, strict=True):
        values = output if isinstance(output, Scores) else Scores(output)
        for row, index, start in mb.segments:
            n = lengths[row]
            for name, value in values.items():
                # what position t predicts belongs to token t + 1
                getattr(out, name)[row, 1:n] = value[index, start : start + n - 1].cpu()
    return out.to(tokens_BS.device)


def score_multimodal(
    model: Any,
    groups: ParallelGroups,
    tokens_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    images: Sequence[torch.Tensor | None],
    *,
    head: TokenLogProbs,
    token_budget: int,
) -> torch.Tensor | None:
    """Log-probs of every text token given its prefix and images, float32 ``[B, S]``.

    ``out[b, t] = log p(tokens[b, t] | tokens[b, :t], images of row b)`` for
    ``1 <= t < lengths[b]`` where ``tokens[b, t]`` is not an image placeholder; 0 at image
    positions, at t = 0 and at padding. ``images[b]`` is row b's tiles ``[N_b, 3, H, W]`` (None
    without images). Every rank of the model's layout calls it with the same rows; ranks off the
    last stage get None. The trainer's scoring (:func:`score_batch` with ``images``)
    with the image positions zeroed. Each row's ids hold its images' expanded placeholders
    (``data/images.py``), so a response that starts right after an image gets the log-prob of
    its first token from the last image position (which megatron's LLaVA labels path drops).
    """
    from megatron.core.utils import get_attr_wrapped_model

    if len(images) != tokens_BS.shape[0]:
        raise ValueError(
            f"expected one image entry per row: {tokens_BS.shape[0]} rows, {len(images)} entries"
        )
    scores = score_batch(
        model, groups, tokens_BS, lengths_B, head=head, token_budget=token_budget, images=images
    )
    if scores is None:
        return None
    out_BS = scores.logprobs
    image_token_id = get_attr_wrapped_model(model, "image_token_index")
    out_BS[tokens_BS == image_token_id] = 0.0  # an image position has no token log-prob
    return out_BS


def pad_id_for(image_token_id: int) -> int:
    """A padding id that is not the image placeholder (padding must not take an image)."""
    return 1 if image_token_id == 0 else 0


def row_images(images: Sequence[torch.Tensor | None], rows: Sequence[int]) -> torch.Tensor | None:
    """The tiles of ``rows``, concatenated in row order (None when none has an image)."""
    tiles = [t for t in (images[r] for r in rows) if t is not None and t.shape[0] > 0]
    return torch.cat(tiles) if tiles else None


def _detached(output: torch.Tensor | Scores) -> Any:
    if isinstance(output, Scores):
        return output.map(torch.Tensor.detach)
    return output.detach().float()


def broadcast_from_last_stage(
    value: torch.Tensor | None,
    shape: Sequence[int],
    groups: ParallelGroups,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Give every pipeline stage the last stage's tensor (float32, ``shape``) on ``device``.

    Pass the model's device on GPUs so the broadcast goes through NCCL, not gloo.
    """
    if value is not None:
        value = value.to(device)
    if groups.layout.pp == 1:
        assert value is not None
        return value
    buffer = (
        value
        if value is not None
        else torch.empty(tuple(shape), dtype=torch.float32, device=device)
    )
    last = dist.get_process_group_ranks(groups.pp)[-1]
    dist.broadcast(buffer, src=last, group=groups.pp)
    return buffer


def broadcast_scores(
    scores: Scores | None,
    template: Scores,
    groups: ParallelGroups,
    device: torch.device | str = "cpu",
) -> Scores:
    """:func:`broadcast_from_last_stage` for every field of ``template``
    (:meth:`ScoreRequest.template`: the same fields on every stage, so every rank of the pipeline
    makes the same broadcasts in the same order); ``hidden``, not in the template, stays on the
    last stage."""
    if groups.layout.pp == 1:
        assert scores is not None
        return scores.to(device)
    last = dist.get_process_group_ranks(groups.pp)[-1]
    if scores is None:  # off the last stage: a buffer for every field of the template
        scores = template.map(lambda t: torch.empty_like(t, device=device))
    out = dataclasses.replace(scores)
    for name, _ in template.items():
        buffer = getattr(scores, name).to(device)
        dist.broadcast(buffer, src=last, group=groups.pp)
        setattr(out, name, buffer)
    return out
