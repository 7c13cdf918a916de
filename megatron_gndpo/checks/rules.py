"""Cross-field rules: combinations that cannot run, each reported with the fix.

:func:`validate` collects every problem and raises one :class:`ConfigError` listing them all, so a
user fixes a config in one round. What depends on the estimator is the method's
(:func:`~megatron_gndpo.methods.method_problems`). These rules read other components (the
methods, the parallel layouts, the image layouts), so they live here, beside the entry points,
and ``config/`` stays a leaf. :func:`~megatron_gndpo.config.check_environment` is separate: it
checks that the packages a config asks for are importable here, which ``plan`` (run from a
laptop for a cluster) does not require.
"""

from __future__ import annotations

from typing import Any

from megatron_gndpo.algorithms import AGGREGATIONS, POLICY_LOSSES
from megatron_gndpo.algorithms.offpolicy import bounds_problem
from megatron_gndpo.checks.context import context_problems
from megatron_gndpo.checks.cross_tokenizer import cross_tokenizer_problems
from megatron_gndpo.checks.moe import moe_problems, routing_replay_problems
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import (
    AlgorithmConfig,
    Config,
    ModelConfig,
    ParallelConfig,
    TeacherConfig,
    teacher_sections,
)
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.methods import build_method, method_problems
from megatron_gndpo.parallel.groups import layout_of


def _one_of(problems: list[str], key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(f"{key}: unknown name {value!r}; use one of {', '.join(allowed)}")


def _positive(problems: list[str], key: str, value: float, *, strict: bool = True) -> None:
    if value <= 0 if strict else value < 0:
        bound = "> 0" if strict else ">= 0"
        problems.append(f"{key} must be {bound}, got {value}")


def _model_problems(
    model: ModelConfig, parallel: ParallelConfig, key: str | None, max_tokens: int
) -> list[str]:
    """A model's problems; ``key``: its teacher section (``teacher``, ``teachers[1]``), None for
    the student."""
    p: list[str] = []
    section = "model" if key is None else f"{key}.model"
    psection = "parallel" if key is None else f"{key}.parallel"
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "make_vocab_size_divisible_by",
    ):
        _positive(p, f"{section}.{name}", getattr(model, name))  # fmt: skip
    for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
        _positive(p, f"{psection}.{name}", getattr(parallel, name))
    if p:
        return p
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        p.append(
            f"{section}.hidden_size ({model.hidden_size}) is not divisible by "
            f"num_attention_heads ({model.num_attention_heads}); set kv_channels explicitly"
        )
    if model.num_attention_heads % model.query_groups:
        p.append(
            f"{section}.num_attention_heads ({model.num_attention_heads}) is not a multiple of "
            f"num_query_groups ({model.query_groups})"
        )
    if model.num_attention_heads % tp or model.query_groups % tp:
        p.append(
            f"{psection}.tensor_parallel={tp} must divide {section}.num_attention_heads "
            f"({model.num_attention_heads}) and the number of KV heads ({model.query_groups}); "
            "lower tensor_parallel"
        )
    if model.ffn_hidden_size % tp:
        p.append(f"{psection}.tensor_parallel={tp} must divide {section}.ffn_hidden_size")
    if model.num_layers % pp:
        p.append(
            f"{psection}.pipeline_parallel={pp} must divide {section}.num_layers "
            f"({model.num_layers}) so every stage holds the same number of layers"
        )
    if parallel.sequence_parallel and tp == 1:
        p.append(f"{psection}.sequence_parallel needs tensor_parallel > 1; set it to false")
    if model.model_class == "hybrid" and model.vision is not None:
        p.append(
            f"{section}.model_class=hybrid does not cover vision-language models "
            f"({section}.vision): megatron-core's LLaVA model builds its language model as a "
            f"GPTModel; set {section}.model_class=gpt"
        )
    if model.model_class == "hybrid" and model.rotary_scaling_factor is not None:
        p.append(
            f"{section}.model_class=hybrid with rotary_scaling_factor: megatron-core 0.19's "
            f"HybridModel has no RoPE scaling (Llama 3.1); set {section}.model_class=gpt"
        )
    if model.fp8 is not None and model.transformer_impl != "transformer_engine":
        p.append(
            f"{section}.fp8={model.fp8} needs {section}.transformer_impl=transformer_engine "
            "(FP8 runs only in Transformer Engine layers)"
        )
    if parallel.context_parallel > 1 and model.transformer_impl != "transformer_engine":
        p.append(
            f"{psection}.context_parallel > 1 needs {section}.transformer_impl="
            "transformer_engine (megatron-core's local attention has no context parallelism)"
        )
    if max_tokens > model.max_position_embeddings:
        p.append(
            f"rollout.max_prompt_length + rollout.max_response_length = {max_tokens} exceeds "
            f"{section}.max_position_embeddings ({model.max_position_embeddings}); shorten the "
            "rollout or raise max_position_embeddings"
        )
    return p + moe_problems(model, parallel, section, psection, trains=key is None)


