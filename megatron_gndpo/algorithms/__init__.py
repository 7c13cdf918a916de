"""Pure tensor math of on-policy distillation: scores, advantages, losses, aggregation, metrics.

Only torch is imported; collectives happen only through an explicit ``group`` argument (the
data-parallel × context-parallel group), and ``group=None`` means the batch is all local.
Shapes: ``[B, T]`` = [sequences on this rank, response length].
"""

from megatron_gndpo.algorithms.advantages import (
    discounted_returns,
    gndpo_advantages,
    grpo_advantages,
    mix_advantages,
    opd_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    token_kl_full,
    token_kl_topk,
    vopd_advantages,
)
from megatron_gndpo.algorithms.aggregation import AGGREGATIONS, aggregate_loss, global_count
from megatron_gndpo.algorithms.losses import (
    POLICY_LOSSES,
    gspo_token_loss,
    importance_sampled_pg_loss,
    ppo_clip_loss,
)
from megatron_gndpo.algorithms.metrics import (
    StabilityMonitor,
    advantage_metrics,
    clip_active,
    log_log_slope,
    policy_metrics,
    score_metrics,
    spike_flags,
    trailing_medians,
)
from megatron_gndpo.algorithms.offpolicy import CORRECTIONS, importance_weights, offpolicy_metrics
from megatron_gndpo.algorithms.scores import distillation_scores, raw_scores
from megatron_gndpo.algorithms.stats import global_sum, masked_moments, masked_whiten

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "POLICY_LOSSES",
    "StabilityMonitor",
    "advantage_metrics",
    "aggregate_loss",
    "clip_active",
    "discounted_returns",
    "distillation_scores",
    "global_count",
    "global_sum",
    "gndpo_advantages",
    "grpo_advantages",
    "gspo_token_loss",
    "importance_sampled_pg_loss",
    "importance_weights",
    "log_log_slope",
    "masked_moments",
    "masked_whiten",
    "mix_advantages",
    "offpolicy_metrics",
    "opd_advantages",
    "outcome_token_rewards",
    "policy_metrics",
    "ppo_clip_loss",
    "raw_scores",
    "reinforce_pp_advantages",
    "score_metrics",
    "spike_flags",
    "token_kl_full",
    "token_kl_topk",
    "trailing_medians",
    "vopd_advantages",
]
