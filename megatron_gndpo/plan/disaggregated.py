"""``megatron-gndpo plan`` with rollout ranks apart (rollout.disaggregate): the rollout ranks'
memory, the step with and without overlap, the colocated step beside it, and the best split.

The trainer side is the rest of :mod:`megatron_gndpo.plan` on the first world - R ranks
(:func:`~megatron_gndpo.plan.layout.rank_split`); this module adds what only the rollout ranks
hold and how the two sides' times combine. Pure arithmetic, like the rest of ``plan``.
"""

from __future__ import annotations

import dataclasses

from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import Config
from megatron_gndpo.parallel.groups import ParallelLayout
from megatron_gndpo.plan.hardware import BYTES, Hardware, gib
from megatron_gndpo.plan.layout import RankSplit, rank_split, valid_rollout_ranks
from megatron_gndpo.plan.memory import builtin_rollout_bytes, sequence_length, vllm_share_bytes
from megatron_gndpo.plan.params import stage_params, total_params
from megatron_gndpo.plan.step_time import StepTime, estimate_step_time, generation_time


@dataclasses.dataclass(frozen=True)
class RolloutRankMemory:
    """Estimated bytes on one rollout rank (rollout.disaggregate): the student only, at the
    rollout TP; no gradients, optimizer or teacher."""

    rows: int  # rows its replica generates per step
    weights: float  # this rank's shard of the student at the rollout TP, params dtype
    kv_cache: float  # built-in: every row at the full length; vLLM: its share less the weights
    prefill: float  # built-in: one layer of the prompts' prefill (vLLM: inside its share)
    staging: float  # the received weights held at once: one bucket of the broadcast
    engine: str = "builtin"

    @property
    def peak(self) -> float:
        return self.weights + self.kv_cache + self.prefill + self.staging


def _busiest_rows(cfg: Config, split: RankSplit) -> int:
    """Rows the busiest rollout replica generates per step: a trainer replica's rows for each
    replica it serves."""
    return split.blocks_per_replica * (cfg.rollout.rollout_batch_size // split.trainer_dp)


def estimate_rollout_memory(
    cfg: Config, world_size: int, hw: Hardware | None = None
) -> RolloutRankMemory | None:
    """Memory of a rank of the busiest rollout replica; None when rollouts are colocated.

    Both engines load the broadcast a bucket (whole layers) at a time, so the staging buffer is
    one bucket. vLLM (``rollout.engine: vllm``) takes ``rollout.gpu_memory_utilization`` of the
    GPU for its weights and KV cache; the built-in generator holds every row's KV cache at the
    full length and one prefill layer.
    """
    from megatron_gndpo.weight_sync.sync import DEFAULT_BUCKET_BYTES

    split = rank_split(cfg, world_size)
    if not split.rollout_ranks:
        return None
    model, tp, seq = cfg.model, split.rollout_tp, sequence_length(cfg)
    rows = _busiest_rows(cfg, split)
    dtype = BYTES[model.params_dtype]
    weights = stage_params(model, ParallelLayout(world_size=tp, tp=tp), 0) * dtype
    staging = min(DEFAULT_BUCKET_BYTES, total_params(model) * dtype)
    if cfg.rollout.engine == "vllm":
        share = vllm_share_bytes(cfg, hw or Hardware())
        return RolloutRankMemory(
            rows=rows, weights=weights, kv_cache=max(share - weights, 0.0), prefill=0.0,
            staging=staging, engine="vllm",
        )  # fmt: skip
    # the built-in generator switches sequence parallelism off while it generates
    kv, prefill = builtin_rollout_bytes(cfg, tp, 1, rows, seq, sequence_parallel=False)
    return RolloutRankMemory(
        rows=rows, weights=weights, kv_cache=kv, prefill=prefill, staging=staging
    )


@dataclasses.dataclass(frozen=True)
class DisaggregatedStepTime:
    """Step time with rollout ranks apart (rollout.disaggregate): the rollout ranks generate,
    the trainer ranks score and train, and the trainer's rank 0 broadcasts the weights after
    each update. Staleness 0: the ranks take turns (rollout, broadcast, scoring, training);
    staleness >= 1: in steady state the rollout of batch j + 1 overlaps the scoring, training
    and broadcast of batch j, so the slower side sets the step."""

    split: RankSplit
    staleness: int
    rows_per_replica: int  # rows the busiest rollout replica generates
    generation_flops_s: float  # of the busiest rollout replica, 2N per token at the MFU
    decode_floor_s: float  # its decode steps read its weights + KV cache from HBM
    trainer: StepTime  # scoring and training on the trainer ranks (its rollout unused)
    broadcast_s: float  # the whole student at hw.interconnect_bytes_per_s

    @property
    def rollout_s(self) -> float:
        return max(self.generation_flops_s, self.decode_floor_s)

    @property
    def trainer_s(self) -> float:
        return self.trainer.scoring_s + self.trainer.training_s

    @property
    def total_s(self) -> float:
        if self.staleness == 0:
            return self.rollout_s + self.broadcast_s + self.trainer_s
        return max(self.rollout_s, self.trainer_s + self.broadcast_s)


def estimate_disaggregated_step_time(
    cfg: Config, world_size: int, hw: Hardware
) -> DisaggregatedStepTime | None:
    """The step with rollout.disaggregate's split of ``world_size`` ranks; None if colocated.

    The busiest rollout replica generates ``blocks_per_replica`` trainer replicas' rows at the
    rollout TP (its own FLOPs; its own decode floor, which a replica with few rows still pays:
    decode is bound by reading the weights); scoring and training run on the trainer ranks as
    :func:`estimate_step_time` has them on world - R ranks.
    """
    split = rank_split(cfg, world_size)
    if not split.rollout_ranks:
        return None
    rows = _busiest_rows(cfg, split)
    tp = split.rollout_tp
    flops_s, floor_s = generation_time(cfg, rows, tp, tp, hw)
    model = cfg.model
    return DisaggregatedStepTime(
        split=split,
        staleness=cfg.rollout.disaggregate.staleness,
        rows_per_replica=rows,
        generation_flops_s=flops_s,
        decode_floor_s=floor_s,
        trainer=estimate_step_time(cfg, split.trainer_ranks, hw),
        broadcast_s=total_params(model) * BYTES[model.params_dtype] / hw.interconnect_bytes_per_s,
    )


def with_rollout_ranks(cfg: Config, ranks: int) -> Config:
    """``cfg`` with rollout.disaggregate.ranks = ``ranks``."""
    d = dataclasses.replace(cfg.rollout.disaggregate, ranks=ranks)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, disaggregate=d))


