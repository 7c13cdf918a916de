"""``megatron-gndpo plan``: both models' layouts, per-rank parameters and memory, step time.

Pure arithmetic: no process group, no GPU, no megatron import, so a 256-rank (or 4096-rank) plan
runs on a laptop. The memory estimate (bytes per rank: weights, gradients, optimizer shards,
activations, rollout KV cache, the teacher) and the step time (model FLOPs at a stated MFU) are
described where they are computed, below the parameter counts. With rollout ranks apart
(rollout.disaggregate) everything here covers the trainer's ranks (:func:`rank_split`);
plan_disaggregated.py has the rollout ranks and the overlapped step.

Parameter counts follow megatron-core's local GPT spec exactly (the tests compare them with real
GPTModel shards at TP=1/2 and PP=2): the vocabulary padded to
``make_vocab_size_divisible_by * tp`` and split over TP, attention and MLP matrices split over
TP, norms and row-parallel biases replicated, embedding on the first stage, final norm and output
layer on the last (a tied output layer is a copy of the embedding there when PP > 1). An MoE
layer holds its router (replicated) and ``num_experts / EP`` experts, each split over TP (expert
TP = TP), plus the shared expert; expert parameters are counted apart because their optimizer
state is sharded over the expert data-parallel group (EDP), not DP x CP.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from megatron_gndpo.checks import layout_of
from megatron_gndpo.checks.rules import split_problems
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import (
    Config,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TeacherConfig,
    teacher_sections,
)
from megatron_gndpo.logging.throughput import PEAK_BF16_FLOPS, model_flops_per_token
from megatron_gndpo.parallel.groups import ParallelLayout


def _norm_params(model: ModelConfig, width: int) -> int:
    return width * (2 if model.normalization == "LayerNorm" else 1)


def _mlp_params(model: ModelConfig, ffn: int, tp: int) -> int:
    """One MLP of width ``ffn`` on one TP rank (fc1, fc2 and their biases)."""
    h = model.hidden_size
    fc1_rows = ffn * (2 if model.swiglu else 1) // tp
    bias = model.add_bias_linear
    return fc1_rows * h + (fc1_rows if bias else 0) + h * (ffn // tp) + (h if bias else 0)


def expert_layer_params(model: ModelConfig, tp: int, ep: int) -> int:
    """Routed-expert parameters of one MoE layer on one rank: ``num_experts / ep`` experts."""
    if not model.is_moe:
        return 0
    return (model.num_experts or 0) // ep * _mlp_params(model, model.expert_ffn_hidden_size, tp)


def layer_params(model: ModelConfig, tp: int, *, moe: bool = False, ep: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank (``moe``: an MoE layer, of which
    this rank holds ``num_experts / ep`` experts)."""
    h, hd = model.hidden_size, model.head_dim
    qkv_rows = (model.num_attention_heads + 2 * model.query_groups) * hd // tp
    fc1_rows = model.ffn_hidden_size * (2 if model.swiglu else 1) // tp
    has_qkv_bias = model.add_qkv_bias or model.add_bias_linear
    attention = (
        qkv_rows * h
        + (qkv_rows if has_qkv_bias else 0)
        + h * (model.num_attention_heads * hd // tp)
        + (h if model.add_bias_linear else 0)
        + (2 * _norm_params(model, hd) if model.qk_layernorm else 0)
    )
    mlp = (
        fc1_rows * h
        + (fc1_rows if model.add_bias_linear else 0)
        + h * (model.ffn_hidden_size // tp)
        + (h if model.add_bias_linear else 0)
    )
    if moe:  # router (replicated over TP) + this rank's experts + the shared expert
        shared = model.moe_shared_expert_ffn_hidden_size
        mlp = (model.num_experts or 0) * h + expert_layer_params(model, tp, ep)
        mlp += _mlp_params(model, shared, tp) if shared else 0
    return 2 * _norm_params(model, h) + attention + mlp


def _stage_layers(model: ModelConfig, layout: ParallelLayout, stage: int) -> tuple[bool, ...]:
    """Which of stage ``stage``'s layers are MoE layers."""
    per_stage = model.num_layers // layout.pp
    return model.moe_layers[stage * per_stage : (stage + 1) * per_stage]


def stage_expert_params(model: ModelConfig, layout: ParallelLayout, stage: int) -> int:
    """Routed-expert parameters held by each rank of stage ``stage`` (already divided by EP);
    part of :func:`stage_params`."""
    moe_layers = sum(_stage_layers(model, layout, stage))
    return expert_layer_params(model, layout.tp, layout.ep) * moe_layers


def stage_params(model: ModelConfig, layout: ParallelLayout, stage: int) -> int:
    """Parameters held by each rank of pipeline stage ``stage`` (an MoE layer's experts divided
    by EP)."""
    tp, pp = layout.tp, layout.pp
    vocab_shard = model.padded_vocab_size(tp) // tp * model.hidden_size
    total = sum(
        layer_params(model, tp, moe=moe, ep=layout.ep)
        for moe in _stage_layers(model, layout, stage)
    )
    if stage == 0:
        total += vocab_shard
        if model.position_embedding == "learned_absolute":
            total += model.max_position_embeddings * model.hidden_size
    if stage == pp - 1:
        total += _norm_params(model, model.hidden_size)
        if not model.tie_embeddings or pp > 1:
            total += vocab_shard
    return total


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the whole model (vocabulary unpadded, tied output counted once)."""
    unpadded = dataclasses.replace(model, make_vocab_size_divisible_by=1)
    layout = ParallelLayout(world_size=1)
    return stage_params(unpadded, layout, 0)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    first_layer: int
    last_layer: int
    params_per_rank: int
    ranks: range  # contiguous: pp is megatron's slowest dimension
    expert_params_per_rank: int = 0  # of params_per_rank: routed experts (MoE)


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    name: str
    layout: ParallelLayout
    total_params: int
    padded_vocab: int
    stages: tuple[StagePlan, ...]


def plan_model(name: str, model: ModelConfig, parallel: ParallelConfig, world: int) -> ModelPlan:
    layout = layout_of(parallel, world)
    per_stage = model.num_layers // layout.pp
    stages = []
    per_stage_ranks = world // layout.pp  # pp is the slowest dimension: a stage is contiguous
    for stage in range(layout.pp):
        ranks = range(stage * per_stage_ranks, (stage + 1) * per_stage_ranks)
        stages.append(
            StagePlan(
                stage=stage,
                first_layer=stage * per_stage,
                last_layer=(stage + 1) * per_stage - 1,
                params_per_rank=stage_params(model, layout, stage),
                ranks=ranks,
                expert_params_per_rank=stage_expert_params(model, layout, stage),
            )
        )
    return ModelPlan(
        name=name,
        layout=layout,
        total_params=total_params(model),
        padded_vocab=model.padded_vocab_size(layout.tp),
        stages=tuple(stages),
    )


def plan(cfg: Config, world_size: int) -> tuple[ModelPlan, ModelPlan | None]:
    """Plans of the student and the (first colocated) teacher (validate the config first), on
    the trainer's ranks (all of them unless rollout.disaggregate takes the last ones)."""
    teachers = teacher_plans(cfg, world_size)
    trainer = rank_split(cfg, world_size).trainer_ranks
    student = plan_model("student", cfg.model, cfg.parallel, trainer)
    return student, teachers[0] if teachers else None


def colocated_teachers(cfg: Config) -> list[TeacherConfig]:
    """The teachers whose weights live on the job's ranks (not behind a server)."""
    return [t for _, t in teacher_sections(cfg) if t.server is None]


def teacher_plans(cfg: Config, world_size: int) -> list[ModelPlan]:
    """A plan per colocated teacher, each on its own layout (several: ``teacher NAME``), on the
    trainer's ranks."""
    trainer = rank_split(cfg, world_size).trainer_ranks
    return [
        plan_model(_teacher_label(t), t.model, t.parallel, trainer) for t in colocated_teachers(cfg)
    ]


@dataclasses.dataclass(frozen=True)
class RankSplit:
    """Which ranks train and which only generate (rollout.disaggregate): the first
    ``trainer_ranks`` hold the student's and the teachers' layouts, the last ``rollout_ranks``
    form ``rollout_replicas`` copies of the student at ``rollout_tp``. Colocated: no rollout
    ranks, every rank does both."""

    world_size: int
    rollout_ranks: int  # R
    rollout_tp: int
    trainer_dp: int  # the student's data-parallel size on the trainer ranks

    @property
    def trainer_ranks(self) -> int:  # T = world - R
        return self.world_size - self.rollout_ranks

    @property
    def rollout_replicas(self) -> int:
        return self.rollout_ranks // self.rollout_tp

    @property
    def blocks_per_replica(self) -> int:
        """Trainer replicas' blocks of rows the busiest rollout replica generates (trainer
        replica d is served by rollout replica d mod rollout_replicas)."""
        return -(-self.trainer_dp // self.rollout_replicas) if self.rollout_ranks else 1


def _layout_problems(cfg: Config, world: int) -> list[str]:
    """The student's and the colocated teachers' layouts that do not divide ``world`` ranks."""
    sections = [("parallel", cfg.parallel)]
    sections += [(f"{key}.parallel", t.parallel) for key, t in teacher_sections(cfg)]
    problems = []
    for name, parallel in sections:
        try:
            layout_of(parallel, world)
        except ConfigError as err:
            problems.append(f"{name}: {err}")
    return problems


def valid_rollout_ranks(cfg: Config, world_size: int) -> list[int]:
    """Every R (0 < R < world, a multiple of the rollout TP) whose trainer ranks W - R hold the
    layouts and split the prompts into whole per-replica shares (``config validate``'s rule)."""
    tp = cfg.rollout.disaggregate.tensor_parallel
    p = cfg.parallel
    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    # The trainer's ranks are model_parallel x dp with dp dividing prompts_per_step: try those
    # (as many as prompts_per_step has divisors), not every R below the world size.
    out = []
    for dp in _divisors(cfg.rollout.prompts_per_step):
        r = world_size - model_parallel * dp
        if r <= 0 or r % tp or _layout_problems(cfg, world_size - r):
            continue
        if cfg.rollout.prompts_per_step % layout_of(cfg.parallel, world_size - r).dp:
            continue
        out.append(r)
    return sorted(out)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def rank_split(cfg: Config, world_size: int) -> RankSplit:
    """The trainer / rollout split of ``world_size`` ranks; a ConfigError naming the fix when
    the rollout ranks leave none to train or the layouts do not divide the trainer's ranks.

    (These checks live here, not in checks/rules.py, so that ``plan`` names valid R values.)
    """
    d = cfg.rollout.disaggregate
    if not d.enabled:
        return RankSplit(world_size, 0, 1, layout_of(cfg.parallel, world_size).dp)
    split = split_problems(d, world_size)
    if split:
        raise ConfigError(split[0])
    trainer = world_size - d.ranks
    problems = _layout_problems(cfg, trainer)
    if problems:
        valid = valid_rollout_ranks(cfg, world_size)
        fix = (
            f"set rollout.disaggregate.ranks to one of {valid}"
            if valid
            else "no R < world_size fits these layouts; change the layouts or the world size"
        )
        raise ConfigError(
            f"the trainer's {trainer} ranks ({world_size} - rollout.disaggregate.ranks "
            f"{d.ranks}) do not hold the layouts: {'; '.join(problems)}; {fix}"
        )
    return RankSplit(world_size, d.ranks, d.tensor_parallel, layout_of(cfg.parallel, trainer).dp)


def _teacher_label(t: TeacherConfig) -> str:
    name = getattr(t, "name", "")
    return f"teacher {name}" if name else "teacher"


# `plan --ranks` prints a line per rank; everything else takes time independent of the world size.
MAX_LISTED_RANKS = 65536


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) <= 8:
        return ",".join(map(str, ranks))
    return f"{','.join(map(str, ranks[:4]))},...,{ranks[-1]} ({len(ranks)} ranks)"


def format_model_plan(mp: ModelPlan, *, per_rank: bool = False) -> str:
    lay = mp.layout
    moe = any(st.expert_params_per_rank for st in mp.stages)
    expert_head = f"  {'experts/rank':>14}" if moe else ""
    lines = [
        f"{mp.name}: {lay.describe()}  params {_human(mp.total_params)} "
        f"({mp.total_params:,}), vocab padded to {mp.padded_vocab}",
        f"  {'stage':>5}  {'layers':>9}  {'params/rank':>14}{expert_head}  ranks",
    ]
    for st in mp.stages:
        experts = f"  {st.expert_params_per_rank:>14,}" if moe else ""
        lines.append(
            f"  {st.stage:>5}  {st.first_layer:>4}-{st.last_layer:<4}  "
            f"{st.params_per_rank:>14,}{experts}  {_ranks_text(st.ranks)}"
        )
    samples = {  # ranges: as many ranks as the world, in constant time
        "TP group of rank 0": lay.group_range(0, ("tp",)),
        "DPxCP group of rank 0 (GNDPO statistics)": lay.group_range(0, ("cp", "dp")),
        "PP group of rank 0": lay.group_range(0, ("pp",)),
    }
    if moe:
        samples |= {
            "EP group of rank 0 (experts split)": lay.group_range(0, ("ep",)),
            "EDP group of rank 0 (expert gradients)": lay.group_range(0, ("edp",)),
        }
    for label, ranks in samples.items():
        lines.append(f"  {label}: [{_ranks_text(ranks)}]")
    if per_rank:
        lines.append(f"  {'rank':>5}  {'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3}  params")
        for r in range(lay.world_size):
            c = lay.coords(r)
            params = mp.stages[c["pp"]].params_per_rank
            lines.append(
                f"  {r:>5}  {c['tp']:>3} {c['cp']:>3} {c['dp']:>4} {c['pp']:>3}  {params:,}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Memory and step time
#
# Per-rank bytes, by where they live in a step. Persistent: student weights, the fp32 gradient
# buffer of megatron-core DDP, the optimizer state, the teacher's weights. Phase peaks, one at a
# time: rollout (KV cache, or vLLM's share while it is awake), scoring (forward-only working set
# of the teacher, then of the student), training (activations kept for backward + the log-prob
# head). A rank's peak is persistent + the largest phase.

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30

# The trainer's log-prob heads use TokenLogProbs' default chunk (models/logprob_head.py): at most
# [LOGPROB_CHUNK_TOKENS, V/tp] logits exist at once, never [T, V] (a test pins the two together).
LOGPROB_CHUNK_TOKENS = 2048

# Part of the GPU the estimate may not use: the CUDA context, NCCL buffers and the caching
# allocator's fragmentation are not in the estimate (torch.cuda.max_memory_allocated excludes
# them too), and together they take several GiB of an 80 GiB device.
RESERVED_FRACTION = 0.10

# Data-sheet numbers of an H100 SXM: dense bf16 tensor-core peak and HBM3 bandwidth.
H100_PEAK_FLOPS = PEAK_BF16_FLOPS["H100"]
H100_HBM_BYTES_PER_S = 3.35e12

# The weight broadcast (rollout.disaggregate) leaves the trainer's rank 0 through one NIC: a
# 200 Gb/s HDR InfiniBand adapter, one per GPU on a DGX H100-class node (NDR 400 Gb/s doubles
# it), is 25 GB/s. NCCL pipelines a broadcast, so the time is bytes / bandwidth whatever the
# number of receivers. Within one node NVLink is ~10x faster: pass --interconnect-gbps.
IB_HDR_BYTES_PER_S = 25e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The GPU the plan is for and the efficiency it assumes."""

    gpu_memory_gib: float = 80.0
    peak_flops: float = H100_PEAK_FLOPS
    mfu: float = 0.35
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S
    interconnect_bytes_per_s: float = IB_HDR_BYTES_PER_S  # the trainer -> rollout broadcast

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - RESERVED_FRACTION)


def activation_bytes_per_token(
    model: ModelConfig, tp: int, *, sequence_parallel: bool, seq_len: int
) -> float:
    """Bytes one transformer layer keeps for backward, per token, on one TP rank.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    §4.1, without recompute: ``s·b·h·(34 + 5·a·s/h)`` bytes per layer for 16-bit activations,
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with TP size t, all of it divided by t with sequence
    parallelism. Generalised here to grouped-query attention and gated MLPs by counting the
    saved tensors (elements per token, q = heads·head_dim, k = kv_heads·head_dim, f = ffn):

        replicated over TP (split only with sequence parallelism):
            two norm inputs 2h, QKV input h, fc1 input h                         = 4h
        split over TP:
            Q and K for the scores q + k, V k, attention output / projection input q,
            activation input f (2f gated), fc2 input f, qk-norm inputs q + k (Qwen3)
            score matrix 2.5·a·s only with megatron's local core attention (the paper's
            5as²b bytes; megatron's unfused float32 softmax keeps its float32 output and a
            16-bit copy, 6as²b, the fused kernel 2as²b); flash/SDPA attention keeps no [s, s]
            tensor, which is why it is the default

    The paper's dropout masks (2sbh bytes) are left out: our models build with zero dropout.
    The sizes follow the parameter dtype (2 bytes for bf16).
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    q, k = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    replicated = 4 * h
    split: float = (q + k) + k + q + f * (2 if model.swiglu else 1) + f
    if model.qk_layernorm:
        split += q + k
    if model.core_attention == "local":
        split += 2.5 * model.num_attention_heads * seq_len
    elements = replicated / (tp if sequence_parallel else 1) + split / tp
    return elements * BYTES[model.params_dtype]


def logprob_head_bytes(model: ModelConfig, tp: int, *, training: bool) -> float:
    """Working memory of the fused log-prob head on the last stage (parallel/logprobs.py).

    Per chunk: the chunk's logits ``[C, V/tp]`` as the GEMM's output (param dtype) and their
    float32 copy; in training also the float32 weight-gradient accumulator ``[V/tp, H]``.
    """
    vocab_shard = model.padded_vocab_size(tp) // tp
    chunk = LOGPROB_CHUNK_TOKENS * vocab_shard * (BYTES[model.params_dtype] + 4)
    return chunk + (vocab_shard * model.hidden_size * 4 if training else 0)


def optimizer_bytes_per_param(model: ModelConfig, optimizer: OptimizerConfig) -> int:
    """Optimizer state per parameter: an fp32 master copy (unless the parameters are fp32) and
    Adam's two moments (SGD: one momentum buffer), 4 bytes each — 12 bytes for bf16 Adam."""
    master = 0 if model.params_dtype == "fp32" else 4
    return master + (8 if optimizer.optimizer == "adam" else 4)


def sequence_length(cfg: Config) -> int:
    """The longest rollout row: prompt + response, capped by the student's positions."""
    longest = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    return min(longest, cfg.model.max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Estimated bytes on one rank holding student stage ``stage`` and each teacher's stage
    ``teacher_stages`` (several teachers: all of their weights stay, their scoring passes run
    one after another)."""

    stage: int
    teacher_stages: tuple[int, ...]
    weights: float
    grads: float
    optimizer: float
    teacher_weights: float
    rollout: float
    scoring: float
    training: float

    @property
    def teacher_stage(self) -> int | str:
        """The teacher's stage; with several teachers theirs, comma-separated."""
        stages = self.teacher_stages
        return stages[0] if len(stages) == 1 else ",".join(map(str, stages))

    @property
    def persistent(self) -> float:
        return self.weights + self.grads + self.optimizer + self.teacher_weights

    @property
    def phases(self) -> dict[str, float]:
        return {"rollout": self.rollout, "scoring": self.scoring, "training": self.training}

    @property
    def peak(self) -> float:
        return self.persistent + max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name])


def _student_memory(cfg: Config, layout: ParallelLayout, stage: int, seq: int) -> dict[str, float]:
    """Persistent and training-phase bytes of student stage ``stage`` (one rank)."""
    model, par = cfg.model, cfg.parallel
    params = stage_params(model, layout, stage)
    per_layer = activation_bytes_per_token(
        model, layout.tp, sequence_parallel=par.sequence_parallel, seq_len=seq
    )
    rows = cfg.rollout.rollout_batch_size // layout.dp
    micro_batches = -(
        -rows // (cfg.trainer.micro_batch_size * cfg.trainer.optimizer_steps_per_rollout)
    )
    # 1F1B: stage s holds the activations of (pp - s) micro-batches before its first backward.
    in_flight = min(layout.pp - stage, max(micro_batches, 1))
    tokens = cfg.trainer.micro_batch_size * seq / layout.cp
    training = per_layer * tokens * (model.num_layers // layout.pp) * in_flight
    last = stage == layout.pp - 1
    shards = layout.dp * layout.cp if cfg.optimizer.use_distributed_optimizer else 1
    # the distributed optimizer shards expert parameters over the expert data-parallel group
    expert_shards = layout.edp if cfg.optimizer.use_distributed_optimizer else 1
    experts = stage_expert_params(model, layout, stage)
    per_param = optimizer_bytes_per_param(model, cfg.optimizer)
    return {
        "weights": params * BYTES[model.params_dtype],
        "grads": params * 4,  # DDP's main_grad buffer: grad_reduce_in_fp32 (engine/optimizer.py)
        "optimizer": (params - experts) * per_param / shards + experts * per_param / expert_shards,
        "training": training + (logprob_head_bytes(model, layout.tp, training=True) if last else 0),
    }


def _forward_working_set(
    model: ModelConfig,
    parallel: ParallelConfig,
    layout: ParallelLayout,
    stage: int,
    *,
    tokens: float,
    seq: int,
) -> float:
    """Bytes of a forward-only pass over ``tokens`` tokens in rows of up to ``seq``: nothing is
    kept for backward, so one layer's tensors (bounded by what it would save) plus the log-prob
    head on the last stage."""
    per_layer = activation_bytes_per_token(
        model, layout.tp, sequence_parallel=parallel.sequence_parallel, seq_len=seq
    )
    head = logprob_head_bytes(model, layout.tp, training=False) if stage == layout.pp - 1 else 0
    return per_layer * tokens / layout.cp + head


def kv_cache_bytes(model: ModelConfig, tp: int, layers: int, rows: int, positions: float) -> float:
    """K and V of ``rows`` sequences of ``positions`` tokens over ``layers`` layers on one TP rank:
    ``rows · positions · layers · 2 · (kv_heads/tp) · head_dim · bytes``."""
    per_token = layers * 2 * (model.query_groups // tp) * model.head_dim
    return rows * positions * per_token * BYTES[model.params_dtype]


def builtin_rollout_bytes(
    cfg: Config, tp: int, pp: int, rows: int, seq: int, *, sequence_parallel: bool
) -> tuple[float, float]:
    """The built-in engine's bytes on one rank of a replica at ``tp`` x ``pp`` generating
    ``rows`` rows: its static KV cache (every row at the full length) and one layer of the
    prompts' prefill."""
    model = cfg.model
    kv = kv_cache_bytes(model, tp, model.num_layers // pp, rows, seq)
    prefill = (
        activation_bytes_per_token(model, tp, sequence_parallel=sequence_parallel, seq_len=seq)
        * rows
        * cfg.rollout.max_prompt_length
    )
    return kv, prefill


def vllm_share_bytes(cfg: Config, hw: Hardware) -> float:
    """The GPU memory a vLLM engine takes while awake (its weights, activations and KV cache)."""
    return cfg.rollout.gpu_memory_utilization * hw.gpu_memory_gib * GIB


def _rollout_bytes(cfg: Config, layout: ParallelLayout, hw: Hardware, seq: int) -> float:
    """Rollout-phase bytes: vLLM's share while awake, or the built-in engine's static KV cache
    (every row of this DP rank at the full length) plus one layer of the prompts' prefill."""
    if cfg.rollout.engine == "vllm":
        return vllm_share_bytes(cfg, hw)
    rows = cfg.rollout.rollout_batch_size // layout.dp
    kv, prefill = builtin_rollout_bytes(
        cfg, layout.tp, layout.pp, rows, seq, sequence_parallel=cfg.parallel.sequence_parallel
    )
    return kv + prefill


def _stage_pairs(
    student: ParallelLayout, teachers: list[ParallelLayout]
) -> list[tuple[int, tuple[int, ...]]]:
    """Every (student stage, teacher stages) some rank holds, in time independent of the world
    size: pp is each layout's slowest dimension, so stage s of a layout is the contiguous ranks
    [s * W / pp, (s + 1) * W / pp), and the stages change only at those boundaries."""
    layouts = [student, *teachers]
    starts = sorted({s * (lay.world_size // lay.pp) for lay in layouts for s in range(lay.pp)})
    pairs = {
        (r // (student.world_size // student.pp),
         tuple(r // (t.world_size // t.pp) for t in teachers))
        for r in starts
    }  # fmt: skip
    return sorted(pairs)


def estimate_memory(cfg: Config, world_size: int, hw: Hardware = Hardware()) -> list[RankMemory]:
    """Per-rank memory of every (student stage, teacher stage) pair that some trainer rank
    holds. With rollout ranks apart (rollout.disaggregate) the layouts cover the first
    world - R ranks and these generate nothing (plan_disaggregated.py has the rollout ranks)."""
    split = rank_split(cfg, world_size)
    world_size = split.trainer_ranks
    s_layout = layout_of(cfg.parallel, world_size)
    teachers = colocated_teachers(cfg)  # a served teacher takes nothing here
    t_layouts = [layout_of(t.parallel, world_size) for t in teachers]
    seq = sequence_length(cfg)
    # A scoring micro-batch holds up to scoring_token_budget tokens, and at least one whole row.
    score_tokens = max(cfg.trainer.scoring_token_budget, seq)
    pairs = _stage_pairs(s_layout, t_layouts)
    rollout = 0.0 if split.rollout_ranks else _rollout_bytes(cfg, s_layout, hw, seq)
    out = []
    for stage, t_stages in pairs:
        student = _student_memory(cfg, s_layout, stage, seq)
        scoring = max(  # one model's scoring pass at a time
            [
                _forward_working_set(
                    cfg.model, cfg.parallel, s_layout, stage, tokens=score_tokens, seq=seq
                ),
                *(
                    _forward_working_set(
                        t.model, t.parallel, t_layout, t_stage, tokens=score_tokens, seq=seq
                    )
                    for t, t_layout, t_stage in zip(teachers, t_layouts, t_stages, strict=True)
                ),
            ]
        )
        out.append(
            RankMemory(
                stage=stage,
                teacher_stages=t_stages,
                weights=student["weights"],
                grads=student["grads"],
                optimizer=student["optimizer"],
                teacher_weights=sum(
                    stage_params(t.model, t_layout, t_stage) * BYTES[t.model.params_dtype]
                    for t, t_layout, t_stage in zip(teachers, t_layouts, t_stages, strict=True)
                ),
                rollout=rollout,
                scoring=scoring,
                training=student["training"],
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step's phases at the assumed MFU (all GPUs busy, no pipeline bubble)."""

    tokens: int  # rollout_batch_size · (max prompt + max response): every row at full length
    generation_flops_s: float  # 2·N per token (prefill and decode) at the MFU
    decode_floor_s: float  # each decode step reads the weights and the KV cache from HBM
    scoring_s: float  # teacher + student forward, 2·N per token each
    training_s: float  # 6·N per token

    @property
    def rollout_s(self) -> float:
        return max(self.generation_flops_s, self.decode_floor_s)

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.scoring_s + self.training_s


def generation_time(
    cfg: Config, rows: int, tp: int, ranks: int, hw: Hardware
) -> tuple[float, float]:
    """One model replica of ``ranks`` GPUs at ``tp`` generating ``rows`` rows: the FLOP time
    (2N per token of prompt and response at the MFU) and the decode floor (each of the
    max_response decode steps reads the weights and the KV cache, half full on average, split
    over the TP ranks; pipeline stages run one after another per token)."""
    model, seq = cfg.model, sequence_length(cfg)
    flops_s = model_flops_per_token(model, seq, training=False) * rows * seq
    flops_s /= ranks * hw.peak_flops * hw.mfu
    mean_positions = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length / 2
    kv = kv_cache_bytes(model, 1, model.num_layers, rows, mean_positions)
    weights = total_params(model) * BYTES[model.params_dtype]
    per_decode_step = (weights + kv) / tp / hw.hbm_bytes_per_s
    return flops_s, cfg.rollout.max_response_length * per_decode_step


def estimate_step_time(cfg: Config, world_size: int, hw: Hardware = Hardware()) -> StepTime:
    """Step time with every one of ``world_size`` ranks generating, scoring and training in
    turn (colocated; rollout.disaggregate is not read here), from model FLOPs
    (logging/throughput.py) at ``hw.mfu`` of ``hw.peak_flops``.

    Generation is also bounded below by memory bandwidth (:func:`generation_time`).
    """
    seq = sequence_length(cfg)
    tokens = cfg.rollout.rollout_batch_size * seq
    student = cfg.model
    forward = model_flops_per_token(student, seq, training=False)
    training = model_flops_per_token(student, seq, training=True)
    # several teachers: each row is scored by one; the costliest bounds the step (all rows to it)
    # (a served teacher's forward runs on its server: not counted)
    scoring = forward + max(
        (model_flops_per_token(t.model, seq, training=False) for t in colocated_teachers(cfg)),
        default=0.0,
    )
    rate = world_size * hw.peak_flops * hw.mfu  # FLOP/s of the whole job
    layout = layout_of(cfg.parallel, world_size)
    rows = cfg.rollout.rollout_batch_size // layout.dp
    _, decode_floor = generation_time(cfg, rows, layout.tp, layout.tp, hw)
    return StepTime(
        tokens=tokens,
        generation_flops_s=forward * tokens / rate,
        decode_floor_s=decode_floor,
        scoring_s=scoring * tokens / rate,
        training_s=training * tokens / rate,
    )


# What to change when a component is the largest part of a rank that does not fit.
_FIXES = {
    "weights": "raise parallel.tensor_parallel or parallel.pipeline_parallel",
    "grads": "raise parallel.tensor_parallel or parallel.pipeline_parallel",
    "optimizer": "keep optimizer.use_distributed_optimizer on and raise the data-parallel size",
    "teacher": "raise teacher.parallel.tensor_parallel or teacher.parallel.pipeline_parallel",
    "rollout": "lower rollout.gpu_memory_utilization (vLLM), or rows per rank / "
    "rollout.max_response_length (built-in KV cache)",
    "scoring": "lower trainer.scoring_token_budget",
    "training": "lower trainer.micro_batch_size, set parallel.sequence_parallel=true, or raise "
    "parallel.tensor_parallel / pipeline_parallel",
}


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _teacher_part(r: RankMemory) -> str:
    return f" / teacher stage {r.teacher_stage}" if r.teacher_stages else ""


def fit_warnings(rows: list[RankMemory], hw: Hardware) -> list[str]:
    """One WARNING line per (student stage, teacher stage) whose peak exceeds the usable memory."""
    out = []
    for r in rows:
        if r.peak <= hw.usable_bytes:
            continue
        parts = {
            "weights": r.weights, "grads": r.grads, "optimizer": r.optimizer,
            "teacher": r.teacher_weights, r.peak_phase: r.phases[r.peak_phase],
        }  # fmt: skip
        biggest = max(parts, key=lambda name: parts[name])
        out.append(
            f"WARNING: ranks of student stage {r.stage}{_teacher_part(r)} need "
            f"{_gib(r.peak)} GiB at their {r.peak_phase} peak, more than the "
            f"{_gib(hw.usable_bytes)} GiB usable of a {hw.gpu_memory_gib:g} GiB GPU; the largest "
            f"part is {biggest} ({_gib(parts[biggest])} GiB): {_FIXES[biggest]}"
        )
    return out


def format_memory(cfg: Config, rows: list[RankMemory], hw: Hardware) -> str:
    seq = sequence_length(cfg)
    engine = cfg.rollout.engine
    lines = [
        f"memory per rank, GiB ({hw.gpu_memory_gib:g} GiB GPU, {_gib(hw.usable_bytes)} usable "
        f"after {RESERVED_FRACTION:.0%} for CUDA context, NCCL and fragmentation); rows of "
        f"{seq} tokens, micro-batch {cfg.trainer.micro_batch_size}, scoring micro-batch "
        f"{max(cfg.trainer.scoring_token_budget, seq)} tokens, rollout engine {engine}",
        f"  {'stage s/t':>9} | {'weights':>7} {'grads':>6} {'optim':>6} {'teacher':>7} | "
        f"{'rollout':>7} {'scoring':>7} {'training':>8} | {'peak':>6}  phase",
    ]
    for r in rows:
        lines.append(
            f"  {f'{r.stage}/{r.teacher_stage}' if r.teacher_stages else f'{r.stage}/-':>9} | "
            f"{_gib(r.weights):>7} {_gib(r.grads):>6} "
            f"{_gib(r.optimizer):>6} {_gib(r.teacher_weights):>7} | {_gib(r.rollout):>7} "
            f"{_gib(r.scoring):>7} {_gib(r.training):>8} | {_gib(r.peak):>6}  {r.peak_phase}"
        )
    lines += [
        "  weights: params dtype; grads: fp32 DDP buffer; optim: fp32 master + Adam moments / "
        "(DP*CP); teacher: its weights on its own layout",
        "  rollout: "
        + (
            "vLLM's gpu_memory_utilization share"
            if engine == "vllm"
            else "KV cache of this DP rank's rows at full length + one prefill layer"
        )
        + "; scoring: one forward layer + log-prob chunk; training: activations "
        "(Korthikanti et al. 2022, no recompute) of the 1F1B micro-batches in flight + log-prob "
        f"head ({LOGPROB_CHUNK_TOKENS}-token chunks)",
        "  peak = weights + grads + optim + teacher + the largest phase",
    ]
    return "\n".join(lines)


def format_step_time(st: StepTime, world_size: int, hw: Hardware) -> str:
    return "\n".join([
        f"step time at MFU {hw.mfu:g} of {hw.peak_flops / 1e12:g} TFLOP/s per GPU on "
        f"{world_size} GPUs, every row at full length ({st.tokens:,} tokens; an upper bound):",
        f"  rollout   {st.rollout_s:8.1f} s  (2N FLOPs/token: {st.generation_flops_s:.1f} s; "
        f"decode floor, weights + KV cache read at {hw.hbm_bytes_per_s / 1e12:g} TB/s per step: "
        f"{st.decode_floor_s:.1f} s)",
        f"  scoring   {st.scoring_s:8.1f} s  (teacher + student forward, 2N FLOPs/token each; "
        "several teachers: the costliest)",
        f"  training  {st.training_s:8.1f} s  (6N FLOPs/token)",
        f"  total     {st.total_s:8.1f} s per step, {st.tokens / st.total_s:,.0f} tokens/s",
    ])  # fmt: skip
