"""Per-rank memory of a step (:func:`estimate_memory`).

Per-rank bytes, by where they live in a step. Persistent: student weights, the fp32 gradient
buffer of megatron-core DDP, the optimizer state, the teacher's weights. Phase peaks, one at a
time: rollout (KV cache, or vLLM's share while it is awake), scoring (forward-only working set
of the teacher, then of the student), training (activations kept for backward + the log-prob
head). A rank's peak is persistent + the largest phase.
"""

from __future__ import annotations

import dataclasses

from megatron_gndpo.config.schema import Config, ModelConfig, OptimizerConfig, ParallelConfig
from megatron_gndpo.parallel.groups import ParallelLayout, layout_of
from megatron_gndpo.plan.hardware import BYTES, DEFAULT_HARDWARE, GIB, Hardware
from megatron_gndpo.plan.layout import colocated_teachers, rank_split
from megatron_gndpo.plan.params import stage_expert_params, stage_params

# The trainer's log-prob heads use TokenLogProbs' default chunk (models/logprob_head.py): at most
# [LOGPROB_CHUNK_TOKENS, V/tp] logits exist at once, never [T, V] (a test pins the two together).
LOGPROB_CHUNK_TOKENS = 2048


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


def estimate_memory(
    cfg: Config, world_size: int, hw: Hardware = DEFAULT_HARDWARE
) -> list[RankMemory]:
    """Per-rank memory of every (student stage, teacher stage) pair that some trainer rank
    holds. With rollout ranks apart (rollout.disaggregate) the layouts cover the first
    world - R ranks and these generate nothing (plan/disaggregated.py has the rollout ranks)."""
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
