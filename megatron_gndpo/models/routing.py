"""Expert routing of a mixture-of-experts student: recorded by the sampler, compared with the
trainer's, and optionally replayed in training (rollout routing replay, "R3").

The router of each MoE layer picks every token's top-k experts. The built-in sampler decodes
with a KV cache, one position at a time, while the trainer recomputes whole sequences in other
micro-batches: the same weights can route a token to other experts, and an RL update then
trains a policy other than the one that sampled (a known source of instability in MoE RL:
Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers"). Everything here runs through megatron-core's own ``RouterReplay``
(``TransformerConfig.moe_enable_routing_replay``): ``RECORD`` keeps the top-k indices a router
chose in its last forward, ``REPLAY_FORWARD`` makes it use the indices given instead (the
routing weights are still the router's scores at those experts, so the router trains).

Layout: a router sees its input ``[s, b, h]`` flattened to ``[s*b, h]``, so its indices
``[s*b, k]`` are sequence-major. A row's routing is kept as ``[S, L, k]`` (L: this pipeline
stage's MoE layers, in layer order; k: the top-k, sorted), every rank keeping its own stage's
layers. Sequence and context parallelism split a sequence over ranks before the router; the
rules refuse them with routing replay (checks/rules.py) and the metric is then not taken.

Legend: n = rows, S = positions, L = this stage's MoE layers, k = top-k, b/s = a micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# (row, index in the micro-batch, first position): where a row sits in a micro-batch [b, s]
Segment = tuple[int, int, int]


def routers(model: Any) -> list[Any]:
    """This stage's ``RouterReplay`` objects, one per MoE layer in layer order ([] when the
    model is dense or was built without ``moe_enable_routing_replay``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        m.router_replay
        for m in model.modules()
        if isinstance(m, TopKRouter) and m.router_replay is not None
    ]


def topk(model: Any) -> int:
    """The model's top-k (experts per token)."""
    from megatron.core.utils import get_model_config

    return int(get_model_config(model).moe_router_topk)


