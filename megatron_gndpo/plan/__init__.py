"""``megatron-gndpo plan``: both models' layouts, per-rank parameters and memory, step time.

Pure arithmetic: no process group, no GPU, no megatron import, so a 256-rank (or 4096-rank) plan
runs on a laptop. The rooms, each building on the ones before it:

- ``params.py``: parameter counts per rank, exactly megatron-core's local GPT spec;
- ``layout.py``: each model's pipeline stages and ranks, and the trainer / rollout split of the
  ranks (:func:`rank_split`: with rollout ranks apart, rollout.disaggregate, everything but
  ``disaggregated.py`` covers the trainer's ranks);
- ``hardware.py``: the GPU the plan is for (:class:`Hardware`) and the byte sizes;
- ``memory.py``: bytes per rank (weights, gradients, optimizer shards, activations, rollout KV
  cache, the teacher), by phase of the step;
- ``step_time.py``: the step time (model FLOPs at a stated MFU, the decode floor);
- ``report.py``: what the command prints, and the warnings of a rank that does not fit;
- ``disaggregated.py``: the rollout ranks' memory and the overlapped step.

The names below are the planner's public interface.
"""

from megatron_gndpo.plan.disaggregated import (
    DisaggregatedStepTime,
    RolloutRankMemory,
    best_rollout_ranks,
    estimate_disaggregated_step_time,
    estimate_rollout_memory,
    format_disaggregated,
    format_disaggregated_step_time,
    format_rollout_memory,
    with_rollout_ranks,
)
from megatron_gndpo.plan.hardware import (
    BYTES,
    DEFAULT_HARDWARE,
    GIB,
    H100_HBM_BYTES_PER_S,
    H100_PEAK_FLOPS,
    IB_HDR_BYTES_PER_S,
    RESERVED_FRACTION,
    Hardware,
)
from megatron_gndpo.plan.layout import (
    ModelPlan,
    RankSplit,
    StagePlan,
    colocated_teachers,
    plan,
    plan_model,
    rank_split,
    teacher_plans,
    valid_rollout_ranks,
)
from megatron_gndpo.plan.memory import (
    LOGPROB_CHUNK_TOKENS,
    RankMemory,
    activation_bytes_per_token,
    builtin_rollout_bytes,
    estimate_memory,
    kv_cache_bytes,
    logprob_head_bytes,
    optimizer_bytes_per_param,
    sequence_length,
    vllm_share_bytes,
)
from megatron_gndpo.plan.params import (
    expert_layer_params,
    layer_params,
    stage_expert_params,
    stage_params,
    total_params,
)
from megatron_gndpo.plan.report import (
    MAX_LISTED_RANKS,
    fit_warnings,
    format_memory,
    format_model_plan,
    format_step_time,
)
from megatron_gndpo.plan.step_time import StepTime, estimate_step_time, generation_time

__all__ = [
    "BYTES",
    "DEFAULT_HARDWARE",
    "GIB",
    "H100_HBM_BYTES_PER_S",
    "H100_PEAK_FLOPS",
    "IB_HDR_BYTES_PER_S",
    "LOGPROB_CHUNK_TOKENS",
    "MAX_LISTED_RANKS",
    "RESERVED_FRACTION",
    "DisaggregatedStepTime",
    "Hardware",
    "ModelPlan",
    "RankMemory",
    "RankSplit",
    "RolloutRankMemory",
    "StagePlan",
    "StepTime",
    "activation_bytes_per_token",
    "best_rollout_ranks",
    "builtin_rollout_bytes",
    "colocated_teachers",
    "estimate_disaggregated_step_time",
    "estimate_memory",
    "estimate_rollout_memory",
    "estimate_step_time",
    "expert_layer_params",
    "fit_warnings",
    "format_disaggregated",
    "format_disaggregated_step_time",
    "format_memory",
    "format_model_plan",
    "format_rollout_memory",
    "format_step_time",
    "generation_time",
    "kv_cache_bytes",
    "layer_params",
    "logprob_head_bytes",
    "optimizer_bytes_per_param",
    "plan",
    "plan_model",
    "rank_split",
    "sequence_length",
    "stage_expert_params",
    "stage_params",
    "teacher_plans",
    "total_params",
    "valid_rollout_ranks",
    "vllm_share_bytes",
    "with_rollout_ranks",
]
