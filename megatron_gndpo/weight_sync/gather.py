"""Full Hugging Face tensors from the student's TP/PP/EP shards, one parameter at a time.

Every rank of a model replica (its TP x PP ranks) calls :func:`iter_hf_weights` and receives
the *same* sequence of full, Hugging Face-named tensors. That is what a colocated engine wants:
each trainer rank hosts a shard of the rollout engine, and vLLM's ``load_weights`` takes full
tensors and slices them for its own TP rank itself. Per parameter:

1. the pipeline stage that owns it all-gathers its TP shards over ``groups.tp`` (along the
   parameter's ``partition_dim``; a gated ``linear_fc1`` holds ``[gate_r; up_r]`` per rank, so
   each half is gathered separately: the inverse of ``hf_mapping.shard_for_rank``);
2. an expert of a mixture-of-experts layer (expert parallelism, EP > 1) lives on one rank of
   each expert-parallel group: that rank's TP group gathers it (over the expert-TP group, the
   same ranks), then broadcasts it over ``groups.ep``;
3. the owning stage broadcasts the full megatron tensor over ``groups.pp`` (every stage gets it);
4. :mod:`megatron_gndpo.checkpoint.hf_mapping` splits it into HF tensors (q/k/v, gate/up) and
   trims the vocabulary padding; experts are named as in a Qwen3-MoE checkpoint
   (``model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight`` with the global expert index
   ``e``, :mod:`~megatron_gndpo.checkpoint.hf_moe`), which is what vLLM's Qwen3-MoE
   ``load_weights`` reads.

Cost: every rank of the replica holds one full megatron tensor at a time (the largest is the
``[V, H]`` embedding) and receives every tensor once; data-parallel replicas work independently,
on their own groups, except that with EP > 1 the replicas of one expert-parallel group (EP of
the DP ranks) each send the others their own experts. Tied embeddings are written once (as
``model.embed_tokens.weight``); the last stage's copy of the embedding is not sent and no
``lm_head.weight`` is produced.

A vision-language model (``vision`` set) is sent as transformers' InternVL names it: the language
model under ``language_model.``, then (when ``parts`` asks for them) the projector
(``multi_modal_projector.``) and the vision tower (``vision_tower.``), from
:mod:`~megatron_gndpo.checkpoint.vlm_mapping`. ``parts`` lets a sync skip what the engine already
holds (a frozen encoder) or never uses (the vision side when the engine gets image embeddings).

The iterator runs collectives: every rank of the replica (and, with EP > 1, of its
expert-parallel group) must exhaust it, in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.checkpoint import hf_mapping, hf_moe, vlm_convert, vlm_mapping
from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.parallel.groups import ParallelGroups

# What a vision-language model's sync may hold, by megatron name prefix.
VLM_PARTS: dict[str, str] = {part: megatron for part, (megatron, _) in vlm_mapping.PARTS.items()}


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """One full megatron parameter, the HF tensors it becomes and how (GPT or VLM mapping)."""

    megatron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    gated: bool  # a SwiGLU fc1: TP shards hold [gate_r; up_r]


def _mappings(
    model_cfg: ModelConfig, vision: VisionConfig | None, parts: Collection[str]
) -> list[_Mapping]:
    """The mappings to send, in order: the language model first, then the vision side."""
    if vision is None:
        gpt = hf_mapping.iter_mappings(model_cfg)
        return [
            _Mapping(
                m.megatron,
                m.hf,
                functools.partial(m.to_hf, model=model_cfg),
                gated=model_cfg.swiglu and m.kind == "fc1",
            )
            for m in gpt
        ]
    unknown = sorted(set(parts) - set(VLM_PARTS))
    if unknown:
        raise ValueError(f"unknown weight-sync part(s) {unknown}; choose from {sorted(VLM_PARTS)}")
    ordered = [
        *(m for m in vlm_mapping.iter_vlm_mappings(model_cfg, vision) if m.lm is not None),
        *(m for m in vlm_mapping.iter_vision_mappings(vision)),
    ]
    prefixes = tuple(VLM_PARTS[p] for p in parts)
    return [
        _Mapping(
            m.megatron,
            m.hf,
            functools.partial(m.to_hf, model=model_cfg, vision=vision),
            gated=model_cfg.swiglu and m.lm is not None and m.lm.kind == "fc1",
        )
        for m in ordered
        if m.megatron.startswith(prefixes)
    ]


def _canonical(name: str, vision: VisionConfig | None) -> str:
    """A parameter's name in local-spec form (TE aliases resolved; VLM prefix kept)."""
    if vision is not None and name.startswith(VLM_PARTS["language"]):
        lm = VLM_PARTS["language"]
        return lm + hf_mapping.canonical_name(name.removeprefix(lm))
    return hf_mapping.canonical_name(name)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One full-model megatron parameter: the stage holding it and its TP-gathered shape."""

    name: str  # as the model names it (global layer and expert index; TE aliases kept)
    stage: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    ep_rank: int | None = None  # an expert: the expert-parallel rank holding it (EP > 1)


def merge_tp_shards(
    name: str, shards: Sequence[torch.Tensor], *, partition_dim: int, swiglu: bool
) -> torch.Tensor:
    """The full megatron tensor from its TP shards in rank order (inverse of ``shard_for_rank``).

    A gated ``linear_fc1`` shard (a dense MLP's or an expert's) is ``[gate_r; up_r]``: the full
    tensor is ``[gate_0 .. gate_{tp-1}; up_0 .. up_{tp-1}]``, not the plain concatenation.
    """
    if swiglu and ".linear_fc1." in name:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([h[0] for h in halves], dim=partition_dim)
        up = torch.cat([h[1] for h in halves], dim=partition_dim)
        return torch.cat([gate, up], dim=0)
    return torch.cat(list(shards), dim=partition_dim)


def _is_tp_sharded(param: torch.Tensor, tp: int) -> bool:
    return tp > 1 and bool(getattr(param, "tensor_model_parallel", False))


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if _is_tp_sharded(param, tp):
        shape[int(param.partition_dim)] *= tp  # type: ignore[attr-defined]
    return tuple(shape)


def _unwrap(model: Any) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers (one model chunk only)."""
    if isinstance(model, list | tuple):
        if len(model) != 1:
            raise NotImplementedError(
                f"weight sync takes one model chunk, got {len(model)} (virtual pipeline stages "
                "are not supported)"
            )
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    assert isinstance(model, torch.nn.Module)
    return model