def _algorithm_problems(cfg: Config) -> list[str]:
    """The algorithm section's own values; what depends on the estimator is the method's
    (``methods/``, :func:`method_problems`)."""
    a, p = cfg.algorithm, list[str]()
    _one_of(p, "algorithm.policy_loss", a.policy_loss, POLICY_LOSSES)
    _one_of(p, "algorithm.aggregation", a.aggregation, AGGREGATIONS)
    _positive(p, "algorithm.kl_clip", a.kl_clip)
    _positive(p, "algorithm.clip_low", a.clip_low)
    _positive(p, "algorithm.clip_high", a.clip_high)
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        p.append(f"algorithm.dual_clip must be > 1 (or null to disable it), got {a.dual_clip}")
    if a.dual_clip is not None and a.policy_loss != "ppo_clip":
        p.append("algorithm.dual_clip applies to policy_loss=ppo_clip only; set it to null")
    if a.vopd_top_k < 0:
        p.append(f"algorithm.vopd_top_k must be >= 0 (0 = full vocabulary), got {a.vopd_top_k}")
    if not 0.0 <= a.gamma <= 1.0:
        p.append(f"algorithm.gamma must be in [0, 1], got {a.gamma}")
    p += _guidance_problems(a, cfg.model.vocab_size)
    p += routing_replay_problems(cfg)
    p += _offpolicy_problems(cfg)
    p += _filter_problems(cfg)
    if cfg.rollout.engine == "vllm" and cfg.parallel.pipeline_parallel > 1:
        p.append(
            "rollout.engine=vllm needs the student at parallel.pipeline_parallel=1 (the engine is "
            "colocated with each tensor-parallel group); use the builtin engine with PP > 1"
        )
    if cfg.rollout.engine == "vllm" and cfg.model.is_moe:
        p += _vllm_moe_problems(cfg.model)
    return p


def _vllm_moe_problems(model: ModelConfig) -> list[str]:
    """The weight sync hands vLLM the student as a Qwen3-MoE checkpoint: what it cannot hold
    would otherwise fail at the first sync, after the models are built."""
    from megatron_gndpo.checkpoint import hf_mapping

    try:
        hf_mapping.check_family(model, model.hf_family)
    except ValueError as err:
        return [
            f"rollout.engine=vllm syncs a mixture-of-experts student into vLLM as "
            f"{model.hf_family}, and {err}: change the model section, or set "
            "rollout.engine=builtin"
        ]
    return []


def _guidance_problems(a: AlgorithmConfig, vocab_size: int) -> list[str]:
    """TGPO, TrOPD, vOPD's k and the entropy bonus."""
    p, g, t = list[str](), a.tgpo, a.tropd
    for key, k in (("vopd_top_k", a.vopd_top_k), ("tgpo.top_k", g.top_k), ("tropd.top_k", t.top_k)):
        if k > vocab_size:
            p.append(f"algorithm.{key} = {k} exceeds the vocabulary ({vocab_size} ids); lower it")
    if a.entropy_coef is not None and a.entropy_coef < 0:
        p.append(f"algorithm.entropy_coef must be >= 0 (or null), got {a.entropy_coef}")
    _positive(p, "algorithm.tgpo.top_k", g.top_k)
    _positive(p, "algorithm.tgpo.coef_start", g.coef_start, strict=False)
    _positive(p, "algorithm.tgpo.coef_decay", g.coef_decay, strict=False)
    if not 0.0 < t.trust_threshold <= 1.0:
        p.append(f"algorithm.tropd.trust_threshold must be in (0, 1], got {t.trust_threshold}")
    _positive(p, "algorithm.tropd.outlier_clip", t.outlier_clip)
    _positive(p, "algorithm.tropd.top_k", t.top_k)
    _positive(p, "algorithm.tropd.kl_coef", t.kl_coef, strict=False)
    for name in ("prefix_share_start", "prefix_share_end"):
        share = getattr(t, name)
        if not 0.0 <= share < 1.0:
            p.append(f"algorithm.tropd.{name} must be in [0, 1), got {share}")
    _positive(p, "algorithm.tropd.prefix_decay_steps", t.prefix_decay_steps, strict=False)
    return p


