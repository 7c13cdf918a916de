"""megatron-core on CPU through the compat module and our process groups.

The key check: a tiny GPTModel at TP=2 (two gloo ranks) gives the same logits and gradients as
the same weights at TP=1. The TP=1 reference is built on the same world from a *second* layout
(``build_groups``), the way the teacher gets its own layout beside the student's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gndpo.compat import cpu
from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from tests.harness import run_distributed
from tests.tiny import copy_tp_shards

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
    assert model.core_attention == "sdpa"
    student = build_student_groups(ParallelLayout(world_size, tp=2), seed=1234)
    reference_groups = build_groups(ParallelLayout(world_size, tp=1), name="reference")

    torch.manual_seed(0)
    reference = build_gpt(model, ParallelConfig(tensor_parallel=1), reference_groups)
    sharded = build_gpt(model, ParallelConfig(tensor_parallel=2), student)
    copy_tp_shards(reference, sharded, tp=2, rank=student.coords["tp"], swiglu=model.swiglu)

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(6))
    out = {}
    logits_by_tp = {}
    for tp, net, groups in ((1, reference, reference_groups), (2, sharded, student)):
        logits = _gathered_logits(net, tokens, groups.tp)[..., :VOCAB]
        (logits.log_softmax(-1) * weights).sum().backward()
        logits_by_tp[tp] = logits.detach()
    out["logit_diff"] = (logits_by_tp[1] - logits_by_tp[2]).abs().max().item()

    # megatron's own local attention with the same weights equals the SDPA core attention
    local_cfg = dataclasses.replace(model, core_attention="local")
    local = build_gpt(local_cfg, ParallelConfig(tensor_parallel=2), student)
    local.load_state_dict(sharded.state_dict())
    with torch.no_grad():
        local_logits = _gathered_logits(local, tokens, student.tp)[..., :VOCAB]
    out["sdpa_vs_local"] = (local_logits - logits_by_tp[2]).abs().max().item()

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
        assert r["sdpa_vs_local"] < 1e-5, r
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), r
        # plan's arithmetic agrees with the real shards
        assert r["params_tp2"] == r["plan_tp2"]
        assert r["params_tp1"] == r["plan_tp1"]


def _training_stack(rank: int, world_size: int, ckpt_dir: str) -> dict[str, object]:
    """PP=2 x DP=2: 1F1B schedule, megatron DDP, distributed optimizer, grad clip, checkpoint."""
    cpu.enable()
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    model_cfg, parallel = _tiny(), ParallelConfig(pipeline_parallel=2)
    groups = build_student_groups(ParallelLayout(world_size, pp=2), seed=7)
    torch.manual_seed(0)
    model = build_gpt(model_cfg, parallel, groups)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True
        ),
        module=model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0),
        [ddp],
    )
    seq, micro = 16, 2
    gen = torch.Generator().manual_seed(100 + groups.coords["dp"])
    batches = [torch.randint(0, VOCAB, (micro, seq), generator=gen) for _ in range(3)]

    def forward_step(data_iterator, net):  # type: ignore[no-untyped-def]
        tokens = next(data_iterator)
        positions = torch.arange(seq).unsqueeze(0).expand(micro, -1)
        per_token = net(tokens, positions, attention_mask=None, labels=tokens)

        def loss_func(output: torch.Tensor):  # type: ignore[no-untyped-def]
            total = output.sum()
            return total, torch.tensor(output.numel(), dtype=torch.int), {"lm": total.detach()}

        return per_token, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[ddp],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=micro,
        forward_only=False,
    )
    updated, grad_norm, _ = optimizer.step()
    unchanged = [
        n for (n, p), b in zip(model.named_parameters(), before, strict=True) if torch.equal(p, b)
    ]

    def state() -> dict[str, object]:
        sharded = model.sharded_state_dict()  # the inner model: DDP's keys carry "module."
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded, metadata=meta)}

    dist_checkpointing.save(state(), ckpt_dir)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        loaded = dist_checkpointing.load(state(), ckpt_dir)
    model.load_state_dict(loaded["model"])
    restored = all(torch.equal(p, s) for p, s in zip(model.parameters(), saved, strict=True))
    return {
        "updated": bool(updated),
        "grad_norm": float(grad_norm),
        "unchanged": unchanged,
        "restored": restored,
        "last_stage": groups.is_last_stage,
        "losses": [float(r["lm"]) for r in reports],
    }


@pytest.mark.distributed
def test_training_stack_pp2_dp2_runs_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(_training_stack, world_size=4, args=(str(tmp_path),), timeout_s=300)
    norms = {r["grad_norm"] for r in results}
    assert len(norms) == 1, f"every rank must see the same global grad norm, got {norms}"
    for r in results:
        assert r["updated"], r
        assert torch.isfinite(torch.tensor(r["grad_norm"])) and r["grad_norm"] > 0
        assert r["unchanged"] == [], f"parameters not updated: {r['unchanged']}"
        assert r["restored"], "checkpoint load did not restore the saved weights"
        if r["last_stage"]:
            assert len(r["losses"]) == 3 and all(x > 0 for x in r["losses"])