def _entries(
    local: Mapping[str, torch.Tensor],
    groups: ParallelGroups,
    mappings: Sequence[_Mapping],
    *,
    tied: bool,
    vision: VisionConfig | None,
) -> dict[str, _Entry]:
    """Every stage's parameters, keyed by canonical (local-spec) name; checked against the map.

    One object all-gather over ``groups.pp``: a stage knows its own layers only, and every
    stage must know the shape of what it is about to receive. With EP > 1 a second one over
    ``groups.ep``: a rank knows its own experts only.
    """
    layout = groups.layout
    tp, stage = layout.tp, groups.coords["pp"]
    mine = [(name, stage, _full_shape(p, tp), p.dtype) for name, p in local.items()]
    if layout.pp > 1:
        per_stage: list[Any] = [None] * layout.pp
        dist.all_gather_object(per_stage, mine, group=groups.pp)
        everything = [(*item, None) for items in per_stage for item in items]
    else:
        everything = [(*item, None) for item in mine]
    if layout.ep > 1:
        # Over the EP group (one stage's ranks of the same expert-TP rank, in EP rank order):
        # the other ranks' experts; everything else they hold is what this rank holds.
        per_ep: list[Any] = [None] * layout.ep
        dist.all_gather_object(per_ep, everything, group=groups.ep)
        dense = [(*item[:4], None) for item in everything if not _is_expert(item[0])]
        experts = [
            (*item[:4], ep_rank)
            for ep_rank, items in enumerate(per_ep)
            for item in items
            if _is_expert(item[0])
        ]
        everything = dense + experts
    entries: dict[str, _Entry] = {}
    for name, owner, shape, dtype, ep_rank in everything:
        key = _canonical(name, vision)
        if key in entries:
            raise ValueError(
                f"megatron parameter {name!r} is held by two pipeline stages or expert-parallel "
                "ranks"
            )
        entries[key] = _Entry(name, owner, tuple(shape), dtype, ep_rank)
    expected = {m.megatron for m in mappings}
    # A tied model's last stage keeps its own copy of the embedding: not an HF tensor.
    lm = VLM_PARTS["language"] if vision is not None else ""
    ignored = {lm + "output_layer.weight"} if tied else set()
    unmapped = sorted(set(entries) - expected - ignored)
    missing = sorted(expected - set(entries))
    if unmapped or missing:
        if unmapped:
            what = f"{unmapped[0]!r} has no Hugging Face mapping"
        else:
            what = f"{missing[0]!r} is held by no pipeline stage"
        raise ValueError(
            f"megatron parameter {what} ({len(unmapped)} unmapped, {len(missing)} missing): the "
            "model config (layers, qkv bias, qk-norm, tied embeddings) does not match the model"
        )
    return entries


