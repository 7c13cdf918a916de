"""Rules of mixture-of-experts models and expert parallelism, each reported with the fix.

Called by :func:`~megatron_gndpo.checks.rules.validate` for the student and every teacher;
``section`` / ``psection`` are the config keys of the model and its parallel section
(``model``, ``teacher.model``, ``teachers[1].parallel``...).
"""

from __future__ import annotations

from megatron_gndpo.config.schema import Config, ModelConfig, ParallelConfig


def moe_problems(
    model: ModelConfig, parallel: ParallelConfig, section: str, psection: str, *, trains: bool
) -> list[str]:
    """The MoE fields of one model; ``trains``: the student (the teacher only scores)."""
    p: list[str] = []
    ep, tp = parallel.expert_parallel, parallel.tensor_parallel
    if ep < 1:
        p.append(f"{psection}.expert_parallel must be >= 1, got {ep}")
    if model.num_experts is not None and model.num_experts < 0:
        p.append(f"{section}.num_experts must be >= 0 (null or 0: a dense model)")
    if not model.is_moe:
        if ep > 1:
            p.append(
                f"{psection}.expert_parallel={ep} needs a mixture-of-experts model: set "
                f"{section}.num_experts, or expert_parallel to 1"
            )
        return p
    experts, k = model.num_experts or 0, model.moe_router_topk
    if not 1 <= k <= experts:
        p.append(
            f"{section}.moe_router_topk={k} must be between 1 and {section}.num_experts "
            f"({experts}); lower it"
        )
    if ep >= 1 and experts % ep:
        p.append(
            f"{section}.num_experts ({experts}) is not divisible by {psection}.expert_parallel "
            f"({ep}): each expert-parallel rank holds an equal share of the experts; choose an "
            "expert_parallel that divides it"
        )
    if model.moe_ffn_hidden_size is not None and model.moe_ffn_hidden_size <= 0:
        p.append(f"{section}.moe_ffn_hidden_size must be > 0 (or null: ffn_hidden_size)")
    elif tp >= 1 and model.expert_ffn_hidden_size % tp:
        p.append(
            f"{psection}.tensor_parallel={tp} must divide the expert FFN size "
            f"({model.expert_ffn_hidden_size}, {section}.moe_ffn_hidden_size): experts are "
            "tensor-parallel like the dense layers"
        )
    shared = model.moe_shared_expert_ffn_hidden_size
    if shared < 0 or (tp >= 1 and shared % tp):
        p.append(
            f"{section}.moe_shared_expert_ffn_hidden_size ({shared}) must be >= 0 (0: no shared "
            f"expert) and divisible by {psection}.tensor_parallel ({tp})"
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(model, name) < 0:
            p.append(f"{section}.{name} must be >= 0 (0 disables it), got {getattr(model, name)}")
    if model.moe_capacity_factor is not None and model.moe_capacity_factor <= 0:
        p.append(
            f"{section}.moe_capacity_factor must be > 0, or null for dropless routing, got "
            f"{model.moe_capacity_factor}"
        )
    p += _router_problems(model, section)
    p += _layer_problems(model, section)
    if model.add_bias_linear and tp == 1:
        p.append(
            f"{section}.add_bias_linear=true with MoE layers at tensor_parallel=1: megatron-core "
            "0.19's expert MLP adds its bias in place to a view and fails; set "
            "add_bias_linear=false (Qwen3-MoE and Mixtral have no linear biases)"
        )
    if trains and tp > 1 and not parallel.sequence_parallel:
        p.append(
            f"{psection}.tensor_parallel={tp} with MoE layers needs "
            f"{psection}.sequence_parallel=true (megatron-core refuses to train MoE layers "
            "under tensor parallelism without it)"
        )
    return p


def routing_replay_problems(cfg: Config) -> list[str]:
    """``algorithm.routing_replay``: what replaying the sampler's experts needs."""
    mode = cfg.algorithm.routing_replay
    if mode not in ("none", "rollout"):
        return [f"algorithm.routing_replay must be none or rollout, got {mode!r}"]
    if mode == "none":
        return []
    p: list[str] = []
    key = "algorithm.routing_replay=rollout"
    if not cfg.model.is_moe:
        p.append(f"{key} needs a mixture-of-experts student (model.num_experts); set it to none")
    if cfg.rollout.engine != "builtin":
        p.append(
            f"{key} needs the sampler's experts, which only the built-in engine records "
            f"(rollout.engine={cfg.rollout.engine}); use rollout.engine=builtin or set it to none"
        )
    if cfg.parallel.sequence_parallel or cfg.parallel.context_parallel > 1:
        p.append(
            f"{key} with parallel.sequence_parallel or context_parallel > 1 is not supported "
            "yet (they split a sequence over ranks before the router); use TP=1 with expert "
            "parallelism for the student, or set it to none"
        )
    return p


def _router_problems(model: ModelConfig, section: str) -> list[str]:
    p: list[str] = []
    if model.moe_router_score_function == "softmax":
        if not model.moe_router_pre_softmax and not model.moe_norm_topk_prob:
            p.append(
                f"{section}.moe_norm_topk_prob=false with moe_router_pre_softmax=false: a "
                "softmax over the top-k logits is always normalised; set "
                "moe_router_pre_softmax=true for unnormalised top-k weights of the full softmax"
            )
    else:
        if model.moe_router_pre_softmax:
            p.append(
                f"{section}.moe_router_pre_softmax applies to softmax routers; set it to false "
                "with moe_router_score_function=sigmoid"
            )
        if not model.moe_norm_topk_prob and model.moe_router_topk > 1:
            p.append(
                f"{section}.moe_norm_topk_prob=false with a sigmoid router: megatron-core always "
                "normalises a sigmoid router's top-k weights (top-k > 1); set it to true"
            )
    return p


def _layer_problems(model: ModelConfig, section: str) -> list[str]:
    p: list[str] = []
    pattern = model.moe_layer_pattern
    if model.moe_layer_freq < 1:
        p.append(
            f"{section}.moe_layer_freq must be >= 1 (1: every layer), got {model.moe_layer_freq}"
        )
    if pattern and (len(pattern) != model.num_layers or set(pattern) - {0, 1}):
        p.append(
            f"{section}.moe_layer_pattern must hold one 0 (dense) or 1 (MoE) per layer "
            f"({model.num_layers} entries), got {list(pattern)}"
        )
    elif pattern and not any(pattern):
        p.append(
            f"{section}.moe_layer_pattern has no MoE layer (all 0); set num_experts to null for "
            "a dense model"
        )
    if pattern and model.moe_layer_freq != 1:
        p.append(
            f"{section}.moe_layer_pattern and moe_layer_freq are both set; keep one of them "
            "(moe_layer_freq: 1)"
        )
    return p
