"""The configuration: one typed, frozen dataclass per component.

Each field is documented once, by the string literal right below it; ``megatron-gndpo --help``
and ``megatron-gndpo config fields`` print these. A component receives only its own section
(the rollout engine gets a ``RolloutConfig``, the loss gets an ``AlgorithmConfig``).
Nothing here rewrites a user value: derived quantities are properties, and cross-field rules
live in ``validate.py``.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Annotated, Literal

from megatron_gndpo.config.vision import VisionConfig

Dtype = Literal["fp32", "bf16", "fp16"]
ModelClass = Literal["gpt", "hybrid"]
PATH = "path"
"""Marks a field that holds a file-system path (``Annotated[str, PATH]``): the loader expands
``~`` and ``$VAR`` / ``${VAR}`` in it, as a shell would (config/loader.py)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a megatron-core language model (Llama, Qwen2/2.5, Qwen3 and Qwen3-MoE
    families), run as a GPTModel or a HybridModel (``model_class``)."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: int = 256
    """Width of the MLP (per branch for SwiGLU)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int | None = None
    """Number of key/value heads for grouped-query attention; null means one per query head."""
    kv_channels: int | None = None
    """Per-head dimension; null means hidden_size / num_attention_heads."""
    vocab_size: int = 128
    """Embedding rows (Hugging Face config.vocab_size), before padding to a multiple of the TP
    size."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times the TP size; padding takes no mass."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + response) the model is built for."""
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    """Position encoding: rotary (all supported families) or learned absolute positions."""
    rotary_base: float = 10000.0
    """RoPE base frequency (1e6 for Qwen2.5/Qwen3, 5e5 for Llama 3)."""
    rotary_scaling_factor: float | None = None
    """Llama-3.1-style RoPE frequency scaling factor; null for none."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Normalisation layer."""
    norm_epsilon: float = 1e-6
    """Epsilon of the normalisation layers."""
    swiglu: bool = True
    """Gated SiLU MLP (Llama/Qwen) instead of a plain GELU MLP."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2/Qwen2.5)."""
    add_bias_linear: bool = False
    """Bias on the other linear layers (false for Llama/Qwen)."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Standard deviation of the random initialisation (ignored when loading a checkpoint)."""
    params_dtype: Dtype = "bf16"
    """Parameter dtype (fp32 master weights are kept by the optimizer for bf16/fp16)."""
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] | None = None
    """Hugging Face family for export and vLLM weight sync; null infers it (qwen3_moe with
    num_experts, qwen3 with qk_layernorm, qwen2 with add_qkv_bias, else llama)."""
    model_class: ModelClass = "gpt"
    """megatron-core class that runs the model: GPTModel (deprecated by megatron-core 0.19 and
    due to be removed; the default while megatron-core has it) or HybridModel with the same
    layers, one attention and one MLP layer (`*-`, `*E` for MoE) per GPT layer. The same weights
    give the same log-probs in both, and every tool reads either (conversion, weight sync,
    rollouts); a checkpoint saved by a gpt run loads into a hybrid run (resume, teacher, initial
    weights) but not the reverse. Use hybrid for megatron-core releases without GPTModel and
    for checkpoints trained as HybridModel; vision-language models (`vision`) need gpt."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer implementation: megatron-core's local spec, or Transformer Engine (needs the `te`
    extra and a GPU)."""
    core_attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention of the local spec: torch scaled_dot_product_attention (flash/efficient
    kernels, 2x megatron's local attention on an H200) or megatron-core's own local attention."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 format for Transformer Engine layers; null for none. Needs transformer_impl:
    transformer_engine."""
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """FP8 scaling recipe passed to megatron-core."""
    fp8_amax_history_len: int = 1024
    """Amax history length for delayed scaling."""
    num_experts: int | None = None
    """Mixture-of-experts: routed experts per MoE layer (megatron-core's MoE layer, router and
    token dispatcher); null or 0 means a dense model (the MoE fields below are then unused)."""
    moe_router_topk: int = 2
    """MoE: experts each token is routed to (Qwen3-MoE's num_experts_per_tok)."""
    moe_ffn_hidden_size: int | None = None
    """MoE: FFN width of each routed expert (per branch for SwiGLU; Qwen3-MoE's
    moe_intermediate_size); null means ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """MoE: FFN width of the shared expert every token passes through besides its routed ones
    (megatron's moe_shared_expert_intermediate_size); 0 means no shared expert (Qwen3-MoE)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """MoE: the router's score function (softmax for Qwen3-MoE/Mixtral, sigmoid for
    DeepSeek-V3-style routers)."""
    moe_router_pre_softmax: bool = False
    """MoE, softmax router: take the softmax over all experts before choosing the top-k
    (Qwen3-MoE's and Mixtral's order). false: softmax over the chosen top-k logits only."""
    moe_norm_topk_prob: bool = True
    """MoE: renormalise each token's top-k weights to sum to 1 (Qwen3-MoE's norm_topk_prob).
    With moe_router_pre_softmax=false the top-k softmax is already normalised; a softmax router
    with moe_router_pre_softmax=true and this true is computed as the top-k softmax (the same
    weights); a sigmoid router with top-k > 1 is always normalised by megatron-core."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the load-balancing (Switch) auxiliary loss added to the student's loss
    through megatron-core's router (logged as moe/load_balancing_loss); 0 disables it."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss (ST-MoE) added to the student's loss (logged as
    moe/z_loss); 0 disables it."""
    moe_capacity_factor: float | None = None
    """MoE: expert capacity as a multiple of the balanced share of tokens; tokens beyond it are
    dropped. null: dropless (every token reaches its experts)."""
    moe_layer_freq: int = 1
    """MoE: one MoE layer every this many layers, starting with the first (megatron's
    moe_layer_freq); 1: every layer. moe_layer_pattern, when given, replaces it."""
    moe_layer_pattern: tuple[int, ...] = ()
    """MoE: one entry per layer, 1 for an MoE layer and 0 for a dense one (megatron's
    moe_layer_freq as a list; Qwen3-MoE's mlp_only_layers are the 0s); empty: moe_layer_freq."""
    vision: VisionConfig | None = None
    """Vision encoder and projector of a vision-language model (megatron-core's LLaVA model
    around this GPT); null for a text-only model. Student and teacher must share its image
    layout (placeholder id, tokens per tile, image size, tiling, normalisation)."""

    @property
    def hf_family(self) -> str:
        """``family``, or the one the architecture implies."""
        if self.family is not None:
            return self.family
        if self.is_moe:
            return "qwen3_moe"
        return "qwen3" if self.qk_layernorm else "qwen2" if self.add_qkv_bias else "llama"

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (``num_experts`` set and not 0)."""
        return bool(self.num_experts)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """FFN width of one routed expert (``moe_ffn_hidden_size`` or ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def moe_softmax_before_topk(self) -> bool:
        """What megatron-core's softmax router is asked to do: the softmax over all experts
        before the top-k, weights not renormalised (its ``moe_router_pre_softmax``), or over the
        chosen top-k logits, which renormalises them.

        megatron-core has no norm_topk_prob: a softmax over the top-k logits IS the full softmax
        restricted to the top-k and renormalised, so renormalising means softmax after the top-k.
        With top-1 the softmax comes first (a softmax over one logit is 1 and has no gradient;
        megatron-core insists).
        """
        if self.moe_router_topk == 1 and self.moe_router_score_function == "softmax":
            return True
        return self.moe_router_pre_softmax and not self.moe_norm_topk_prob

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are MoE layers (all False for a dense model)."""
        if not self.is_moe:
            return (False,) * self.num_layers
        if self.moe_layer_pattern:
            return tuple(bool(x) for x in self.moe_layer_pattern)
        freq = max(self.moe_layer_freq, 1)
        return tuple(i % freq == 0 for i in range(self.num_layers))

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a model is split over the ranks; the data-parallel size is what remains."""

    tensor_parallel: int = 1
    """Tensor-parallel size (shards heads, MLP and vocabulary)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (splits the layers into stages)."""
    context_parallel: int = 1
    """Context-parallel size (splits long sequences; needs Transformer Engine)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the TP region (needs tensor_parallel > 1)."""
    expert_parallel: int = 1
    """Expert-parallel size of a mixture-of-experts model: each MoE layer's experts are split
    over this many ranks, taken out of the data-parallel x context-parallel ranks (megatron's
    rank order tp-cp-ep-dp-pp); experts are tensor-parallel like the rest (expert TP = TP).
    1 for dense models."""


@dataclasses.dataclass(frozen=True)
class TeacherContextConfig:
    """The teacher's own prompt (privileged context, docs/TEACHERS.md "A teacher that sees more"):
    the teacher scores the student's sampled response after this prompt, rendered from the data
    row, while the student sees (and is evaluated on) the plain prompt alone. With
    teacher.weights the student's own model, this is on-policy context distillation."""

    template: str = "{prompt}"
    """The teacher's prompt, a Python format string over the data row: {prompt} is the student's
    prompt, {answer} its reference answer (data.answer_key), any other {name} the row's field of
    that name (a string or number), e.g. "{examples}\n\n{prompt}" or "{prompt}\nHint: {hint}".
    Literal braces are doubled: {{ }}."""
    system: str | None = None
    """A system prompt for the teacher (the same fields); null: the chat template's own."""
    turns: tuple[tuple[str, str], ...] = ()
    """Earlier exchanges of the conversation before the prompt, each [user, assistant] (the
    same fields): few-shot examples in the chat template, e.g. [["{q1}", "{a1}"]]. A small
    instruct model follows examples given as turns far better than examples inlined in one
    message (SmolLM2-135M-Instruct: docs/TEACHERS.md)."""

    def fields(self) -> tuple[str, ...]:
        """The row fields the template and the system prompt name, in order, once each
        (``prompt`` and ``answer`` included); a malformed template is a ValueError."""
        names: list[str] = []
        for text in (self.template, self.system or "", *(t for turn in self.turns for t in turn)):
            for _, name, spec, conversion in string.Formatter().parse(text):
                if name is None:
                    continue
                if not name.isidentifier() or spec or conversion:
                    plain = f"{{{name}{'!' + conversion if conversion else ''}"
                    raise ValueError(
                        f"{plain}{':' + spec if spec else ''}}}: name a field plainly, as {{hint}}"
                    )
                if name not in names:
                    names.append(name)
        return tuple(names)


@dataclasses.dataclass(frozen=True)
class TeacherServerConfig:
    """A teacher served by vLLM's OpenAI-compatible server (``vllm serve``), queried for the
    log-probs of the student's token ids (docs/TEACHERS.md)."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of the server; requests go to URL/v1/completions (and URL/v1/models)."""
    served_model: str | None = None
    """The model name the server serves; null asks the server (URL/v1/models) for its one
    model."""
    rows_per_request: int = 8
    """Sequences per completions request."""
    concurrency: int = 4
    """Requests in flight at once, per querying rank (one rank per student replica queries)."""
    timeout_s: float = 120.0
    """Seconds one request may take before it is retried (each retry is said on the console)."""
    retries: int = 2
    """Further attempts of a request that failed (connection error, timeout, HTTP 5xx), with
    doubling back-off from 1 s; then the step stops with an error naming the URL. With the
    defaults a server that never answers stops the run after about 6 minutes."""
    check_tolerance: float = 1e-3
    """Start-up self-test: the largest difference allowed between two scorings of a probe
    sequence (replicas must agree) and, with teacher.load set, between the server's and the
    local teacher's log-probs of it."""


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher: its own architecture, layout and weights, scoring the student's ids."""

    model: ModelConfig = dataclasses.field(
        default_factory=lambda: ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=512)
    )
    """The teacher's architecture (its vocabulary must cover its tokenizer's: the student's, or
    with cross_tokenizer its own)."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The teacher's TP/PP/CP layout over the same ranks; may differ from the student's."""
    load: Annotated[str | None, PATH] = None
    """Megatron dist-checkpoint directory of the teacher; null builds it randomly (tests)."""
    temperature: float = 1.0
    """Temperature of the teacher's distribution when scoring (1.0 as in the paper)."""
    tokenizer: Annotated[str | None, PATH] = None
    """The teacher's tokenizer when it ships its own (same forms as data.tokenizer); null means
    data.tokenizer. Without cross_tokenizer it must equal the student's (checked at start-up)."""
    cross_tokenizer: bool = False
    """Score the student's responses in the teacher's own tokenizer, which may then differ from
    the student's: each response is decoded, re-encoded after the prompt in the teacher's chat
    template, aligned to the student's tokens by character offsets, and each aligned span's
    teacher log-prob is shared by its student tokens (docs/methods/cross_tokenizer.md).
    Estimators gndpo, opd, grpo, reinforce_pp and mix (with gndpo or opd); a colocated text
    teacher. false: the teacher scores the student's token ids."""
    server: TeacherServerConfig | None = None
    """A teacher served by vLLM instead of built on the job's ranks (docs/TEACHERS.md): its
    model section still gives the vocabulary; load, when set, is only the start-up self-test's
    local reference. null: the teacher is colocated."""
    context: TeacherContextConfig | None = None
    """The teacher's own prompt, rendered from the data row (privileged context: worked
    examples, an instruction, a hint, the reference answer); the student sees the plain prompt.
    null: the teacher sees the student's prompt."""
    weights: Literal["load", "initial", "live", "ema"] = "load"
    """Where the teacher's weights come from. load: teacher.load (a model of its own; null
    builds it randomly). The student's own model, so that with teacher.context the model learns
    without the context what it does with it (docs/TEACHERS.md): initial: the student's initial
    weights (checkpoint.init), frozen; live: the student being trained itself (no second model
    in memory; gradients never flow through the teacher's pass; a moving target); ema: an
    exponential moving average of the student, updated after every optimizer step
    (teacher.ema_decay). With the student's weights, teacher.model is not read (the teacher is
    model) and live and ema need the student's layout."""
    ema_decay: float = 0.99
    """teacher.weights=ema: after each optimizer step, teacher = ema_decay * teacher +
    (1 - ema_decay) * student."""


@dataclasses.dataclass(frozen=True)
class NamedTeacherConfig(TeacherConfig):
    """One of several teachers (``teachers:``): a teacher section with a name, the routing values
    of the prompts it scores, and a weight on its rows' advantages."""

    name: str = ""
    """The teacher's name: metrics are teacher/NAME/..., data.default_teacher names one."""
    sources: tuple[str, ...] = ()
    """Values of the prompt field data.teacher_key routed to this teacher; empty means the
    teacher's name alone."""
    weight: float = 1.0
    """Scale on the advantages of this teacher's rows (after any normalisation): its share of
    the policy gradient relative to the other teachers'."""


@dataclasses.dataclass(frozen=True)
class DisaggregateConfig:
    """Rollout ranks apart from the trainer (docs/PARALLELISM.md, "Disaggregated rollouts"): the
    job's last ``ranks`` ranks only generate, in a torch world of their own; the others score
    and train as usual, on a world of world_size - ranks. After each update the trainer
    broadcasts the student's weights to them (named as Hugging Face names them, as the
    colocated sync does), and with ``staleness`` > 0 they sample the next batches while the
    trainer trains on this one. Off (colocated) by default."""

    ranks: int = 0
    """Ranks (the job's last ones) that only generate; 0: generation is colocated with
    training on every rank (the default)."""
    tensor_parallel: int = 1
    """Tensor-parallel size of the student's copy on the rollout ranks (its own layout,
    independent of parallel.tensor_parallel); it must divide ranks. The rollout ranks form
    ranks / tensor_parallel replicas; the trainer's data-parallel replica d is served by
    rollout replica d mod that count."""
    staleness: int = 0
    """How many optimizer steps the sampling weights lag: batch j is sampled with the weights
    after step max(0, j - 1 - staleness). 0: synchronous (the batch of step j is sampled with
    the weights after step j - 1, as colocated); 1: one-step-off (batch j + 1 is generated
    while the trainer trains on batch j). The bound is kept by waiting: the rollout ranks never
    sample a batch before the weights it must use have arrived, so no batch is ever dropped."""

    @property
    def enabled(self) -> bool:
        """Whether any rank is a rollout rank."""
        return self.ranks > 0


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How the student samples responses."""

    engine: Literal["builtin", "vllm"] = "builtin"
    """Generation engine: built-in megatron-core generation, or vLLM (needs the `vllm` extra)."""
    prompts_per_step: int = 32
    """Prompts drawn per training step (over all data-parallel ranks)."""
    samples_per_prompt: int = 16
    """Responses sampled per prompt."""
    max_prompt_length: int = 1024
    """Prompts longer than this (in tokens, chat template included) are skipped and counted
    (logged as prompts/skipped_too_long), never truncated."""
    max_response_length: int = 2048
    """Maximum number of generated tokens per response."""
    temperature: float = 1.0
    """Sampling temperature."""
    outlier_interval: int = 0
    """Every this many steps (steps N, 2N, ...) is an outlier step, which draws its prompts from
    data.outlier_train and/or samples at outlier_temperature: a documented source of outlier
    batches for stability experiments (docs/methods/gndpo.md, demo --stability); 0: none."""
    outlier_temperature: float | None = None
    """Sampling temperature of the outlier steps; null means rollout.temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables it)."""
    top_k: int = 0
    """Top-k sampling (0 disables it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (the tokenizer's EOS always does)."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: fraction of GPU memory the engine may take while awake (on vLLM's CPU
    backend a fraction of the machine's memory, unless VLLM_CPU_KVCACHE_SPACE sets the KV
    cache size in GiB)."""
    vllm_kv_cache_gib: float | None = None
    """vLLM only: the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes); null sizes it by
    gpu_memory_utilization on GPUs, and means 1 GiB on vLLM's CPU backend (where that fraction
    would be of the machine's memory, for every rank)."""
    vllm_enforce_eager: bool | None = None
    """vLLM only: run the model eagerly (no torch.compile, no CUDA graphs); null means eager on
    vLLM's CPU backend and compiled with CUDA graphs on GPUs."""
    weight_sync_check: Literal["every", "first", "never"] = "every"
    """vLLM, or rollout ranks apart (rollout.disaggregate): after a weight sync, compare the
    engine's log-probs of a fixed probe sequence with the trainer's and stop with an error when
    they differ by more than weight_sync_check_tolerance (a silently corrupted or stale engine).
    every: after every sync (one short forward pass on both sides); first: after the first sync
    only; never: no check."""
    weight_sync_check_tolerance: float | None = None
    """vLLM or rollout ranks apart: largest mean absolute log-prob difference per probe token
    the check accepts; null means 1e-3 for an fp32 engine and 0.05 for bf16/fp16."""
    vllm_image_input: Literal["embeddings", "pixels"] = "embeddings"
    """vLLM with a vision-language student: embeddings hands the engine the student's own image
    embeddings (exactly what the trainer scores; only the language model is synced); pixels
    hands it the original images, which vLLM tiles itself with transformers' InternVL processor,
    and also syncs the projector (and the encoder once, when frozen)."""

    disaggregate: DisaggregateConfig = dataclasses.field(default_factory=DisaggregateConfig)
    """Rollout ranks apart from the trainer, and one-step-off (or k-step-off) pipelining."""

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per step: prompts_per_step * samples_per_prompt."""
        return self.prompts_per_step * self.samples_per_prompt


@dataclasses.dataclass(frozen=True)
class TGPOConfig:
    """TGPO (arXiv 2605.13230): GRPO on the verifiable reward plus a decaying pull towards the
    teacher's next token at every response position (docs/methods/tgpo.md; details not stated in
    the paper's abstract or release are our reading)."""

    guidance: Literal["loss", "advantage"] = "loss"
    """loss: add coef * mean_t[-log p_student(teacher token)] to the loss (the release default);
    advantage: add coef * p_old(teacher token) to each token's advantage instead."""
    teacher_token: Literal["greedy", "sampled", "topk"] = "greedy"
    """greedy: the teacher's argmax token at each position; sampled: a token drawn from the
    teacher's distribution at each position; topk: forward KL to the teacher's top_k tokens
    instead of one token (guidance=loss only)."""
    top_k: int = 20
    """Teacher tokens for teacher_token=topk (the release tries 5, 20 and 100)."""
    coef_start: float = 0.002
    """lambda_0, the guidance coefficient at step 1 (release default 0.002)."""
    coef_decay: float = 1e-5
    """delta: lambda_k = max(lambda_0 - (k - 1) * delta, 0) (release default 1e-5 per step)."""


@dataclasses.dataclass(frozen=True)
class TrOPDConfig:
    """TrOPD (arXiv 2606.01249): on-policy distillation inside a per-token trust region, teacher
    imitation outside it (docs/methods/tropd.md; the threshold rule and outlier details are our
    reading)."""

    trust_threshold: float = 1.0
    """A token is trusted when p_teacher(y) >= trust_threshold * p_student(y) (in (0, 1])."""
    outlier: Literal["topk_kl", "mask", "clip"] = "topk_kl"
    """Untrusted tokens: topk_kl (forward KL over the teacher's top_k instead of the policy
    gradient), mask (no loss), clip (advantage bounded below by -outlier_clip)."""
    outlier_clip: float = 1.0
    """With outlier=clip: the lowest advantage an untrusted token may take."""
    top_k: int = 20
    """Teacher tokens of the forward-KL term (outliers and teacher-written prefix tokens)."""
    kl_coef: float = 1.0
    """Weight of the forward-KL term against the policy gradient."""
    prefix_share_start: float = 0.0
    """Off-policy guidance: share of the teacher's own response kept as a prefix the student
    continues from, at step 1 (0 disables it; the teacher then generates every step)."""
    prefix_share_end: float = 0.0
    """The prefix share reached after prefix_decay_steps steps (linear)."""
    prefix_decay_steps: int = 100
    """Steps over which the prefix share moves from prefix_share_start to prefix_share_end."""


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
    """On-policy distillation by a divergence between the teacher's and the student's next-token
    distributions at every position of the student's own samples, on the teacher's top_k ids
    plus a tail bucket (estimator topk_kd: GKD with lmbda = 1, NeMo-RL's distillation;
    docs/methods/divergences.md)."""

    kind: Literal["forward", "reverse", "mixed", "jsd", "skew_forward", "skew_reverse"] = "forward"
    """forward: KL(teacher || student), mode-covering; reverse: KL(student || teacher),
    mode-seeking; mixed: mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse (NeMo-RL
    kl_type); jsd: GKD's generalized Jensen-Shannon divergence with beta (TRL); skew_forward /
    skew_reverse: the KL to a mixture skewed by skew_lambda (ROLL, DistiLLM)."""
    top_k: int = 64
    """Teacher ids per position the distributions are compared on (64 in NeMo-RL's examples)."""
    tail: Literal["bucket", "renormalize"] = "bucket"
    """The mass outside the top_k ids: bucket (one more bucket in each distribution holding it,
    TRL's loss_add_tail) or renormalize (both distributions renormalised over the top_k ids,
    NeMo-RL's zero_outside_topk=false; then top_k must exceed 1)."""
    mixed_kl_weight: float = 0.5
    """kind=mixed: the forward KL's weight w, in [0, 1] (NeMo-RL's name; 0.5 in its examples)."""
    beta: float = 0.5
    """kind=jsd: the mixture weight beta, in [0, 1]; 0 is the forward KL, 1 the reverse KL (TRL's
    GKD convention and default)."""
    skew_lambda: float = 0.1
    """kind=skew_*: the mixture's skew lambda, in [0, 1); 0 is the plain KL (ROLL's default)."""
    coef: float = 1.0
    """Weight of the divergence term in the per-token loss (> 0)."""
    policy_gradient: Literal["none", "gndpo", "opd"] = "none"
    """The sampled-token policy gradient beside the divergence: none (the divergence alone, as
    GKD and NeMo-RL), gndpo (GNDPO's score whitened over the step batch, with kl_clip and the
    gndpo_* switches) or opd (the clamped score)."""


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """Importance-sampling correction of the policy gradient for the gap between the sampler's
    log-probs and the trainer's recomputation of them (docs/methods/offpolicy.md). The weight
    multiplies only the policy-gradient term; tokens it zeroes still count in the loss's token
    count."""

    correction: Literal["none", "tis", "mask"] = "none"
    """none: no weight (the trainer's old log-probs alone, as the GNDPO release); tis: truncated
    importance sampling, weight min(ratio, tis_cap); mask: ICE-POP-style masked importance
    sampling, weight ratio inside [mask_low, mask_high] and 0 outside. The ratio is
    exp(trainer log-prob - sampler log-prob) of the sampled tokens; it needs sampler log-probs of
    the unmodified distribution (rollout.temperature 1, top_p 1, top_k 0)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """What one ratio covers: token (each token its own), sequence (one per response: exp of the
    sum of its tokens' log-ratios, the product of their ratios) or geometric (one per response:
    exp of their mean, the geometric mean)."""
    tis_cap: float = 2.0
    """With correction=tis: the largest weight (>= 1)."""
    mask_low: float = 0.5
    """With correction=mask: ratios below this are rejected (in [0, 1])."""
    mask_high: float = 2.0
    """With correction=mask: ratios above this are rejected (>= 1)."""


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """Dynamic sampling: rollout rows dropped before the teacher and the student score them
    (docs/methods/filter.md). A dropped row stays in the batch as a one-token stub with no
    response tokens: it costs the scoring passes one token, adds nothing to the loss or to its
    token count, and keeps its reward in its prompt group's statistics. Every filter is off by
    default."""

    drop_truncated: bool = False
    """Drop responses cut at rollout.max_response_length without a stop token (DAPO's overlong
    filtering, TRL's mask_truncated_completions)."""
    min_response_tokens: int = 0
    """Drop responses with fewer tokens than this, the stop token not counted (1 drops empty
    responses, an immediate stop); 0 keeps every length."""
    drop_zero_variance_groups: bool = False
    """Drop whole prompt groups whose verifiable rewards are all equal, so that their
    group-relative advantage is 0 (DAPO's dynamic sampling, verl's filter_groups, without the
    refill: the step trains on fewer rows). Needs an estimator trained on the reward and
    rollout.samples_per_prompt >= 2."""

    @property
    def enabled(self) -> bool:
        """Whether any filter is on."""
        return self.drop_truncated or self.min_response_tokens > 0 or self.drop_zero_variance_groups


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The advantage estimator and policy loss (see ALGORITHMS.md in the docs)."""

    estimator: str = "gndpo"
    """Advantage estimator: the name of a method in megatron_gndpo.methods.METHODS (docs/methods/
    has a page for each)."""
    kl_clip: float = 5.0
    """Clamp C on the per-token score teacher_logp - student_logp (release default 5.0)."""
    policy_loss: str = "gspo"
    """Policy loss: gspo (token form, the release's), ppo_clip or is_pg (plain importance-sampled
    policy gradient)."""
    clip_low: float = 0.2
    """Lower clip range eps_low of the ratio."""
    clip_high: float = 0.2
    """Upper clip range eps_high of the ratio."""
    dual_clip: float | None = None
    """Dual-clip bound c (> 1) for negative advantages with ppo_clip; null disables it."""
    aggregation: str = "token-mean"
    """Loss aggregation over the global batch: token-mean or seq-mean-token-mean."""
    distill_estimator: str = "gndpo"
    """With estimator mix: the distillation part, a name in
    megatron_gndpo.methods.mix.DISTILL_PARTS."""
    outcome_estimator: str = "grpo"
    """With estimator mix: the outcome part, a name in megatron_gndpo.methods.mix.OUTCOME_PARTS."""
    outcome_weight: float = 0.0
    """With estimator mix: weight w in A = A_distill + w * A_outcome."""
    vopd_top_k: int = 100
    """vOPD: KL over the student's top-k tokens renormalised; 0 uses the full vocabulary."""
    gamma: float = 1.0
    """Discount of reinforce_pp returns."""
    gndpo_subtract_mean: bool = True
    """GNDPO: subtract the batch mean of the score; false keeps only the division by the batch's
    standard deviation (the "scale only" ablation, docs/methods/gndpo.md)."""
    gndpo_divide_std: bool = True
    """GNDPO: divide by the batch's standard deviation of the score; false keeps only the
    batch-mean baseline (the "baseline only" ablation, docs/methods/gndpo.md)."""
    teacher_stats: Literal["batch", "teacher"] = "batch"
    """With several teachers, the tokens GNDPO's mean and std are taken over: the whole step
    batch (batch, the paper's global normalisation), or each teacher's own rows (teacher: a
    teacher whose scores are larger or noisier no longer sets the scale of the others';
    docs/TEACHERS.md)."""
    entropy_coef: float | None = None
    """Entropy bonus beta: the loss subtracts beta * H_t of the student; null means the
    method's default (its class's ``default_entropy_coef``: 0.001 for tgpo, as its release; 0
    for the others)."""
    routing_replay: Literal["none", "rollout"] = "none"
    """MoE student: rollout (rollout routing replay, "R3"): the trainer's old log-probs and
    update use the experts the sampler chose for each token, so the ratio compares one policy;
    none: the trainer routes by itself (the share of choices that differ from the sampler's is
    logged as moe/routing_mismatch). Built-in engine only (docs/PARALLELISM.md, EP)."""
    tgpo: TGPOConfig = dataclasses.field(default_factory=TGPOConfig)
    """TGPO settings (estimator tgpo)."""
    tropd: TrOPDConfig = dataclasses.field(default_factory=TrOPDConfig)
    """TrOPD settings (estimator tropd)."""
    divergence: DivergenceConfig = dataclasses.field(default_factory=DivergenceConfig)
    """Divergence settings (estimator topk_kd)."""
    offpolicy: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)
    """Importance-sampling correction for the sampler/trainer log-prob gap (any estimator)."""
    filter: FilterConfig = dataclasses.field(default_factory=FilterConfig)
    """Rollout rows dropped before scoring (dynamic sampling; any estimator, all off)."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """megatron-core optimizer and learning-rate schedule."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (adam is AdamW: decoupled weight decay)."""
    lr: float = 1e-6
    """Peak learning rate (release default 1e-6)."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (the pre-clip norm is logged; a non-finite norm skips the step)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over the data-parallel group (megatron-core distributed optimizer)."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The outer loop."""

    steps: int = 100
    """Training steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of data order, sampling and initialisation."""
    micro_batch_size: int = 1
    """Sequences per forward/backward micro-batch."""
    optimizer_steps_per_rollout: int = 1
    """Optimizer steps per rollout batch (1 is strictly on-policy, as the release)."""
    eval_interval: int = 0
    """Evaluate every this many steps; 0 disables evaluation."""
    eval_samples: int = 0
    """Besides the greedy accuracy, sample this many answers per held-out prompt at temperature
    1 (the policy that trains) and log their mean accuracy (eval/sampled_accuracy) and the
    per-token reverse KL to the teacher on them (eval/reverse_kl); 0 evaluates greedily only."""
    scoring_token_budget: int = 16384
    """Tokens per forward-only micro-batch when the teacher and the student score a rollout."""
    pack_sequences: bool = False
    """Pack several rollouts into one row (block-diagonal attention) when scoring."""
    collective_timeout_s: float = 600.0
    """Seconds a collective (all-reduce, barrier, checkpoint exchange) waits for the other ranks
    before the job fails (torch.distributed's timeout, for every process group). Raise it when
    ranks legitimately drift apart for longer (very long rollouts, a slow checkpoint file
    system)."""
    heartbeat_timeout_s: float = 60.0
    """Every rank publishes a heartbeat (a background thread, through the rendezvous store); a
    rank not heard from for this many seconds (stopped, frozen, cut off) ends the job with an
    error naming it, instead of leaving the others waiting. 0 disables the watchdog; otherwise
    below collective_timeout_s."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompt data and tokenizer."""

    train: Annotated[str, PATH] = "builtin:arithmetic"
    """Training prompts: a JSONL/Parquet path, or builtin:NAME for a built-in task."""
    eval: Annotated[str | None, PATH] = None
    """Held-out prompts for evaluation (same formats); null disables evaluation data."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    answer_key: str = "answer"
    """Column holding the reference answer (for verifiable rewards and evaluation)."""
    answer_match: Literal["final", "first_sentence"] = "final"
    """How a response is checked against its reference answer (the verifiable reward and the
    evaluation's accuracy): final, the final answer it states (the last \\boxed{}, the text after
    "answer is", else its last number); first_sentence, a short answer (a word, a name) as a
    whole word or phrase of its first sentence, or a reference that is itself a sentence as the
    whole response (rewards/short_answer.py), so rambling on never earns the reward."""
    tokenizer: Annotated[str | None, PATH] = None
    """SentencePiece model file or Hugging Face tokenizer directory; null for the built-in
    task's tokenizer."""
    vocab_size: int | None = None
    """Token ids the tokenizer can produce. Both models' distributions are restricted to these ids
    (embedding rows beyond them take no probability mass), so a student and a teacher of one
    tokenizer family with differently padded embeddings (Qwen2.5-1.5B: 151936 rows, 7B: 152064)
    score the same support. null means model.vocab_size."""
    shuffle: bool = True
    """Shuffle prompts each epoch."""
    outlier_train: Annotated[str | None, PATH] = None
    """Prompts the outlier steps (rollout.outlier_interval) draw instead of data.train, e.g.
    harder or out-of-distribution ones (same formats); null: they draw data.train."""
    image_key: str = "images"
    """With a vision model: the column holding each prompt's image(s) (a path, bytes, or a list
    of them); the prompt text marks where each image goes with <image>."""
    teacher_key: str = "data_source"
    """With several teachers (teachers:): the prompt field that names each row's teacher (one of
    a teacher's name or sources); a prompt without it goes to data.default_teacher."""
    default_teacher: str | None = None
    """With several teachers: the teacher of prompts without data.teacher_key; null means the
    first one listed."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming (megatron-core dist-checkpointing)."""

    save: Annotated[str | None, PATH] = None
    """Directory for checkpoints; null means RUN_DIR/checkpoints."""
    load: Annotated[str | None, PATH] = None
    """Checkpoint to resume from; null resumes from the save directory when it holds one."""
    init: Annotated[str | None, PATH] = None
    """Model-only checkpoint (e.g. converted from Hugging Face) to initialise the student from
    when not resuming; null builds it randomly (tests, the demo)."""
    save_interval: int = 0
    """Save every this many steps; 0 saves only at the end."""
    keep_last: int = 2
    """Older checkpoints of this run beyond this many are deleted after a successful save
    (another run's are never deleted)."""
    start_fresh: bool = False
    """Start at step 1 although the save directory holds checkpoints: its iterations, latest and
    the run's metrics.jsonl are first moved into SAVE/previous-<time>/ (nothing is deleted).
    false resumes from the save directory's latest, and refuses to start over in a directory
    that holds iterations but no latest."""
    verify: bool = True
    """Check every file of a checkpoint against the checksums saved with it before loading it
    (resume, checkpoint.init, teacher.load); a damaged newest step is then set aside for the
    newest intact one. false skips the extra read, and with it that protection: damaged bytes
    that still read as finite numbers load without a word (non-finite ones are still caught)."""


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where metrics and the resolved config go."""

    run_dir: Annotated[str, PATH] = "runs/gndpo"
    """Run directory: resolved config, metrics JSONL, plots."""
    log_interval: int = 1
    """Print metrics every this many steps."""
    wandb_project: str | None = None
    """Weights & Biases project; null disables W&B."""
    wandb_run_name: str | None = None
    """Weights & Biases run name; null lets W&B choose."""
    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard."""


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole GNDPO run: the student, its teacher, and how they are trained."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The student's architecture."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The student's parallel layout."""
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """The frozen teacher."""
    teachers: tuple[NamedTeacherConfig, ...] = ()
    """Several frozen teachers, each prompt scored by the one data.teacher_key names
    (docs/TEACHERS.md); empty: the one teacher of the teacher section."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Sampling."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Advantage estimator and loss."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """The outer loop."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Logging."""


def teacher_sections(cfg: Config) -> list[tuple[str, TeacherConfig]]:
    """Every teacher of ``cfg`` with the config key of its section (for messages): the
    ``teachers`` list when set, else the one ``teacher``. A teacher with the student's weights
    (``weights`` other than load) has the student's architecture: its ``model`` is ``model``."""
    sections = (
        [(f"teachers[{i}]", t) for i, t in enumerate(cfg.teachers)]
        if cfg.teachers
        else [("teacher", cfg.teacher)]
    )
    return [
        (key, t if t.weights == "load" else dataclasses.replace(t, model=cfg.model))
        for key, t in sections
    ]