def tracks_routing(model: Any) -> bool:
    """Whether the routing of ``model`` can be recorded and replayed here: an MoE model built
    with routing replay, without sequence or context parallelism (module docstring)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return (
        bool(getattr(config, "moe_enable_routing_replay", False))
        and not config.sequence_parallel
        and config.context_parallel_size == 1
    )


def empty_routing(rows: int, positions: int, layers: int, k: int) -> torch.Tensor:
    """``[n, S, L, k]`` int16 holding experts ``0..k-1`` everywhere: distinct experts for the
    positions nothing routed (padding, a row's last token), which replay may still be given."""
    base = torch.arange(k, dtype=torch.int16)
    return base.expand(rows, positions, layers, k).clone()


@contextlib.contextmanager
def _routers_doing(model: Any, action: str) -> Iterator[list[Any]]:
    """This stage's routers in megatron's ``RouterReplayAction`` ``action`` while inside; their
    indices cleared before and after (replay also keeps a list for recompute: dropped)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = routers(model)
    for r in replays:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction[action])
    try:
        yield replays
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


def recording(model: Any) -> contextlib.AbstractContextManager[list[Any]]:
    """Every router of this stage records its choices while inside (megatron's ``RECORD``)."""
    return _routers_doing(model, "RECORD")


def replaying(model: Any) -> contextlib.AbstractContextManager[list[Any]]:
    """Every router of this stage uses the indices :func:`set_targets` gives it."""
    return _routers_doing(model, "REPLAY_FORWARD")


def recorded(replays: Sequence[Any], b: int, s: int, k: int) -> torch.Tensor:
    """The last forward's choices as ``[b, s, L, k]`` (each token's experts sorted)."""
    if not replays:  # a pipeline stage without MoE layers
        return torch.zeros(b, s, 0, k, dtype=torch.int16)
    per_layer = []
    for r in replays:
        idx = r.get_recorded_indices()
        if idx is None:
            raise RuntimeError("a router recorded nothing: was the forward run inside recording()?")
        per_layer.append(idx.view(s, b, -1).transpose(0, 1).sort(-1).values)
    return torch.stack(per_layer, dim=2).to("cpu", torch.int16)


def micro_batch_targets(
    routing_nSLk: torch.Tensor, segments: Sequence[Segment], lengths: Sequence[int], b: int, s: int
) -> torch.Tensor:
    """``[b, s, L, k]``: each row's routing placed where the micro-batch holds the row (padded
    micro-batches: row ``i`` at ``[i, 0:n]``; packed: ``[0, start:start+n]``); experts
    ``0..k-1`` elsewhere."""
    _, _, layers, k = routing_nSLk.shape
    out = empty_routing(b, s, layers, k)
    for row, index, start in segments:
        n = min(int(lengths[row]), s - start, routing_nSLk.shape[1])
        out[index, start : start + n] = routing_nSLk[row, :n]
    return out


def set_targets(replays: Sequence[Any], targets_bsLk: torch.Tensor, device: Any) -> None:
    """Give each router its indices for the next forward (sequence-major ``[s*b, k]``)."""
    if targets_bsLk.shape[2] != len(replays):
        raise ValueError(
            f"routing of {targets_bsLk.shape[2]} MoE layers for a stage with {len(replays)}"
        )
    for layer, r in enumerate(replays):
        idx = targets_bsLk[:, :, layer].transpose(0, 1).reshape(-1, targets_bsLk.shape[-1])
        r.set_target_indices(idx.to(device=device, dtype=torch.long))


class RoutingPass:
    """What a forward pass over micro-batches does with the routing of its rows.

    ``replay``: each forward uses the rows' given routing (``routing_nSLk``). Otherwise, with a
    ``routing_nSLk``, each forward records its own choices and counts the (token, layer) pairs
    whose top-k set differs from the given one over the positions the sampler routed (a row's
    tokens but its last, which the sampler never fed in). Without a ``routing_nSLk`` it
    records into :attr:`routing` (what the trainer's pass chose).
    """

    def __init__(
        self,
        model: Any,
        lengths: Sequence[int],
        routing_nSLk: torch.Tensor | None = None,
        *,
        replay: bool = False,
    ) -> None:
        if replay and routing_nSLk is None:
            raise ValueError("routing replay needs the rows' routing")
        self.model = model
        self.lengths = [int(n) for n in lengths]
        self.given = routing_nSLk
        self.replay = replay
        self.mismatched = 0
        self.compared = 0
        self.routing: torch.Tensor | None = None
        self._replays: list[Any] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[RoutingPass]:
        """The routers in the mode this pass needs, for the whole schedule."""
        with replaying(self.model) if self.replay else recording(self.model) as replays:
            self._replays = replays
            if not self.replay and self.given is None:
                shape = (len(self.lengths), max(self.lengths), len(replays), topk(self.model))
                self.routing = empty_routing(*shape)
            try:
                yield self
            finally:
                self._replays = []

    def before(self, segments: Sequence[Segment], b: int, s: int, device: Any) -> None:
        """Called in the forward step, before the model, with the micro-batch's layout."""
        if self.replay and self._replays:
            assert self.given is not None
            set_targets(
                self._replays, micro_batch_targets(self.given, segments, self.lengths, b, s), device
            )

    def after(self, segments: Sequence[Segment], b: int, s: int) -> None:
        """Called after the model's forward of that micro-batch (recording passes)."""
        if self.replay or not self._replays:
            return
        chosen = recorded(self._replays, b, s, topk(self.model))
        for row, index, start in segments:
            n = min(self.lengths[row], s - start)
            if self.given is None:
                assert self.routing is not None
                self.routing[row, :n] = chosen[index, start : start + n]
                continue
            m = min(n, self.lengths[row] - 1, self.given.shape[1])  # the sampler's positions
            differ = (chosen[index, start : start + m] != self.given[row, :m]).any(-1)  # [m, L]
            self.mismatched += int(differ.sum())
            self.compared += differ.numel()


def mismatch_metrics(passes: Sequence[RoutingPass]) -> dict[str, float]:
    """``moe/routing_mismatch``: the share of (token, MoE layer) pairs whose top-k experts in
    the trainer's recomputation differ from the sampler's, over every rank (collective over
    the default group: TP ranks count the same tokens alike, which leaves the share as is)."""
    counts = torch.tensor(
        [sum(p.mismatched for p in passes), sum(p.compared for p in passes)], dtype=torch.float64
    )
    torch.distributed.all_reduce(counts)
    if counts[1] == 0:
        return {}
    return {"moe/routing_mismatch": float(counts[0] / counts[1])}