def _offpolicy_problems(cfg: Config) -> list[str]:
    """The off-policy correction's bounds, and the plain sampling its ratio needs."""
    o, r, p = cfg.algorithm.offpolicy, cfg.rollout, list[str]()
    problem = bounds_problem(tis_cap=o.tis_cap, mask_low=o.mask_low, mask_high=o.mask_high)
    if problem:
        p.append(f"algorithm.offpolicy: {problem}")
    if o.correction == "none":
        return p
    changed = [
        f"rollout.{key}={value}"
        for key, value, plain in (
            ("temperature", r.temperature, 1.0), ("top_p", r.top_p, 1.0), ("top_k", r.top_k, 0),
            ("outlier_temperature", r.outlier_temperature, None),
        )
        if value != plain and not (key == "outlier_temperature" and value == 1.0)
    ]  # fmt: skip
    if changed:
        p.append(
            f"algorithm.offpolicy.correction={o.correction} needs the sampler's log-probs of the "
            f"student's own distribution, but {', '.join(changed)} changes what is sampled from: "
            "both engines report the log-prob under the distribution they sampled from (after "
            "temperature, top-k and top-p; vLLM with logprobs_mode=processed_logprobs), while the "
            "trainer's are at temperature 1 over the whole vocabulary, so the ratio would measure "
            "the sampling transform instead of the engine gap. Sample with rollout.temperature=1, "
            "top_p=1, top_k=0 (and no outlier_temperature), or set correction=none"
        )
    return p


def _filter_problems(cfg: Config) -> list[str]:
    """The rollout filter: a length the responses can have, and zero-variance groups only
    where there is a group and a reward the estimator trains on."""
    f, r, p = cfg.algorithm.filter, cfg.rollout, list[str]()
    _positive(p, "algorithm.filter.min_response_tokens", f.min_response_tokens, strict=False)
    if f.min_response_tokens > r.max_response_length:
        p.append(
            f"algorithm.filter.min_response_tokens={f.min_response_tokens} exceeds "
            f"rollout.max_response_length={r.max_response_length}: every response would be "
            "dropped; lower it (or raise max_response_length)"
        )
    if not f.drop_zero_variance_groups:
        return p
    method = _method(cfg)
    if method is not None and not method.uses_reward:
        p.append(
            "algorithm.filter.drop_zero_variance_groups drops prompt groups whose verifiable "
            "rewards are all equal (a group-relative advantage of 0), but "
            f"algorithm.estimator={cfg.algorithm.estimator} does not train on the reward; use "
            "an estimator that does (grpo, reinforce_pp, mix, tgpo) or turn the filter off"
        )
    if r.samples_per_prompt < 2:
        p.append(
            "algorithm.filter.drop_zero_variance_groups compares the samples of one prompt: "
            f"rollout.samples_per_prompt must be >= 2, got {r.samples_per_prompt}"
        )
    return p


