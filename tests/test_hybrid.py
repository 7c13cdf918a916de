"""``model.model_class: hybrid``: megatron-core's HybridModel with GPTModel's own layers.

The names both classes give the same parameters (``models/naming.py``); then, in one process,
the same weights give the same logits and log-probs (fp32, dense and MoE), a GPTModel
checkpoint loads as a hybrid teacher (both checkpoint layer formats) and the reverse is refused
naming the fix, the lean decoder and megatron's static path sample on a HybridModel what they
sample on the GPTModel, and a Hugging Face model goes through a hybrid checkpoint and back
unchanged. The same class at TP=2, PP=2 and EP=2, in the launches of other tests:
``test_weight_sync`` (sync into an engine, generation, scoring), ``test_trainer`` (training
from a GPTModel checkpoint at TP=2 and PP=2 with the GPTModel's losses; a resume with the
optimizer state continuing the GPTModel run exactly), ``test_moe`` (a teacher at EP=2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.models import naming
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 90
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
# Qwen3-like (q/k norms, untied) and Qwen3-MoE-like with a dense second layer (checkpointed in
# megatron's per-layer format; the dense model in its homogeneous one)
MODELS = {
    "dense": tiny_model(vocab_size=VOCAB, qk_layernorm=True),
    "moe": tiny_model(
        vocab_size=VOCAB, qk_layernorm=True, num_experts=4, moe_ffn_hidden_size=32,
        moe_layer_pattern=(1, 0), moe_router_pre_softmax=True,
    ),
}  # fmt: skip


def _hybrid(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, model_class="hybrid")


# ---------------------------------------------------------------------------------------------
# Names


GPT_NAMES = [
    "embedding.word_embeddings.weight",
    "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",  # TE's fused norm
    "decoder.layers.0.self_attention.q_layernorm.weight",
    "decoder.layers.3.pre_mlp_layernorm.weight",
    "decoder.layers.3.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.3.mlp.router.weight",
    "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
    "language_model.decoder.layers.1.mlp.linear_fc2.weight",  # prefixes pass through
    "optimizer.state.exp_avg.decoder.layers.2.self_attention.linear_proj.weight",
]


def test_one_name_mapping_both_ways() -> None:
    assert naming.hybrid_pattern([False, False]) == "*-*-"
    assert naming.hybrid_pattern([True, False, True, True], 2) == "*E*-|*E*E"
    assert naming.hybrid_moe_layers([True, False]) == [0, 1, 0, 0]
    with pytest.raises(naming.NamingError, match="3 layers do not split evenly over 2"):
        naming.hybrid_pattern([False] * 3, 2)
    hybrid = [naming.to_hybrid(n) for n in GPT_NAMES]
    assert hybrid[1:5] == GPT_NAMES[1:5]  # GPT layer 0's attention is hybrid layer 0
    assert hybrid[5] == "decoder.layers.7.pre_mlp_layernorm.weight"
    assert hybrid[8] == "decoder.layers.7.mlp.experts.local_experts.7.linear_fc2.weight"
    assert hybrid[9] == "decoder.final_norm.weight" and hybrid[10] == "output_layer.weight"
    assert hybrid[11] == "language_model.decoder.layers.3.mlp.linear_fc2.weight"
    assert (
        hybrid[12] == "optimizer.state.exp_avg.decoder.layers.4.self_attention.linear_proj.weight"
    )
    assert [naming.to_gpt(n) for n in hybrid] == GPT_NAMES
    assert naming.convert(GPT_NAMES[5], source="gpt", target="gpt") == GPT_NAMES[5]
    with pytest.raises(naming.NamingError, match="hybrid layer 1 is an MLP layer"):
        naming.to_gpt("decoder.layers.1.self_attention.linear_qkv.weight")
    with pytest.raises(naming.NamingError, match="neither the attention nor the MLP"):
        naming.to_hybrid("decoder.layers.0.cross_attention.linear_q.weight")


def test_megatron_lm_args_of_a_hybrid_read_back() -> None:
    """Megatron-LM's args (interop.py) describe a hybrid checkpoint as pretrain_hybrid.py takes
    it; reading them back gives the model; other hybrid patterns are refused."""
    from megatron_gndpo.checkpoint import foreign_config, interop

    model = _hybrid(tiny_model(vocab_size=VOCAB, num_layers=3, kv_channels=8))
    args = interop.megatron_lm_args(model, step=5, tp=2, pp=1, world_size=4)
    assert (args.num_layers, args.hybrid_layer_pattern) == (6, "*-*-*-")
    assert foreign_config.from_megatron_lm_args(args, "common.pt") == model
    mamba = dict(vars(args), hybrid_layer_pattern="M*-M*-")
    with pytest.raises(foreign_config.ForeignConfigError, match="'M\\*-M\\*-' is not attention"):
        foreign_config.from_megatron_lm_args(mamba, "common.pt")


def test_hybrid_refuses_what_it_cannot_build() -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import ConfigError, load_config
    from tests.trainers import TINY

    for override, needle in (
        ("model.rotary_scaling_factor=8.0", "HybridModel has no RoPE scaling"),
        ("teacher.model.rotary_scaling_factor=8.0", "set teacher.model.model_class=gpt"),
    ):
        cfg = load_config(
            TINY, ["model.model_class=hybrid", "teacher.model.model_class=hybrid", override]
        )
        with pytest.raises(ConfigError, match=needle):
            validate(cfg, 1)


# ---------------------------------------------------------------------------------------------
# One process: logits, checkpoints, rollouts, Hugging Face


def _perturb(net: torch.nn.Module) -> None:
    """Norms start at 1: move every parameter, so a swapped or skipped one shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in net.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _logits(net: Any, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return net(tokens, positions, None)[..., :VOCAB]


def _scores(net: Any, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    from megatron_gndpo.models.logprob_head import ScoreContext, TokenLogProbs

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    context = ScoreContext(tokens.roll(-1, 1), entropy=True, top_k=3)
    with torch.no_grad():
        scores = net(tokens, positions, None, output_processor=TokenLogProbs(VOCAB),
                     output_processor_context=context)  # fmt: skip
    return dict(scores.items())


def _model_checks(root: str, groups: Any, name: str, model: ModelConfig) -> dict[str, Any]:
    from megatron_gndpo.checkpoint.dist import CheckpointError, load_checkpoint, save_checkpoint
    from megatron_gndpo.models.build import build_model, build_teacher

    out: dict[str, Any] = {}
    parallel = ParallelConfig()
    torch.manual_seed(0)
    gpt = build_model(model, parallel, groups)
    torch.manual_seed(0)
    hybrid = build_model(_hybrid(model), parallel, groups)
    out["classes"] = (type(gpt).__name__, type(hybrid).__name__, hybrid.hybrid_layer_pattern)
    gpt_params = dict(gpt.named_parameters())
    # the same parameters in the same order (what the optimizer's buckets rely on); the same
    # seed draws the same initial weights
    out["same_order"] = [naming.to_gpt(n) for n, _ in hybrid.named_parameters()] == list(gpt_params)
    out["same_init"] = all(
        torch.equal(p, gpt_params[naming.to_gpt(n)]) for n, p in hybrid.named_parameters()
    )
    _perturb(gpt)
    with torch.no_grad():
        for n, p in hybrid.named_parameters():
            p.copy_(gpt_params[naming.to_gpt(n)])
    tokens = torch.randint(1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    out["logit_diff"] = (_logits(gpt, tokens) - _logits(hybrid, tokens)).abs().max().item()
    mine, theirs = _scores(gpt, tokens), _scores(hybrid, tokens)
    out["score_fields"] = sorted(mine)
    out["score_diff"] = max(
        (mine[k].double() - theirs[k].double()).abs().max().item() for k in mine
    )
    # checkpoints: the GPTModel's loads as a hybrid teacher; the HybridModel's into a GPTModel
    # is refused, naming the fix
    save_checkpoint(f"{root}/{name}/gpt", 1, gpt)
    teacher = build_teacher(_hybrid(model), parallel, groups)
    load_checkpoint(f"{root}/{name}/gpt", teacher)
    out["teacher_diff"] = (_logits(gpt, tokens) - _logits(teacher, tokens)).abs().max().item()
    save_checkpoint(f"{root}/{name}/hybrid", 1, hybrid)
    try:
        load_checkpoint(f"{root}/{name}/hybrid", build_model(model, parallel, groups))
        out["refusal"] = ""
    except CheckpointError as err:
        out["refusal"] = str(err)
    if name == "dense":
        out |= _rollouts(gpt, hybrid, groups)
    return out


def _rollouts(gpt: Any, hybrid: Any, groups: Any) -> dict[str, Any]:
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    params = SamplingParams(max_new_tokens=6, temperature=1.0, samples_per_prompt=2)
    out = {}
    for name, net, decoder in (("gpt", gpt, "lean"), ("lean", hybrid, "lean"),
                               ("static", hybrid, "megatron")):  # fmt: skip
        gen = MegatronGenerator(net, groups, vocab_size=VOCAB, pad_id=0, max_sequence_length=64,
                                decoder=decoder)  # fmt: skip
        rollout = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
        out[f"rollout/{name}"] = (rollout.tokens, rollout.sampler_logprobs, gen.decoder)
    return out


def _hf_round_trip(root: str, groups: Any) -> dict[str, Any]:
    """A Hugging Face Qwen3 -> a hybrid checkpoint -> Hugging Face again."""
    import transformers
    from safetensors.torch import load_file

    from megatron_gndpo.checkpoint import hf_mapping
    from megatron_gndpo.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.models.build import build_model

    config = transformers.AutoConfig.for_model(
        **hf_mapping.hf_config_from_model(MODELS["dense"], "qwen3")
    )
    torch.manual_seed(4)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(f"{root}/hf")
    model = convert_hf_to_mcore(f"{root}/hf", f"{root}/mcore", groups=groups,
                                parallel=ParallelConfig(), model_class="hybrid")  # fmt: skip
    net = build_model(model, ParallelConfig(), groups)
    load_checkpoint(f"{root}/mcore", net)
    tokens = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = hf(tokens).logits[..., :VOCAB]
    out: dict[str, Any] = {"model_class": model.model_class, "net": type(net).__name__}
    out["hf_logit_diff"] = (_logits(net, tokens) - expected).abs().max().item()
    convert_mcore_to_hf(f"{root}/mcore", f"{root}/back", family="qwen3")
    before, after = (
        load_file(f"{root}/hf/model.safetensors"),
        load_file(f"{root}/back/model.safetensors"),
    )
    out["same_names"] = sorted(before) == sorted(after)
    out["round_trip_equal"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def _one_process(rank: int, world: int, root: str) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world), seed=1)
    out = {name: _model_checks(root, groups, name, model) for name, model in MODELS.items()}
    out["hf"] = _hf_round_trip(root, groups)
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_hybrid_equals_gpt_and_reads_its_checkpoints(tmp_path: Path) -> None:
    r = run_distributed(_one_process, 1, args=(str(tmp_path),), timeout_s=300)[0]
    for name in MODELS:
        m = r[name]
        assert m["classes"][:2] == ("GPTModel", "HookedHybridModel"), m["classes"]
        assert m["same_order"] and m["same_init"], name
        print(
            f"measured {name}: max logit diff {m['logit_diff']:.1e}, scores "
            f"{m['score_diff']:.1e}, GPT checkpoint as hybrid teacher {m['teacher_diff']:.1e}"
        )
        assert m["logit_diff"] < 1e-6 and m["score_diff"] < 1e-6, m
        assert m["score_fields"] == ["entropy", "logprobs", "topk_ids", "topk_logprobs"]
        assert m["teacher_diff"] < 1e-6, m
        assert "saved by a HybridModel" in m["refusal"], m["refusal"]
        assert "set model_class: hybrid" in m["refusal"], m["refusal"]
    assert r["dense"]["classes"][2] == "*-*-" and r["moe"]["classes"][2] == "*E*-"
    # the lean decoder runs the hybrid (it did not fall back) and samples what it samples on
    # the GPTModel; megatron's static path samples the same
    gpt_tokens, gpt_logp, _ = r["dense"]["rollout/gpt"]
    for name, decoder in (("lean", "lean"), ("static", "megatron")):
        tokens, logp, used = r["dense"][f"rollout/{name}"]
        assert used == decoder and torch.equal(tokens, gpt_tokens), name
        torch.testing.assert_close(logp, gpt_logp, rtol=0, atol=1e-5)
    hf = r["hf"]
    assert hf["model_class"] == "hybrid" and hf["net"] == "HookedHybridModel"
    assert hf["hf_logit_diff"] < 1e-4, hf
    assert hf["same_names"] and hf["round_trip_equal"], hf