def _is_expert(name: str) -> bool:
    return hf_moe.expert_index(name) is not None


def _gather_tp(
    name: str, param: torch.Tensor, groups: ParallelGroups, dtype: torch.dtype, swiglu: bool
) -> torch.Tensor:
    """The full tensor of one parameter of this stage, on every TP rank of the stage."""
    shard = param.detach().to(dtype).contiguous()  # cast first: less to send when narrowing
    tp = groups.layout.tp
    if not _is_tp_sharded(param, tp):
        return shard
    shards = [torch.empty_like(shard) for _ in range(tp)]
    # Over the TP group: its ranks hold the slices of this parameter (same stage, same replica).
    # An expert's slices are spread over the expert-TP group (the same ranks: expert TP = TP).
    group = groups.tp
    if _is_expert(name) and groups.expt_tp is not None:
        group = groups.expt_tp
    dist.all_gather(shards, shard, group=group)
    return merge_tp_shards(
        name,
        shards,
        partition_dim=int(param.partition_dim),  # type: ignore[attr-defined]
        swiglu=swiglu,
    )


def iter_hf_weights(
    model: Any,
    groups: ParallelGroups,
    model_cfg: ModelConfig,
    *,
    family: str,
    dtype: torch.dtype | None = None,
    vision: VisionConfig | None = None,
    parts: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full tensor)`` for every HF tensor of the model, on every rank.

    Call on every rank of the replica described by ``groups`` (TP and PP collectives; with
    expert parallelism, EP collectives with the other replicas of the expert-parallel group) and
    exhaust the iterator on all of them. Order: embedding, layers by global index, final norm,
    ``lm_head`` (untied only), then a VLM's projector and vision tower. ``dtype`` casts the
    weights (before any communication); None keeps the model's. Tensors lie on the model's
    device and are contiguous; without a cast, a tensor TP does not shard may share storage with
    its parameter (copy what you keep past the next optimizer step). ``vision``: the model is a
    VLM with this vision config; ``parts``: which of :data:`VLM_PARTS` to send (None: all).
    """
    hf_mapping.check_family(model_cfg, family)
    net = _unwrap(model)
    mappings = _mappings(model_cfg, vision, VLM_PARTS if parts is None else parts)
    layout, coords = groups.layout, groups.coords
    if vision is None:
        offset = hf_mapping.expert_offset(model_cfg, layout, groups.rank)
        local = {full: p for _, full, p in hf_mapping.global_names(net, expert_offset=offset)}
    else:
        sent = tuple(VLM_PARTS[p] for p in (VLM_PARTS if parts is None else parts))
        local = {
            full: param for _, full, param in vlm_convert.vlm_global_names(net)
            if full.startswith(sent)
        }  # fmt: skip
    entries = _entries(local, groups, mappings, tied=model_cfg.tie_embeddings, vision=vision)
    device = next(net.parameters()).device
    expert_coords = layout.expert_coords(groups.rank)
    for mapping in mappings:
        entry = entries[mapping.megatron]
        out_dtype = dtype or entry.dtype
        my_stage = entry.stage == coords["pp"]
        if my_stage and entry.ep_rank in (None, expert_coords["ep"]):
            full = _gather_tp(entry.name, local[entry.name], groups, out_dtype, mapping.gated)
        else:
            full = torch.empty(entry.shape, dtype=out_dtype, device=device)
        if my_stage and entry.ep_rank is not None:
            # Over the EP group: the replicas' ranks of this stage and expert-TP rank; the
            # holder's copy is full (its TP group gathered it).
            holder = layout.rank_of(expert_coords | {"ep": entry.ep_rank})
            dist.broadcast(full, src=holder, group=groups.ep)
        if layout.pp > 1:
            # Over the PP group: the same TP rank of every stage; the owner's copy is full.
            owner = layout.rank_of(coords | {"pp": entry.stage})
            dist.broadcast(full, src=owner, group=groups.pp)
        for name, tensor in zip(mapping.hf, mapping.to_hf(full), strict=True):
            yield name, tensor.contiguous()
        del full