def _outlier_problems(cfg: Config) -> list[str]:
    """The outlier steps: an interval of 2 or more, and something that makes them outliers."""
    r, p = cfg.rollout, list[str]()
    sources = {"rollout.outlier_temperature": r.outlier_temperature,
               "data.outlier_train": cfg.data.outlier_train}  # fmt: skip
    _positive(p, "rollout.outlier_interval", r.outlier_interval, strict=False)
    if r.outlier_interval == 1:
        p.append(
            "rollout.outlier_interval=1 makes every step an outlier step; set rollout.temperature "
            "or data.train instead (or an interval of 2 or more)"
        )
    if r.outlier_temperature is not None:
        _positive(p, "rollout.outlier_temperature", r.outlier_temperature)
    if r.outlier_interval > 0 and all(v is None for v in sources.values()):
        p.append(
            f"rollout.outlier_interval={r.outlier_interval} needs what makes those steps "
            "outliers: set rollout.outlier_temperature and/or data.outlier_train"
        )
    unused = [key for key, value in sources.items() if value is not None]
    if r.outlier_interval == 0 and unused:
        p.append(
            f"{' and '.join(unused)} {'apply' if len(unused) > 1 else 'applies'} to outlier "
            "steps only: set rollout.outlier_interval "
            "(every how many steps), or leave them null"
        )
    return p


