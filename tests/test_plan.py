"""``plan``'s arithmetic: real model sizes, shards that add up, stages that cover; memory and
step-time estimates against the H200 measurement in docs/DESIGN.md.

Pure arithmetic, no processes. The sharded counts are checked against the unsharded total plus
exactly what sharding duplicates: per-layer norms (and qk-norms and row-parallel biases), the
final norm and learned position embeddings are replicated on every TP rank; the vocabulary is
padded; a tied output layer is a second copy of the embedding on the last stage when PP > 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from megatron_gndpo.checks import validate
from megatron_gndpo.cli import main
from megatron_gndpo.config import Config, ModelConfig, ParallelConfig, load_config
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.logging.throughput import model_flops_per_token
from megatron_gndpo.parallel.groups import ParallelLayout
from megatron_gndpo.plan import (
    GIB,
    LOGPROB_CHUNK_TOKENS,
    Hardware,
    activation_bytes_per_token,
    estimate_memory,
    estimate_step_time,
    fit_warnings,
    layer_params,
    plan,
    plan_model,
    rank_split,
    sequence_length,
    stage_params,
    total_params,
    valid_rollout_ranks,
)
from megatron_gndpo.plan.disaggregated import (
    best_rollout_ranks,
    estimate_disaggregated_step_time,
    estimate_rollout_memory,
    format_rollout_memory,
    with_rollout_ranks,
)
from megatron_gndpo.weight_sync import DEFAULT_BUCKET_BYTES

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> Config:
    return load_config(EXAMPLES_DIR / name)


# Published parameter counts (Hugging Face safetensors metadata of each model).
KNOWN_TOTALS = [
    ("qwen2.5-1.5b_from_7b.yaml", "student", 1_543_714_304),  # Qwen2.5-1.5B, tied embeddings
    ("qwen2.5-1.5b_from_7b.yaml", "teacher", 7_615_616_512),  # Qwen2.5-7B
    ("llama3.1-8b_from_70b.yaml", "student", 8_030_261_248),  # Llama-3.1-8B
]


def model_of(cfg: Config, who: str) -> ModelConfig:
    return cfg.model if who == "student" else cfg.teacher.model


@pytest.mark.parametrize(("name", "who", "expected"), KNOWN_TOTALS)
def test_known_real_parameter_totals(name: str, who: str, expected: int) -> None:
    assert total_params(model_of(example(name), who)) == expected


def test_plan_reports_the_totals() -> None:
    cfg = example("qwen2.5-1.5b_from_7b.yaml")
    student, teacher = plan(cfg, 8)
    assert (student.name, student.total_params) == ("student", 1_543_714_304)
    assert (teacher.name, teacher.total_params) == ("teacher", 7_615_616_512)


def _norm(model: ModelConfig, width: int) -> int:
    return width * (2 if model.normalization == "LayerNorm" else 1)


def replicated_per_tp_rank(model: ModelConfig) -> int:
    """Parameters every TP rank holds in full (not split), summed over the whole model."""
    h = model.hidden_size
    per_layer = 2 * _norm(model, h)  # input and pre-MLP norms
    if model.qk_layernorm:
        per_layer += 2 * _norm(model, model.head_dim)
    if model.add_bias_linear:
        per_layer += 2 * h  # biases of the row-parallel projection and fc2
    out = model.num_layers * per_layer + _norm(model, h)  # + final norm
    out += sum(model.moe_layers) * (model.num_experts or 0) * h  # MoE routers
    if model.position_embedding == "learned_absolute":
        out += model.max_position_embeddings * h
    return out


def expected_shard_sum(model: ModelConfig, tp: int, pp: int) -> int:
    """Sum of params_per_rank over one TP group of every stage."""
    h, vocab, padded = model.hidden_size, model.vocab_size, model.padded_vocab_size(tp)
    vocab_copies = 1 if model.tie_embeddings and pp == 1 else 2  # embedding (+ output layer)
    vocab_unique = 1 if model.tie_embeddings else 2
    return (
        total_params(model)
        + (tp - 1) * replicated_per_tp_rank(model)
        + vocab_copies * padded * h
        - vocab_unique * vocab * h
    )


def _variants() -> list[tuple[str, ModelConfig]]:
    out = []
    for path in sorted(EXAMPLES_DIR.glob("*.yaml")):
        cfg = load_config(path)
        out += [(f"{path.stem}:student", cfg.model), (f"{path.stem}:teacher", cfg.teacher.model)]
    tiny = dataclasses.replace(load_config(EXAMPLES_DIR / "tiny_cpu.yaml").model, num_layers=4)
    layernorm = dataclasses.replace(
        tiny, normalization="LayerNorm", add_bias_linear=True, swiglu=False
    )
    learned = dataclasses.replace(
        tiny, position_embedding="learned_absolute", tie_embeddings=True, vocab_size=100
    )
    qk_norm = dataclasses.replace(tiny, qk_layernorm=True, add_qkv_bias=True, kv_channels=32)
    out += [("tiny:layernorm-biases", layernorm), ("tiny:learned-positions-tied", learned)]
    out += [("tiny:qk-norm-qkv-bias", qk_norm)]
    return out


VARIANTS = _variants()
SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
CASES = [
    pytest.param(model, tp, pp, id=f"{label}-tp{tp}-pp{pp}")
    for label, model in VARIANTS
    for tp, pp in SHAPES
    if model.num_attention_heads % tp == 0
    and model.query_groups % tp == 0
    and model.num_layers % pp == 0
]


@pytest.mark.parametrize(("model", "tp", "pp"), CASES)
def test_shards_sum_to_the_total_plus_what_is_replicated(
    model: ModelConfig, tp: int, pp: int
) -> None:
    world = tp * pp * 2  # DP=2: replicas hold the same shards and must not be counted twice
    mp = plan_model("m", model, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), world)
    assert len(mp.stages) == pp
    assert sum(st.params_per_rank for st in mp.stages) * tp == expected_shard_sum(model, tp, pp)
    # Layers are split evenly, so only the stages with the embedding/output layer differ (an
    # MoE model's layers count their router and, at EP=1, all their experts).
    per = model.num_layers // pp
    kinds = model.moe_layers if model.is_moe else (False,) * model.num_layers
    for s, st in enumerate(mp.stages[1:-1], start=1):
        layers = kinds[s * per : (s + 1) * per]
        assert st.params_per_rank == sum(layer_params(model, tp, moe=k) for k in layers)


def test_tp1_pp1_unpadded_stage_is_the_total() -> None:
    for _, model in VARIANTS:
        unpadded = dataclasses.replace(model, make_vocab_size_divisible_by=1)
        layout = plan_model("m", unpadded, ParallelConfig(), 1).layout
        assert stage_params(unpadded, layout, 0) == total_params(model)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("vocab", [1, 127, 128, 151_665, 151_936, 152_064, 128_256])
@pytest.mark.parametrize("divisible_by", [1, 64, 128])
def test_padded_vocab_is_the_smallest_multiple(tp: int, vocab: int, divisible_by: int) -> None:
    model = ModelConfig(vocab_size=vocab, make_vocab_size_divisible_by=divisible_by)
    padded = model.padded_vocab_size(tp)
    multiple = divisible_by * tp
    assert padded % multiple == 0
    assert vocab <= padded < vocab + multiple


def test_plan_pads_each_models_vocab_for_its_own_tp() -> None:
    cfg = example("qwen2.5-1.5b_from_7b.yaml")  # student TP=1, teacher TP=2
    student, teacher = plan(cfg, 8)
    assert student.padded_vocab == 151_936  # already a multiple of 128
    assert teacher.padded_vocab == 152_064  # a multiple of 256
    llama = example("llama3.1-8b_from_70b.yaml")  # 128256 rows: TP=4 -> 512, TP=8 -> 1024
    student, teacher = plan(llama, 64)
    assert student.padded_vocab == 128_512
    assert teacher.padded_vocab == 129_024


@pytest.mark.parametrize(
    ("world", "tp", "pp", "cp"),
    [(1, 1, 1, 1), (8, 2, 2, 1), (16, 2, 4, 2), (64, 8, 2, 1), (256, 8, 4, 1), (32, 1, 8, 4)],
)
def test_stage_ranks_partition_the_world(world: int, tp: int, pp: int, cp: int) -> None:
    model = ModelConfig(num_layers=16, num_attention_heads=8, hidden_size=64)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp)
    mp = plan_model("m", model, parallel, world)
    all_ranks = [r for st in mp.stages for r in st.ranks]
    assert sorted(all_ranks) == list(range(world))  # every rank in exactly one stage
    for st in mp.stages:
        assert len(st.ranks) == world // pp
        assert all(mp.layout.coords(r)["pp"] == st.stage for r in st.ranks)
    # Layers: contiguous, in order, covering 0..L-1.
    layers = [i for st in mp.stages for i in range(st.first_layer, st.last_layer + 1)]
    assert layers == list(range(model.num_layers))


def test_tied_embedding_is_copied_to_the_last_stage() -> None:
    tiny = load_config(EXAMPLES_DIR / "tiny_cpu.yaml").model
    tied = dataclasses.replace(tiny, tie_embeddings=True)
    untied = dataclasses.replace(tiny, tie_embeddings=False)
    vocab_shard = tiny.padded_vocab_size(1) * tiny.hidden_size
    one = plan_model("m", tied, ParallelConfig(), 1).stages
    assert total_params(untied) - total_params(tied) == tiny.vocab_size * tiny.hidden_size
    assert (
        one[0].params_per_rank
        == plan_model("m", untied, ParallelConfig(), 1).stages[0].params_per_rank - vocab_shard
    )
    two_tied = plan_model("m", tied, ParallelConfig(pipeline_parallel=2), 2).stages
    two_untied = plan_model("m", untied, ParallelConfig(pipeline_parallel=2), 2).stages
    assert [s.params_per_rank for s in two_tied] == [s.params_per_rank for s in two_untied]


# ---------------------------------------------------------------------------------------------
# Memory and step time


def design_benchmark_config(core_attention: str) -> Config:
    """The shape of docs/DESIGN.md's H200 table: Qwen2.5-1.5B with untied embeddings (1.78B
    params), bf16, one rank (TP=PP=DP=1), one micro-batch of one 4096-token row."""
    overrides = [
        "model.tie_embeddings=false",
        f"model.core_attention={core_attention}",
        "rollout.max_prompt_length=1024",
        "rollout.max_response_length=3072",
        "rollout.prompts_per_step=1",
        "rollout.samples_per_prompt=1",
        "trainer.micro_batch_size=1",
        "teacher.parallel.tensor_parallel=1",
    ]
    return validate(load_config(EXAMPLES_DIR / "qwen2.5-1.5b_from_7b.yaml", overrides), 1)


@pytest.mark.parametrize(
    ("core_attention", "measured_gib"),
    [("sdpa", 19.0), ("local", 51.5)],  # docs/DESIGN.md, megatron-core GPTModel rows
)
def test_memory_estimate_within_25_percent_of_the_h200_measurement(
    core_attention: str, measured_gib: float
) -> None:
    """Planner vs docs/DESIGN.md's measured peak (torch.cuda.max_memory_allocated) on one H200.

    Measured: megatron-core GPTModel, local spec, bf16, 1.78B params (Qwen2.5-1.5B shape, untied),
    seq 4096, micro-batch 1, forward + backward, no optimizer: 19.0 GiB with the SDPA core
    attention, 51.5 GiB with megatron's local attention. The benchmark's model is not wrapped in
    DDP, so its gradients are bf16 ``.grad`` (the size of the weights), not the trainer's fp32
    main-grad buffer, and it has no optimizer state. The matching estimate is therefore
    weights + weights (bf16 grads) + the training phase (activations of one micro-batch and the
    log-prob head). It gives 17.0 GiB (-10%) and 43.3 GiB (-16%).
    """
    cfg = design_benchmark_config(core_attention)
    assert total_params(cfg.model) == 1_777_088_000  # "1.78B params untied"
    assert sequence_length(cfg) == 4096
    (rank,) = estimate_memory(cfg, 1)
    estimate_gib = (2 * rank.weights + rank.training) / GIB
    assert abs(estimate_gib - measured_gib) <= 0.25 * measured_gib, estimate_gib


def test_activation_formula_reduces_to_korthikanti() -> None:
    """For a GPT-3-style layer (MHA, 4h GELU MLP, local attention) the per-token bytes are the
    paper's ``h·(10 + 24/t) + 5·a·s/t`` (``h·34/t + 5as/t`` with sequence parallelism) minus its
    two dropout masks (2h bytes), since our layers have no dropout."""
    a, h, s = 16, 1024, 2048
    gpt3 = ModelConfig(
        hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h, swiglu=False,
        core_attention="local", params_dtype="bf16",
    )  # fmt: skip
    for t in (1, 2, 4, 8):
        plain = activation_bytes_per_token(gpt3, t, sequence_parallel=False, seq_len=s)
        assert plain == pytest.approx(h * (10 + 24 / t) + 5 * a * s / t - 2 * h)
        sp = activation_bytes_per_token(gpt3, t, sequence_parallel=True, seq_len=s)
        assert sp == pytest.approx((34 * h + 5 * a * s) / t - 2 * h / t)


def test_logprob_chunk_is_the_trainers() -> None:
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    default = {f.name: f.default for f in dataclasses.fields(TokenLogProbs)}["chunk_tokens"]
    assert default == LOGPROB_CHUNK_TOKENS


def test_llama_8b_from_70b_recipe_fits_an_h100() -> None:
    cfg = example("llama3.1-8b_from_70b.yaml")
    rows = estimate_memory(cfg, 64)
    assert {(r.stage, r.teacher_stage) for r in rows} == {(0, 0), (0, 1)}  # teacher PP=2
    assert fit_warnings(rows, Hardware()) == []
    assert max(r.peak for r in rows) < Hardware().usable_bytes


def test_a_70b_teacher_on_one_gpu_warns() -> None:
    cfg = load_config(
        EXAMPLES_DIR / "llama3.1-8b_from_70b.yaml",
        ["teacher.parallel.tensor_parallel=1", "teacher.parallel.pipeline_parallel=1"],
    )
    rows = estimate_memory(cfg, 64)
    assert rows[0].teacher_weights / GIB > 130  # 70.6B params in bf16 on every rank
    (warning,) = fit_warnings(rows, Hardware())
    assert warning.startswith("WARNING: ")
    assert "largest part is teacher" in warning
    assert "teacher.parallel.tensor_parallel" in warning


def test_plan_command_prints_the_memory_table_and_the_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "-c", str(EXAMPLES_DIR / "llama3.1-8b_from_70b.yaml"), "-n", "64"]
    assert (
        main([*argv, "teacher.parallel.tensor_parallel=1", "teacher.parallel.pipeline_parallel=1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "memory per rank, GiB (80 GiB GPU, 72.0 usable" in out
    assert sum(line.startswith("WARNING: ") for line in out.splitlines()) == 1
    assert main([*argv, "--gpu-memory-gib", "141", "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "every rank fits" in out and "WARNING" not in out
    assert "(141 GiB GPU, 126.9 usable" in out
    assert "step time at MFU 0.5 of 989 TFLOP/s per GPU on 64 GPUs" in out


def test_step_time_is_model_flops_at_the_mfu() -> None:
    """Training is 6N per token, scoring 2N for the teacher plus 2N for the student, generation
    2N, at mfu × peak on every GPU; the decode floor reads weights + KV per generated token."""
    cfg = example("qwen3-8b_from_32b.yaml")
    hw = Hardware(mfu=0.5)
    st = estimate_step_time(cfg, 32, hw)
    seq = sequence_length(cfg)
    assert st.tokens == 512 * seq
    rate = 32 * hw.peak_flops * hw.mfu
    fwd = model_flops_per_token(cfg.model, seq, training=False)
    teacher_fwd = model_flops_per_token(cfg.teacher.model, seq, training=False)
    assert st.training_s == pytest.approx(3 * fwd * st.tokens / rate)
    assert st.scoring_s == pytest.approx((fwd + teacher_fwd) * st.tokens / rate)
    assert st.generation_flops_s == pytest.approx(fwd * st.tokens / rate)
    assert st.total_s == pytest.approx(st.rollout_s + st.scoring_s + st.training_s)
    assert st.rollout_s == max(st.generation_flops_s, st.decode_floor_s)
    # Twice the GPUs (same layout, twice the DP) halves every FLOP-bound phase.
    assert estimate_step_time(cfg, 64, hw).training_s == pytest.approx(st.training_s / 2)


def test_memory_parts_follow_the_layout() -> None:
    """Doubling DP shards the optimizer further and leaves weights and gradients alone; the
    distributed optimizer off keeps the whole state on every rank."""
    cfg = example("qwen3-8b_from_32b.yaml")
    (r32, _), (r64, _) = estimate_memory(cfg, 32), estimate_memory(cfg, 64)
    assert (r64.weights, r64.grads) == (r32.weights, r32.grads)
    assert r64.optimizer == pytest.approx(r32.optimizer / 2)
    assert r32.grads == 2 * r32.weights  # fp32 main grads beside bf16 weights
    assert r32.optimizer == pytest.approx(6 * r32.weights / 8)  # 12 bytes/param over DP=8
    whole = load_config(
        EXAMPLES_DIR / "qwen3-8b_from_32b.yaml", ["optimizer.use_distributed_optimizer=false"]
    )
    assert estimate_memory(whole, 32)[0].optimizer == pytest.approx(6 * r32.weights)


# The memory arithmetic in each recipe's header comment; tiny_cpu.yaml has none.
PEAK_LINE = re.compile(r"peak per GPU: ([\d.]+) GiB \(persistent ([\d.]+) \+ (\w+) ([\d.]+)\)")
FIX_LINE = re.compile(r"With ((?:[\w.]+=\S+ )+)the peak is ([\d.]+) GiB")
STEP_LINE = re.compile(r"step (\d+) s\.")
RECIPES = [("qwen2.5-1.5b_from_7b.yaml", 8), ("qwen3-8b_from_32b.yaml", 32),
           ("llama3.1-8b_from_70b.yaml", 64), ("qwen3-8b_from_30b_a3b.yaml", 32)]  # fmt: skip


def _comment(name: str) -> str:
    lines = (EXAMPLES_DIR / name).read_text().splitlines()
    return " ".join(
        line.lstrip("# ") for line in itertools.takewhile(lambda x: x.startswith("#"), lines)
    )


@pytest.mark.parametrize(("name", "world"), RECIPES)
def test_recipe_comments_match_the_planner(name: str, world: int) -> None:
    """Each recipe's comment block states the planner's peak, its parts and the step time; they
    must stay within 2% of what ``plan`` prints for the recipe at its world size."""
    text = _comment(name)
    peak_match = PEAK_LINE.search(text)
    assert peak_match, f"{name}: no 'peak per GPU' line in the header comment"
    cfg = example(name)
    worst = max(estimate_memory(cfg, world), key=lambda r: r.peak)
    peak, persistent, phase, phase_gib = peak_match.groups()
    assert float(peak) == pytest.approx(worst.peak / GIB, rel=0.02)
    assert float(persistent) == pytest.approx(worst.persistent / GIB, rel=0.02)
    assert (phase, float(phase_gib)) == (
        worst.peak_phase,
        pytest.approx(worst.phases[phase] / GIB, rel=0.02),
    )
    fits = worst.peak <= Hardware().usable_bytes
    assert ("DOES NOT FIT" not in text) == fits
    fix = FIX_LINE.search(text)
    assert (fix is not None) == (not fits), f"{name}: a recipe that does not fit names a fix"
    if fix is not None:
        fixed = load_config(EXAMPLES_DIR / name, fix[1].split())
        fixed_peak = max(r.peak for r in estimate_memory(fixed, world))
        assert fixed_peak <= Hardware().usable_bytes
        assert float(fix[2]) == pytest.approx(fixed_peak / GIB, rel=0.02)
    step = STEP_LINE.search(text)
    assert step, f"{name}: no step time in the header comment"
    assert float(step[1]) == pytest.approx(estimate_step_time(cfg, world).total_s, rel=0.02)


# --- rollout.disaggregate: rollout ranks apart -------------------------------------------------
# qwen3-8b_from_32b: student TP=4, teacher TP=4 x PP=2 (8 ranks a replica), 32 prompts x 16.


def disaggregated(world_ranks: int, tp: int, staleness: int = 0) -> Config:
    cfg = example("qwen3-8b_from_32b.yaml")
    d = dataclasses.replace(
        cfg.rollout.disaggregate, ranks=world_ranks, tensor_parallel=tp, staleness=staleness
    )
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, disaggregate=d))


@pytest.mark.parametrize(
    ("world", "ranks", "tp", "trainer", "replicas", "trainer_dp", "blocks"),
    [
        (64, 32, 4, 32, 8, 8, 1),  # one trainer replica per rollout replica
        (32, 16, 2, 16, 8, 4, 1),  # more rollout replicas than trainer replicas: 4 idle
        (64, 8, 4, 56, 2, 14, 7),  # 14 trainer replicas on 2 rollout replicas: ceil(14/2)
        (64, 0, 1, 64, 0, 16, 1),  # colocated
    ],
)
def test_rank_split(
    world: int, ranks: int, tp: int, trainer: int, replicas: int, trainer_dp: int, blocks: int
) -> None:
    cfg = disaggregated(ranks, tp)
    split = rank_split(cfg, world)
    assert (split.trainer_ranks, split.rollout_ranks) == (trainer, ranks)
    assert (split.rollout_replicas, split.trainer_dp) == (replicas, trainer_dp)
    assert split.blocks_per_replica == blocks
    student, teacher = plan(cfg, world)
    assert teacher is not None
    assert student.layout.world_size == teacher.layout.world_size == trainer


def test_rank_split_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"ranks \(64\) leaves no rank of the 64 to train"):
        rank_split(disaggregated(64, 4), 64)
    with pytest.raises(ConfigError, match=r"tensor_parallel \(4\) must divide .*ranks \(6\)"):
        rank_split(disaggregated(6, 4), 64)
    # 64 - 4 = 60 trainer ranks: the teacher's TP=4 x PP=2 does not divide them
    with pytest.raises(ConfigError) as err:
        estimate_memory(disaggregated(4, 4), 64)
    assert "the trainer's 60 ranks (64 - rollout.disaggregate.ranks 4)" in str(err.value)
    assert "teacher.parallel:" in str(err.value)
    assert "set rollout.disaggregate.ranks to one of [32, 48, 56]" in str(err.value)


def test_valid_rollout_ranks_keep_layouts_and_prompts_whole() -> None:
    # R a multiple of 4; T = 64 - R a multiple of 8 (teacher); 32 prompts split over T / 4
    assert valid_rollout_ranks(disaggregated(32, 4), 64) == [32, 48, 56]
    # rollout TP=8: the same, 8 | R
    assert valid_rollout_ranks(disaggregated(32, 8), 64) == [32, 48, 56]


def test_disaggregated_memory_rows() -> None:
    cfg = disaggregated(32, 4)
    model, seq = cfg.model, sequence_length(cfg)
    assert seq == 2048 + 16384
    mem = estimate_rollout_memory(cfg, 64)
    assert mem is not None
    assert mem.rows == 512 // 8  # one trainer replica's block (DP=8 on 32 trainer ranks)
    shard = stage_params(model, ParallelLayout(world_size=4, tp=4), 0)
    assert mem.weights == shard * 2
    assert mem.kv_cache == 64 * seq * 36 * 2 * (8 // 4) * 128 * 2
    per_token = activation_bytes_per_token(model, 4, sequence_parallel=False, seq_len=seq)
    assert mem.prefill == per_token * 64 * 2048
    assert mem.staging == DEFAULT_BUCKET_BYTES  # one bucket of the broadcast, not the student
    assert mem.peak == mem.weights + mem.kv_cache + mem.prefill + mem.staging
    assert mem.peak / GIB == pytest.approx(52.0, abs=0.05)
    # the trainer ranks: the colocated estimate on 32 ranks, without a rollout phase
    trainer = estimate_memory(cfg, 64)
    colocated_32 = estimate_memory(example("qwen3-8b_from_32b.yaml"), 32)
    for got, want in zip(trainer, colocated_32, strict=True):
        assert got.rollout == 0.0
        assert dataclasses.replace(got, rollout=want.rollout) == want
    assert estimate_rollout_memory(disaggregated(0, 1), 64) is None


def test_disaggregated_memory_with_vllm_rollout_ranks() -> None:
    """rollout.engine=vllm on the rollout ranks: vLLM's share of the GPU holds the shard and
    the KV cache, and the weights arrive a bucket at a time, as for the built-in copy."""
    base = disaggregated(32, 4)
    cfg = dataclasses.replace(
        base, rollout=dataclasses.replace(base.rollout, engine="vllm", gpu_memory_utilization=0.5)
    )
    hw = Hardware(gpu_memory_gib=80.0)
    mem = estimate_rollout_memory(cfg, 64, hw)
    builtin = estimate_rollout_memory(base, 64, hw)
    assert mem is not None and builtin is not None and mem.engine == "vllm"
    assert mem.weights == builtin.weights and mem.prefill == 0.0
    assert mem.weights + mem.kv_cache == 0.5 * 80 * GIB
    assert mem.staging == DEFAULT_BUCKET_BYTES == builtin.staging
    text = format_rollout_memory(cfg, 64, hw)
    assert "vLLM; GiB per rank" in text and "a bucket at a time" in text
    assert "WARNING" not in text
    # a share smaller than the shard, and a share above the usable memory: each says its fix
    tiny = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.01)
    )
    assert "raise rollout.gpu_memory_utilization" in format_rollout_memory(tiny, 64, hw)
    full = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.99)
    )
    assert "lower rollout.gpu_memory_utilization" in format_rollout_memory(full, 64, hw)


def test_disaggregated_step_formulas() -> None:
    hw = Hardware()
    sync = estimate_disaggregated_step_time(disaggregated(32, 4, staleness=0), 64, hw)
    off = estimate_disaggregated_step_time(disaggregated(32, 4, staleness=1), 64, hw)
    assert sync is not None and off is not None
    cfg = example("qwen3-8b_from_32b.yaml")
    model, seq = cfg.model, sequence_length(cfg)
    weights = total_params(model) * 2
    # the busiest rollout replica: 64 rows at TP=4 on its 4 GPUs
    fwd = model_flops_per_token(model, seq, training=False)
    assert sync.generation_flops_s == pytest.approx(fwd * 64 * seq / (4 * hw.peak_flops * hw.mfu))
    kv_mean = 64 * (2048 + 16384 / 2) * 36 * 2 * 8 * 128 * 2  # all KV heads, half-full cache
    assert sync.decode_floor_s == pytest.approx(16384 * (weights + kv_mean) / 4 / 3.35e12)
    assert sync.rollout_s == sync.decode_floor_s  # decode is memory-bound
    on_32 = estimate_step_time(cfg, 32, hw)  # scoring and training on the 32 trainer ranks
    assert sync.trainer_s == pytest.approx(on_32.scoring_s + on_32.training_s)
    assert sync.broadcast_s == pytest.approx(weights / 25e9)
    # staleness 0: the sides take turns; 1: they overlap
    assert sync.total_s == pytest.approx(sync.rollout_s + sync.broadcast_s + sync.trainer_s)
    assert off.total_s == pytest.approx(max(off.rollout_s, off.trainer_s + off.broadcast_s))
    assert (round(sync.total_s, 1), round(off.total_s, 1)) == (279.9, 141.7)
    assert estimate_step_time(cfg, 64, hw).total_s == pytest.approx(149.6, abs=0.05)
    assert estimate_disaggregated_step_time(disaggregated(0, 1), 64, hw) is None


def test_best_rollout_ranks() -> None:
    hw = Hardware()
    cfg = disaggregated(48, 4, staleness=1)
    steps = {
        r: estimate_disaggregated_step_time(with_rollout_ranks(cfg, r), 64, hw)
        for r in (32, 48, 56)
    }
    totals = {r: st.total_s for r, st in steps.items() if st is not None}
    assert min(totals, key=totals.__getitem__) == 32
    best = best_rollout_ranks(cfg, 64, hw)
    assert best is not None and best.split.rollout_ranks == 32
    assert best.total_s == totals[32]
    # on a 2 TB GPU every R fits: still 32 (the trainer side dominates at R = 48 and 56)
    best_big = best_rollout_ranks(cfg, 64, Hardware(gpu_memory_gib=2048))
    assert best_big is not None and best_big.split.rollout_ranks == 32


def test_plan_command_prints_the_disaggregated_step(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "-c", str(EXAMPLES_DIR / "qwen3-8b_from_32b.yaml"), "-n", "64"]
    argv += ["rollout.disaggregate.ranks=32", "rollout.disaggregate.tensor_parallel=4"]
    assert main([*argv, "rollout.disaggregate.staleness=1"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-31 train (the layouts below cover them), ranks 32-63 only generate" in out
    assert "student: TP=4 PP=1 CP=1 DP=8 (world 32)" in out
    assert "rollout ranks 32-63: 8 replica(s) of TP=4" in out
    assert "step         141.7 s  = max(rollout, scoring + training + broadcast)" in out
    assert "colocated on all 64 ranks: 149.6 s per step; colocated / disaggregated = 1.06" in out
    assert "verdict: disaggregated 1-step-off is 1.06x faster than colocated; R = 32 is" in out
    # R = 48, synchronous: 128 rows per rollout replica do not fit, and the sides take turns
    assert main([*argv[:-2], "rollout.disaggregate.ranks=48", argv[-1]]) == 0
    out = capsys.readouterr().out
    assert "WARNING: rollout ranks need 99.7 GiB" in out
    assert (
        "verdict: disaggregated synchronous is 3.60x slower than colocated: with staleness 0 the "
        "two sides take turns, each idle while the other works; "
        "rollout.disaggregate.staleness=1 would overlap them (282.8 s per step); "
        "try rollout.disaggregate.ranks=32 (279.9 s per step: rollout 138.2 s, trainer 141.7 s "
        "with the broadcast)"
    ) in out


def test_plan_command_reports_a_bad_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "-c", str(EXAMPLES_DIR / "qwen3-8b_from_32b.yaml"), "-n", "64"]
    assert main([*argv, "rollout.disaggregate.ranks=64"]) == 2
    assert "rollout.disaggregate.ranks (64) leaves no rank of the 64" in capsys.readouterr().err