def best_rollout_ranks(cfg: Config, world_size: int, hw: Hardware) -> DisaggregatedStepTime | None:
    """The split with the shortest step at the configured staleness over every valid R
    (:func:`valid_rollout_ranks`) whose rollout ranks fit the GPU (if none fits, over all);
    the smallest R wins a tie. None when no R is valid."""
    steps, fitting = [], []
    for r in valid_rollout_ranks(cfg, world_size):
        candidate = with_rollout_ranks(cfg, r)
        step = estimate_disaggregated_step_time(candidate, world_size, hw)
        memory = estimate_rollout_memory(candidate, world_size, hw)
        assert step is not None and memory is not None  # r > 0
        steps.append(step)
        if memory.peak <= hw.usable_bytes:
            fitting.append(step)
    return min(fitting or steps, key=lambda st: st.total_s, default=None)


def format_rollout_memory(cfg: Config, world_size: int, hw: Hardware) -> str:
    """The rollout ranks' memory (rollout.disaggregate), with a WARNING when they do not fit;
    empty when rollouts are colocated."""
    mem = estimate_rollout_memory(cfg, world_size, hw)
    if mem is None:
        return ""
    split = rank_split(cfg, world_size)
    first = split.trainer_ranks
    lines = [
        f"rollout ranks {first}-{world_size - 1}: {split.rollout_replicas} replica(s) of "
        f"TP={split.rollout_tp}, each serving up to {split.blocks_per_replica} of the trainer's "
        f"{split.trainer_dp} data-parallel replicas ({mem.rows} rows per step), "
        f"{'vLLM' if mem.engine == 'vllm' else 'built-in engine'}; GiB per rank",
    ]
    idle = split.rollout_replicas - min(split.rollout_replicas, split.trainer_dp)
    if idle:
        lines.append(
            f"  {idle} of them idle: trainer replica d is served by rollout replica d mod "
            f"{split.rollout_replicas}, and the trainer has {split.trainer_dp}"
        )
    lines += [
        f"  {'weights':>7} {'kv cache':>8} {'prefill':>7} {'staging':>7} | {'peak':>6}",
        f"  {gib(mem.weights):>7} {gib(mem.kv_cache):>8} {gib(mem.prefill):>7} "
        f"{gib(mem.staging):>7} | {gib(mem.peak):>6}",
        "  weights: the student's shard at the rollout TP; kv cache: every row at full length; "
        "staging: one bucket of the broadcast (the weights load a bucket at a time); no "
        "gradients, optimizer or teacher"
        if mem.engine != "vllm"
        else "  weights and kv cache: vLLM's rollout.gpu_memory_utilization share (the student's "
        "shard at the rollout TP, the rest for its paged KV cache); staging: one bucket of the "
        "broadcast (vLLM loads the weights a bucket at a time); no gradients, optimizer or "
        "teacher",
    ]
    vllm = mem.engine == "vllm"
    if vllm and mem.kv_cache == 0.0:
        lines.append(
            f"WARNING: vLLM's share of the GPU holds no more than the student's shard "
            f"({gib(mem.weights)} GiB): raise rollout.gpu_memory_utilization or "
            "rollout.disaggregate.tensor_parallel"
        )
    if mem.peak > hw.usable_bytes:
        fix = (
            "lower rollout.gpu_memory_utilization"
            if vllm
            else "raise rollout.disaggregate.tensor_parallel or rollout.disaggregate.ranks "
            "(fewer rows per replica), or lower rollout.max_response_length"
        )
        lines.append(
            f"WARNING: rollout ranks need {gib(mem.peak)} GiB, more than the "
            f"{gib(hw.usable_bytes)} GiB usable; {fix}"
        )
    return "\n".join(lines)