def _rollout_problems(cfg: Config, world_size: int | None) -> list[str]:
    r, t, p = cfg.rollout, cfg.trainer, list[str]()
    for name in (
        "prompts_per_step",
        "samples_per_prompt",
        "max_prompt_length",
        "max_response_length",
        "temperature",
    ):
        _positive(p, f"rollout.{name}", getattr(r, name))  # fmt: skip
    if not 0.0 < r.top_p <= 1.0:
        p.append(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _positive(p, "rollout.top_k", r.top_k, strict=False)
    if not 0.0 < r.gpu_memory_utilization < 1.0:
        p.append(
            f"rollout.gpu_memory_utilization must be in (0, 1), got {r.gpu_memory_utilization}"
        )
    p += _outlier_problems(cfg)
    if r.vllm_kv_cache_gib is not None:
        _positive(p, "rollout.vllm_kv_cache_gib", r.vllm_kv_cache_gib)
    if r.weight_sync_check_tolerance is not None:
        _positive(p, "rollout.weight_sync_check_tolerance", r.weight_sync_check_tolerance)
    for name in ("steps", "micro_batch_size", "optimizer_steps_per_rollout"):
        _positive(p, f"trainer.{name}", getattr(t, name))
    _positive(p, "trainer.eval_interval", t.eval_interval, strict=False)
    _positive(p, "trainer.eval_samples", t.eval_samples, strict=False)
    _positive(p, "trainer.scoring_token_budget", t.scoring_token_budget)
    if p or world_size is None:
        return p
    try:
        dp = layout_of(cfg.parallel, world_size).dp
        teacher_dp = layout_of(cfg.teacher.parallel, world_size).dp
    except ConfigError:
        return p  # reported with the layout problems
    batch = r.rollout_batch_size
    if batch % teacher_dp and not cfg.teachers:  # several: each one's rows are padded to fit
        p.append(
            f"the rollout batch ({batch}) is not divisible by the teacher's data-parallel size "
            f"{teacher_dp} (each teacher replica scores an equal share); make it a multiple"
        )
    if r.prompts_per_step % dp:
        # rows of one prompt stay on one rank (GRPO groups), so the prompts are what is split
        p.append(
            f"rollout.prompts_per_step ({r.prompts_per_step}) is not divisible by the student's "
            f"data-parallel size {dp}: each rank samples for whole prompts; make it a multiple "
            f"of {dp}"
        )
        return p
    per_rank = batch // dp
    mini = t.optimizer_steps_per_rollout * t.micro_batch_size
    if per_rank % mini:
        p.append(
            f"each data-parallel rank holds {per_rank} sequences per step, which does not split "
            f"into trainer.optimizer_steps_per_rollout ({t.optimizer_steps_per_rollout}) "
            f"mini-batches of whole micro-batches of trainer.micro_batch_size "
            f"({t.micro_batch_size}); make {per_rank} a multiple of {mini}"
        )
    return p


def _other_problems(cfg: Config) -> list[str]:
    p: list[str] = []
    o = cfg.optimizer
    _positive(p, "optimizer.lr", o.lr, strict=False)
    _positive(p, "optimizer.clip_grad", o.clip_grad)
    _positive(p, "optimizer.warmup_steps", o.warmup_steps, strict=False)
    for key, section in teacher_sections(cfg):
        _positive(p, f"{key}.temperature", section.temperature)
    _positive(p, "checkpoint.save_interval", cfg.checkpoint.save_interval, strict=False)
    _positive(p, "checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive(p, "logging.log_interval", cfg.logging.log_interval)
    t = cfg.trainer
    _positive(p, "trainer.collective_timeout_s", t.collective_timeout_s)
    _positive(p, "trainer.heartbeat_timeout_s", t.heartbeat_timeout_s, strict=False)
    if t.heartbeat_timeout_s >= t.collective_timeout_s > 0:
        p.append(
            f"trainer.heartbeat_timeout_s ({t.heartbeat_timeout_s}) must be below "
            f"trainer.collective_timeout_s ({t.collective_timeout_s}), or the collective fails "
            "first without naming the silent rank; lower it (or 0 to disable the watchdog)"
        )
    if cfg.checkpoint.start_fresh and cfg.checkpoint.load is not None:
        p.append(
            "checkpoint.start_fresh=true starts at step 1 but checkpoint.load names a checkpoint "
            "to resume from; keep one of them"
        )
    vocab = cfg.data.vocab_size if cfg.data.vocab_size is not None else cfg.model.vocab_size
    _positive(p, "data.vocab_size", vocab)
    if vocab > cfg.model.vocab_size:
        p.append(
            f"data.vocab_size ({vocab}) exceeds model.vocab_size ({cfg.model.vocab_size}): the "
            "student has no embedding row for some token ids; check the tokenizer"
        )
    for key, section in teacher_sections(cfg):
        if vocab > section.model.vocab_size and not section.cross_tokenizer:
            p.append(
                f"{key}.model.vocab_size ({section.model.vocab_size}) is smaller than the "
                f"vocabulary the student samples from ({vocab}): the teacher scores the "
                "student's token ids, so both must share a tokenizer. Use a teacher of the "
                "student's family (or one with its own tokenizer: cross_tokenizer=true), or, if "
                "the tokenizer really has fewer ids than the student's embedding, set "
                "data.vocab_size to its size"
            )
    return p


def _served_problems(cfg: Config) -> list[str]:
    """Teachers behind a server (teacher.server): what a served teacher can score."""
    p: list[str] = []
    method = _method(cfg)
    for key, t in teacher_sections(cfg):
        server = t.server
        if server is None:
            continue
        if not server.url.startswith(("http://", "https://")):
            p.append(f"{key}.server.url={server.url!r}: give the server's http:// or https:// URL")
        for name in ("rows_per_request", "concurrency", "timeout_s", "check_tolerance"):
            _positive(p, f"{key}.server.{name}", getattr(server, name))
        _positive(p, f"{key}.server.retries", server.retries, strict=False)
        if t.temperature != 1.0:
            p.append(
                f"{key}.temperature={t.temperature}: a served teacher's prompt log-probs are the "
                "model's at temperature 1; set it to 1.0 or colocate the teacher"
            )
        if t.model.vision is not None:
            p.append(f"{key}.server: a served teacher scores text only; colocate a VLM teacher")
        if method is not None and method.teacher_samples:
            p.append(
                f"{key}.server with teacher-written prefixes (tropd.prefix_*): a served teacher "
                "does not generate here; turn the prefixes off or colocate the teacher"
            )
        asked = "" if method is None else _served_request_problem(method)
        if asked:
            p.append(
                f"{key}.server: algorithm.estimator={cfg.algorithm.estimator} asks the teacher "
                f"for {asked}, which a served teacher cannot give (log-probs and top-k only); "
                "colocate the teacher or use gndpo/opd/tgpo/tropd"
            )
    return p


def _method(cfg: Config) -> Any:
    """The config's method, or None for an unknown estimator (reported by its own rule)."""
    try:
        return build_method(cfg.algorithm)
    except ValueError:
        return None


def _served_request_problem(method: Any) -> str:
    """What the method's teacher request asks beyond log-probs and top-k ('' when nothing)."""
    import torch

    from megatron_gndpo.engine.scoring import Scores
    from megatron_gndpo.teacher.served import unsupported_asks

    one = torch.zeros(1, 1)
    student = Scores(one, topk_ids=torch.zeros(1, 1, 1, dtype=torch.long), hidden=one[..., None])
    request = method.teacher_request(student if method.student_first else None, 0)
    return ", ".join(unsupported_asks(request))


def _teachers_problems(cfg: Config) -> list[str]:
    """Several teachers: names, routing values, the default, what needs a single teacher."""
    if not cfg.teachers:
        return []
    p: list[str] = []
    if cfg.teacher != TeacherConfig():
        p.append(
            "both teacher and teachers are set: with teachers, every teacher is an entry of the "
            "list; move the teacher section into it (with a name) and remove it"
        )
    names = [t.name for t in cfg.teachers]
    twice = sorted({name for name in names if name and names.count(name) > 1})
    if twice:
        p.append(f"teachers: the names {twice} are used more than once; names must be unique")
    owner: dict[str, int] = {}
    for i, t in enumerate(cfg.teachers):
        if not t.name:
            p.append(f"teachers[{i}].name is empty: give every teacher a name (metrics use it)")
        _positive(p, f"teachers[{i}].weight", t.weight)
        for value in dict.fromkeys((t.name, *t.sources)):
            if value in owner and owner[value] != i and value not in twice:
                p.append(
                    f"teachers[{i}] ({t.name}) takes the routing value {value!r}, which "
                    f"already routes to {cfg.teachers[owner[value]].name}: each value of "
                    "data.teacher_key routes to one teacher; remove one of them"
                )
            owner.setdefault(value, i)
    default = cfg.data.default_teacher
    if default is not None and default not in names:
        p.append(f"data.default_teacher={default!r} names no teacher; use one of {names}")
    method = _method(cfg)
    if method is not None and method.teacher_samples:
        p.append(
            f"algorithm.estimator={cfg.algorithm.estimator} with teacher-written prefixes "
            "(tropd.prefix_*) samples from the teacher, which needs one teacher; use the teacher "
            "section, or turn the prefixes off"
        )
    return p


def _vllm_vision_problems(cfg: Config, vision: VisionConfig) -> list[str]:
    """What vLLM needs of a vision-language student: transformers' InternVL, served as such."""
    from megatron_gndpo.checkpoint.vlm_mapping import internvl_problems

    p = [
        f"rollout.engine=vllm serves a VLM as transformers' InternVL, but model.vision has {x}; "
        "use rollout.engine=builtin for other VLMs"
        for x in internvl_problems(cfg.model, vision)
    ]
    if vision.image_start_id is None:
        p.append(
            "rollout.engine=vllm wraps every image in <img> ... </img>: set "
            "model.vision.image_start_id and image_end_id (and the teacher's) to those token ids "
            "so the trainer scores the sequence the engine sampled from"
        )
    tokenizer = cfg.data.tokenizer
    if tokenizer is None or tokenizer.startswith("builtin:") or tokenizer.endswith(".model"):
        p.append(
            f"rollout.engine=vllm with a VLM needs data.tokenizer to be a Hugging Face tokenizer "
            f"directory (vLLM's InternVL processor tokenizes the image tokens), got {tokenizer!r}"
        )
    return p


def _vision_problems(cfg: Config) -> list[str]:
    """Vision-language models: both or neither, one image layout, what the VLM path supports."""
    student = cfg.model.vision
    teachers = [(key, t.model.vision) for key, t in teacher_sections(cfg)]
    if student is None and all(vision is None for _, vision in teachers):
        return []
    p = []
    from megatron_gndpo.data.images import check_same_image_layout

    for key, teacher in teachers:
        if student is None or teacher is None:
            p.append(
                f"model.vision and {key}.model.vision must both be set (a vision-language "
                "student and teacher) or both be null: the teacher scores the student's rows, "
                "images included"
            )
            continue
        try:
            check_same_image_layout(student, teacher)
        except ValueError as err:
            p.append(str(err))
    if student is None:
        return p
    if cfg.rollout.engine == "vllm":
        p += _vllm_vision_problems(cfg, student)
    if cfg.trainer.pack_sequences:
        p.append(
            "trainer.pack_sequences=true is not supported with a vision-language model yet (rows "
            "with images are scored padded); set trainer.pack_sequences=false"
        )
    return p


def split_problems(d: Any, world_size: int | None) -> list[str]:
    """What is wrong with the rollout ranks' share of ``world_size`` ranks
    (``rollout.disaggregate``; ``d`` its section): none left to train, or a rollout TP that
    does not divide them. ``plan`` raises the first (plan.rank_split)."""
    p = []
    if world_size is not None and d.ranks >= world_size:
        p.append(
            f"rollout.disaggregate.ranks ({d.ranks}) leaves no rank of the {world_size} to train; "
            "launch more ranks or give fewer to the rollouts"
        )
    if d.tensor_parallel < 1 or d.ranks % d.tensor_parallel:
        p.append(
            f"rollout.disaggregate.tensor_parallel ({d.tensor_parallel}) must divide "
            f"rollout.disaggregate.ranks ({d.ranks}): each rollout replica is that many ranks"
        )
    return p


def _disaggregate_problems(cfg: Config, world_size: int | None, max_tokens: int) -> list[str]:
    """Rollout ranks apart (rollout.disaggregate): sizes, and what they do not run yet."""
    d, p = cfg.rollout.disaggregate, list[str]()
    _positive(p, "rollout.disaggregate.ranks", d.ranks, strict=False)
    _positive(p, "rollout.disaggregate.tensor_parallel", d.tensor_parallel)
    _positive(p, "rollout.disaggregate.staleness", d.staleness, strict=False)
    if p or not d.enabled:
        if d.staleness and not d.enabled:
            p.append(
                "rollout.disaggregate.staleness needs rollout ranks apart: set "
                "rollout.disaggregate.ranks (colocated rollouts are always synchronous)"
            )
        return p
    p += split_problems(d, world_size)
    rollout_parallel = ParallelConfig(tensor_parallel=d.tensor_parallel)
    p += [
        problem.replace("parallel.", "rollout.disaggregate.", 1)
        for problem in _model_problems(cfg.model, rollout_parallel, None, max_tokens)
    ]
    unsupported = {
        "a vision-language student (model.vision)": cfg.model.vision is not None,
        "a mixture-of-experts student (its routing and expert weights are not sent yet)": (
            cfg.model.is_moe
        ),
        f"algorithm.estimator={cfg.algorithm.estimator}, whose rollouts continue "
        "teacher-written prefixes (the teacher lives on the trainer ranks)": (
            build_method(cfg.algorithm).teacher_samples
        ),
    }
    for what, used in unsupported.items():
        if used:
            p.append(
                f"rollout.disaggregate does not support {what}; use colocated rollouts "
                "(rollout.disaggregate.ranks=0)"
            )
    return p


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Raise one ConfigError listing every problem; return ``cfg`` unchanged when it is sound.

    With ``world_size`` the parallel layouts and batch divisibility are checked too; with
    rollout ranks apart (rollout.disaggregate) the layouts cover the other ranks.
    """
    max_tokens = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    problems = _model_problems(cfg.model, cfg.parallel, None, max_tokens)
    for key, section in teacher_sections(cfg):
        problems += _model_problems(section.model, section.parallel, key, max_tokens)
    problems += _disaggregate_problems(cfg, world_size, max_tokens)
    d = cfg.rollout.disaggregate
    if world_size is not None and d.ranks > 0 and world_size > d.ranks:
        world_size -= d.ranks  # the trainer's world
    if world_size is not None:
        _positive(problems, "world size", world_size)
        if world_size > 0:
            layouts = [("parallel", cfg.parallel)]
            layouts += [(f"{key}.parallel", t.parallel) for key, t in teacher_sections(cfg)]
            for name, parallel in layouts:
                try:
                    layout_of(parallel, world_size)
                except ConfigError as err:
                    problems.append(f"{name}: {err}")
    known = world_size if world_size and world_size > 0 else None
    problems += _algorithm_problems(cfg)
    problems += method_problems(cfg, known)
    problems += _rollout_problems(cfg, known)
    problems += _other_problems(cfg)
    problems += _vision_problems(cfg)
    problems += _teachers_problems(cfg)
    problems += _served_problems(cfg)
    problems += cross_tokenizer_problems(cfg, _method(cfg))
    problems += context_problems(cfg, _method(cfg))
    if problems:
        lines = "\n".join(f"  - {msg}" for msg in problems)
        raise ConfigError(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")
    return cfg
