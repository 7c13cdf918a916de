"""megatron-core on CPU through the compat module and our process groups.

The key check: a tiny GPTModel at TP=2 (two gloo ranks) gives the same logits and gradients as
the same weights at TP=1. The TP=1 reference is built on the same world from a *second* layout
(``build_groups``), the way the teacher gets its own layout beside the student's.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gndpo.compat import cpu
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from tests.harness import run_distributed

pytestmark = [pytest.mark.megatron]

VOCAB = 120  # not a multiple of the padding: the padded rows must not change real logits


def _tiny(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=64,  # padded to 128 at TP=1 and TP=2 alike
        max_position_embeddings=64,
        add_qkv_bias=True,
        params_dtype="fp32",
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _copy_tp_shards(reference: torch.nn.Module, sharded: torch.nn.Module, tp: int, rank: int,
                    swiglu: bool) -> None:  # fmt: skip
    """Load the TP=1 model's weights into this rank's TP shard (megatron layouts)."""
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            src = full[name]
            if not getattr(param, "tensor_model_parallel", False):
                param.copy_(src)
                continue
            dim = param.partition_dim
            if swiglu and "linear_fc1" in name:
                # [gate; up] stacked: each rank holds its slice of both halves.
                halves = [h.chunk(tp, dim)[rank] for h in src.chunk(2, dim=0)]
                param.copy_(torch.cat(halves, dim=0))
            else:
                param.copy_(src.chunk(tp, dim)[rank])


def _gathered_logits(model: torch.nn.Module, tokens: torch.Tensor, group: object) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)  # [b, s, V/tp]
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    # all_gather has no autograd: put this rank's slice back in so gradients flow through it.
    parts[torch.distributed.get_rank(group)] = logits
    return torch.cat(parts, dim=-1)


def _tp2_equals_tp1(rank: int, world_size: int) -> dict[str, float]:
    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups
    from megatron_gndpo.plan import stage_params

    model = _tiny()
    student = build_student_groups(ParallelLayout(world_size, tp=2), seed=1234)
    reference_groups = build_groups(ParallelLayout(world_size, tp=1), name="reference")

    torch.manual_seed(0)
    reference = build_gpt(model, ParallelConfig(tensor_parallel=1), reference_groups)
    sharded = build_gpt(model, ParallelConfig(tensor_parallel=2), student)
    _copy_tp_shards(reference, sharded, tp=2, rank=student.coords["tp"], swiglu=model.swiglu)

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(6))
    out = {}
    logits_by_tp = {}
    for tp, net, groups in ((1, reference, reference_groups), (2, sharded, student)):
        logits = _gathered_logits(net, tokens, groups.tp)[..., :VOCAB]
        (logits.log_softmax(-1) * weights).sum().backward()
        logits_by_tp[tp] = logits.detach()
    out["logit_diff"] = (logits_by_tp[1] - logits_by_tp[2]).abs().max().item()

    # Gradients: this rank's TP=2 shard against the matching slice of the TP=1 gradient.
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    worst = 0.0
    for name, param in sharded.named_parameters():
        expected = ref_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            dim, tp_rank = param.partition_dim, student.coords["tp"]
            if "linear_fc1" in name:
                expected = torch.cat([h.chunk(2, dim)[tp_rank] for h in expected.chunk(2, 0)])
            else:
                expected = expected.chunk(2, dim)[tp_rank]
        worst = max(worst, (param.grad - expected).abs().max().item())
    out["grad_diff"] = worst
    out["grad_scale"] = max(p.grad.abs().max().item() for p in reference.parameters())
    out["params_tp2"] = float(sum(p.numel() for p in sharded.parameters()))
    out["plan_tp2"] = float(stage_params(model, student.layout, 0))
    out["params_tp1"] = float(sum(p.numel() for p in reference.parameters()))
    out["plan_tp1"] = float(stage_params(model, reference_groups.layout, 0))
    return out


@pytest.mark.distributed
def test_tp2_logits_and_grads_equal_tp1() -> None:
    results = run_distributed(_tp2_equals_tp1, world_size=2, timeout_s=240)
    for r in results:
        print(r)
        assert r["logit_diff"] < 1e-5, r
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), r
        # plan's arithmetic agrees with the real shards
        assert r["params_tp2"] == r["plan_tp2"]
        assert r["params_tp1"] == r["plan_tp1"]