def _mode(staleness: int) -> str:
    return "synchronous" if staleness == 0 else f"{staleness}-step-off"


def format_disaggregated_step_time(
    dst: DisaggregatedStepTime,
    colocated: StepTime | None,
    best: DisaggregatedStepTime | None,
    hw: Hardware,
) -> str:
    """The disaggregated step, the colocated one on all ranks beside it, and a verdict."""
    split, mode = dst.split, _mode(dst.staleness)
    formula = (
        "rollout + broadcast + scoring + training (the ranks take turns)"
        if dst.staleness == 0
        else "max(rollout, scoring + training + broadcast) (steady state, overlapped)"
    )
    lines = [
        f"disaggregated step ({mode}, rollout.disaggregate.staleness={dst.staleness}): "
        f"{split.trainer_ranks} trainer + {split.rollout_ranks} rollout ranks",
        f"  rollout   {dst.rollout_s:8.1f} s  on {split.rollout_replicas} replica(s) of "
        f"TP={split.rollout_tp}, {dst.rows_per_replica} rows on the busiest (2N FLOPs/token: "
        f"{dst.generation_flops_s:.1f} s; decode floor: {dst.decode_floor_s:.1f} s — decode "
        "is memory-bound: every decode step reads the weights, however few the rows)",
        f"  scoring   {dst.trainer.scoring_s:8.1f} s  on the {split.trainer_ranks} trainer ranks",
        f"  training  {dst.trainer.training_s:8.1f} s  on the {split.trainer_ranks} trainer ranks",
        f"  broadcast {dst.broadcast_s:8.1f} s  (the whole student from trainer rank 0 at "
        f"{hw.interconnect_bytes_per_s / 1e9:g} GB/s, one 200 Gb/s HDR InfiniBand NIC unless "
        "--interconnect-gbps says otherwise)",
        f"  step      {dst.total_s:8.1f} s  = {formula}",
    ]
    if colocated is None:
        lines.append(
            f"  colocated on all {split.world_size} ranks: the layouts do not divide "
            f"{split.world_size}; no comparison"
        )
    else:
        ratio = colocated.total_s / dst.total_s
        lines.append(
            f"  colocated on all {split.world_size} ranks: {colocated.total_s:.1f} s per step; "
            f"colocated / disaggregated = {ratio:.2f}"
        )
        lines.append("  " + _verdict(dst, mode, ratio, best))
    lines.append(
        "  (the model scales FLOPs linearly in ranks; a split can then beat colocated only "
        "through the overlap, the decode floor or the memory it frees, not by much)"
    )
    return "\n".join(lines)


def _verdict(
    dst: DisaggregatedStepTime, mode: str, ratio: float, best: DisaggregatedStepTime | None
) -> str:
    r = dst.split.rollout_ranks
    if ratio >= 1:
        head = f"verdict: disaggregated {mode} is {ratio:.2f}x faster than colocated"
    elif dst.staleness == 0:
        overlapped = dataclasses.replace(dst, staleness=1).total_s
        head = (
            f"verdict: disaggregated {mode} is {1 / ratio:.2f}x slower than colocated: with "
            "staleness 0 the two sides take turns, each idle while the other works; "
            f"rollout.disaggregate.staleness=1 would overlap them ({overlapped:.1f} s per step)"
        )
    else:
        share = "small" if dst.rollout_s > dst.trainer_s + dst.broadcast_s else "large"
        head = (
            f"verdict: disaggregated {mode} is {1 / ratio:.2f}x slower than colocated: the "
            f"rollout ranks' share ({r}) is too {share}"
        )
    if best is None or best.split.rollout_ranks == r:
        return f"{head}; R = {r} is the best split the model finds"
    return (
        f"{head}; try rollout.disaggregate.ranks={best.split.rollout_ranks} "
        f"({best.total_s:.1f} s per step: rollout {best.rollout_s:.1f} s, trainer "
        f"{best.trainer_s + best.broadcast_s:.1f} s with the broadcast)"
    )


def format_disaggregated(cfg: Config, world_size: int, hw: Hardware) -> str:
    """``plan``'s lines for rollout ranks apart: their memory, the step, colocated beside it,
    the verdict and the best R."""
    dst = estimate_disaggregated_step_time(cfg, world_size, hw)
    assert dst is not None, "rollout.disaggregate.ranks is 0"
    try:
        colocated: StepTime | None = estimate_step_time(cfg, world_size, hw)
    except ConfigError:
        colocated = None  # the layouts divide world - R but not world
    best = best_rollout_ranks(cfg, world_size, hw)
    return "\n".join([
        format_rollout_memory(cfg, world_size, hw),
        format_disaggregated_step_time(dst, colocated, best, hw),
    ])  # fmt: skip
