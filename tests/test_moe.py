"""Mixture-of-experts students and teachers with expert parallelism (megatron-core's MoE layer).

Two multi-process launches hold the expensive checks:

- ``_ep_checks`` (2 ranks): the same MoE weights at EP=2 (megatron's global state, as the
  student) and at EP=1 (a second layout, as a teacher beside it) give the same logits and
  gradients, dropless, aux loss off, and with it on (each rank's aux loss covers its own tokens
  at either EP, so at one DP split they agree; it is not the aux loss of one process holding the
  whole batch); a teacher-style EP=2 model built on ``build_groups`` (no global
  state) scores like EP=1;
- ``_trainer_checks`` (2 ranks): ``examples/tiny_cpu_moe.yaml`` through the real trainer (student
  EP=2, teacher EP=1): two steps, router losses and the sampler/trainer routing mismatch logged,
  a third step with rollout routing replay, every expert that received tokens moved, the
  teacher's weights never did (the routing itself: tests/test_routing.py);
- ``_tp_ep_checks`` (4 ranks): TP=2 x EP=2 with sequence parallelism against the same weights at
  TP=1 x EP=1 (gradients through megatron's DDP, log-probs, scoring, generated tokens), then
  ``examples/tiny_cpu_moe.yaml`` at that layout through the real trainer for two steps.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.parallel.groups import ParallelLayout
from tests.harness import run_distributed
from tests.tiny import tiny_model

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny_cpu_moe.yaml"
EXPERTS = 4
VOCAB = 128


def _moe(**overrides: Any) -> Any:
    base = dict(hidden_size=64, ffn_hidden_size=128, vocab_size=VOCAB, num_experts=EXPERTS,
                moe_ffn_hidden_size=64)  # fmt: skip
    return tiny_model(**(base | overrides))


def _problems(world: int, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(EXAMPLE, list(overrides)), world)
    return str(err.value)


def test_moe_config_errors_name_the_fix() -> None:
    msg = _problems(2, "model.moe_router_topk=5")
    assert "model.moe_router_topk=5 must be between 1 and model.num_experts (4)" in msg
    msg = _problems(4, "model.num_experts=6", "parallel.expert_parallel=4")
    assert "model.num_experts (6) is not divisible by parallel.expert_parallel (4)" in msg
    msg = _problems(2, "teacher.parallel.expert_parallel=4")
    assert (
        "teacher.parallel: expert_parallel (4) must divide data_parallel x context_parallel" in msg
    )
    msg = _problems(2, "model.num_experts=null")
    assert "parallel.expert_parallel=2 needs a mixture-of-experts model" in msg
    msg = _problems(2, "parallel.expert_parallel=1", "parallel.tensor_parallel=2")
    assert "parallel.sequence_parallel=true" in msg
    validate(load_config(EXAMPLE, ["parallel.expert_parallel=1", "parallel.tensor_parallel=2",
                                   "parallel.sequence_parallel=true"]), 2)  # fmt: skip
    msg = _problems(2, "model.moe_layer_pattern=[1,0,1]")
    assert "model.moe_layer_pattern must hold one 0 (dense) or 1 (MoE) per layer (2" in msg
    msg = _problems(2, "model.moe_norm_topk_prob=false")
    assert "set moe_router_pre_softmax=true" in msg
    msg = _problems(2, "model.moe_capacity_factor=0", "model.add_bias_linear=true")
    assert "model.moe_capacity_factor must be > 0, or null for dropless" in msg
    assert "set add_bias_linear=false" in msg
    msg = _problems(2, "teacher.model.moe_aux_loss_coeff=-1")
    assert "teacher.model.moe_aux_loss_coeff must be >= 0" in msg


def test_expert_grid_follows_megatrons_order() -> None:
    # tp-cp-ep-dp-pp: the expert grid etp-ep-edp-pp takes EP out of DP x CP
    lay = ParallelLayout(8, tp=2, ep=2)
    assert (lay.dp, lay.edp) == (4, 2)
    assert lay.groups(("ep",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups(("edp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups(("etp", "ep")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.expert_coords(6) == {"etp": 0, "ep": 1, "edp": 1, "pp": 0}
    cp = ParallelLayout(8, cp=2, ep=4)  # EP spans CP ranks too
    assert (cp.dp, cp.edp) == (4, 2) and cp.groups(("ep",))[0] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"expert_parallel \(3\) must divide"):
        ParallelLayout(8, tp=2, ep=3)
    with pytest.raises(ValueError, match="mix the dense grid"):
        lay.groups(("dp", "ep"))
    assert "EP=2 EDP=2" in lay.describe()


def test_moe_fields_reach_megatrons_config_and_layer_specs() -> None:
    from megatron_gndpo.models.gpt import stage_layer_spec, transformer_config

    model = _moe(moe_router_pre_softmax=True, moe_norm_topk_prob=False, moe_z_loss_coeff=1e-3,
                 moe_shared_expert_ffn_hidden_size=32, num_layers=4,
                 moe_layer_pattern=(0, 1, 1, 0))  # fmt: skip
    c = transformer_config(model, ParallelConfig(expert_parallel=2))
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 64)
    assert (c.moe_router_pre_softmax, c.moe_z_loss_coeff, c.moe_aux_loss_coeff) == (True, 1e-3, 0)
    assert c.moe_shared_expert_intermediate_size == 32 and c.expert_model_parallel_size == 2
    assert c.moe_layer_freq == [0, 1, 1, 0] and c.moe_expert_capacity_factor is None
    # norm_topk_prob (Qwen3-MoE) is megatron's softmax after the top-k
    assert not transformer_config(
        _moe(moe_router_pre_softmax=True), ParallelConfig()
    ).moe_router_pre_softmax
    dense = transformer_config(tiny_model(), ParallelConfig())
    assert dense.num_moe_experts is None
    # PP=2 of the pattern: stage 0 holds a dense and an MoE layer, with the SDPA attention
    block = stage_layer_spec(model, ParallelConfig(pipeline_parallel=2), 0)
    mlps = [repr(spec.submodules.mlp) for spec in block.layer_specs]
    assert "MoELayer" not in mlps[0] and "MoELayer" in mlps[1], mlps
    attention = {s.submodules.self_attention.submodules.core_attention.__name__
                 for s in block.layer_specs}  # fmt: skip
    assert attention == {"SDPAttention"}


def _copy_into_ep_shard(reference: torch.nn.Module, sharded: torch.nn.Module, ep: int,
                        ep_rank: int, tp: int = 1, tp_rank: int = 0) -> None:  # fmt: skip
    """Load the EP=1 TP=1 model's weights into this rank's EP x TP shard (local expert i is
    global expert ep_rank * E/ep + i; experts are split over TP like dense layers, SwiGLU's
    fc1 holding a slice of both halves). ``sharded`` may be a HybridModel (its names are
    translated to the GPTModel's)."""
    from megatron_gndpo.models import naming

    full = dict(reference.named_parameters())
    per_rank = EXPERTS // ep
    source = naming.model_class_of(sharded)
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            gpt_name = naming.convert(name, source=source, target="gpt")
            src = full[_global_name(gpt_name, per_rank, ep_rank)]
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
                halves = src.chunk(2, 0) if "linear_fc1" in name else (src,)  # SwiGLU
                src = torch.cat([h.chunk(tp, dim)[tp_rank] for h in halves])
            param.copy_(src)


def _global_name(name: str, per_rank: int, ep_rank: int) -> str:
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    local, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * per_rank + int(local)}.{rest}"


def _forward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)


def _ep_checks(rank: int, world: int) -> dict[str, float]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_gpt, build_teacher
    from megatron_gndpo.parallel.groups import build_groups, build_student_groups

    out: dict[str, float] = {}
    router: dict[str, torch.Tensor] = {}
    student = build_student_groups(ParallelLayout(world, ep=2), seed=1234)  # checks megatron's
    ep1_groups = build_groups(ParallelLayout(world, ep=1), name="ep1")
    ep_rank = student.layout.expert_coords(rank)["ep"]
    # each rank feeds its own rows (DP=2): the dispatcher mixes them between the ranks' experts
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(10 + rank))
    weights = torch.randn(2, 24, VOCAB, generator=torch.Generator().manual_seed(20 + rank))
    for aux in (0.0, 0.01):
        model = _moe(moe_aux_loss_coeff=aux)
        torch.manual_seed(0)
        ref = build_gpt(model, ParallelConfig(), ep1_groups)
        ep2 = build_gpt(model, ParallelConfig(expert_parallel=2), student)
        _copy_into_ep_shard(ref, ep2, 2, ep_rank)
        logits = {}
        for name, net in (("ep1", ref), ("ep2", ep2)):
            net.train()
            lg = _forward(net, tokens)[..., :VOCAB]
            (lg.log_softmax(-1) * weights).sum().backward()
            logits[name] = lg.detach()
        # EP=1 reference gradients of the whole batch: the sum of both ranks' (an expert at EP=2
        # sees the tokens of both ranks; a dense weight only its own rank's)
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        for name, grad in ref_grads.items():
            if ".local_experts." in name:
                torch.distributed.all_reduce(grad)
        worst = 0.0
        for name, param in ep2.named_parameters():
            expected = ref_grads[_global_name(name, EXPERTS // 2, ep_rank)]
            worst = max(worst, (param.grad - expected).abs().max().item())
        key = "aux_on" if aux else "aux_off"
        out[f"{key}/logit_diff"] = (logits["ep1"] - logits["ep2"]).abs().max().item()
        out[f"{key}/grad_diff"] = worst
        out[f"{key}/grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
        router[key] = torch.cat(
            [p.grad.flatten() for n, p in ep2.named_parameters() if "router" in n]
        )
        out[f"{key}/expert_grads_nonzero"] = float(all(
            bool(p.grad.abs().sum() > 0) for n, p in ep2.named_parameters() if "expert" in n
        ))  # fmt: skip

    out["aux_on/router_grad_change"] = (router["aux_on"] - router["aux_off"]).abs().max().item()
    # the plain backward above left megatron's aux-loss scale a 0-d tensor; its schedules
    # (below) set a [1] one into it: start afresh, as a run that only uses the schedules does
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    out |= _lockstep_checks(rank, ref, ep2, ep1_groups, student)

    # A teacher on its own EP=2 layout (build_groups: expert groups without global state) and
    # one at EP=1 score alike, in eval mode without gradients and without router losses.
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    teacher_model = _moe(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.01)
    teacher_groups = build_groups(ParallelLayout(world, ep=2), name="teacher")
    torch.manual_seed(1)
    t1 = build_teacher(teacher_model, ParallelConfig(), ep1_groups)
    t2 = build_teacher(teacher_model, ParallelConfig(expert_parallel=2), teacher_groups)
    _copy_into_ep_shard(t1, t2, 2, teacher_groups.layout.expert_coords(rank)["ep"])
    # the same teacher as a HybridModel (model_class: hybrid) at EP=2
    from megatron_gndpo.models.build import build_teacher as build_any_teacher

    hybrid_model = dataclasses.replace(teacher_model, model_class="hybrid")
    t3 = build_any_teacher(hybrid_model, ParallelConfig(expert_parallel=2), teacher_groups)
    _copy_into_ep_shard(t1, t3, 2, teacher_groups.layout.expert_coords(rank)["ep"])
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    with torch.no_grad():
        s1, s2, s3 = (_forward(t, tokens)[..., :VOCAB] for t in (t1, t2, t3))
    out["teacher/logit_diff"] = (s1 - s2).abs().max().item()
    out["teacher/hybrid_logit_diff"] = (s1 - s3).abs().max().item()
    out |= {f"hybrid/{k}": v for k, v in _lockstep_checks(rank, t1, t3, ep1_groups,
                                                           teacher_groups).items()}  # fmt: skip
    out["teacher/recorded_router_loss"] = sum(
        float(e.values.abs().sum()) for e in tracker.metrics.values()
    )
    out["teacher/ep_group"] = float(torch.distributed.get_world_size(teacher_groups.ep))
    return out


def _lockstep_checks(rank: int, ep1: Any, ep2: Any, ep1_groups: Any, groups: Any) -> dict:
    """Generation and scoring where the two EP ranks need unequal work (rank 1: more and longer
    rows, a smaller token budget): EP=2 must give EP=1's tokens and log-probs. The EP ranks run
    equally many forwards (idle ones on the rank done first); unequal counts hang or mix rows."""
    from megatron_gndpo.engine.scoring import score_batch
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    prompts = [[3, 4, 5]] if rank == 0 else [[7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_new_tokens=4 + 6 * rank, samples_per_prompt=2)
    seeds = [5 + rank + i for i in range(len(prompts))]
    out = {}
    results = {}
    for name, net, g in (("ep1", ep1, ep1_groups), ("ep2", ep2, groups)):
        gen = MegatronGenerator(net, g, vocab_size=VOCAB, pad_id=0, max_sequence_length=64)
        rollout = gen.generate(prompts, params, seeds=seeds)
        head = TokenLogProbs(vocab_size=VOCAB)
        budget = 64 if rank == 0 else 16  # rank 1: one row a micro-batch
        scores = score_batch(
            net, g, rollout.tokens, rollout.lengths, head=head, token_budget=budget
        )
        results[name] = (rollout.tokens, scores.logprobs)
    out["lockstep/same_tokens"] = float(torch.equal(results["ep1"][0], results["ep2"][0]))
    diff = (results["ep1"][1] - results["ep2"][1]).abs().max().item()
    out["lockstep/logprob_diff"] = diff
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_ep2_equals_ep1_and_a_teacher_at_its_own_ep() -> None:
    for r in run_distributed(_ep_checks, 2, timeout_s=240):
        assert r["aux_off/logit_diff"] < 1e-5, r
        assert r["aux_off/grad_diff"] < 1e-5 * max(1.0, r["aux_off/grad_scale"]), r
        assert r["aux_off/expert_grads_nonzero"] == 1.0
        # the aux loss is each rank's own tokens' at EP=1 and EP=2 alike (the router's token
        # counts are reduced over TP x CP, not EP): at the same DP split it agrees too
        assert r["aux_on/logit_diff"] < 1e-5, r
        assert r["aux_on/grad_diff"] < 1e-5 * max(1.0, r["aux_on/grad_scale"]), r
        assert r["aux_on/router_grad_change"] > 1e-4, r  # and it was on
        assert r["teacher/logit_diff"] < 1e-5, r
        # a HybridModel teacher at EP=2: the same logits, tokens and log-probs
        assert r["teacher/hybrid_logit_diff"] < 1e-5, r
        assert r["hybrid/lockstep/same_tokens"] == 1.0, r
        assert r["hybrid/lockstep/logprob_diff"] < 1e-5, r
        assert r["teacher/recorded_router_loss"] == 0.0
        assert r["teacher/ep_group"] == 2.0
        assert r["lockstep/same_tokens"] == 1.0 and r["lockstep/logprob_diff"] < 1e-5, r


def _aux_scale_checks(rank: int, world: int) -> dict[str, Any]:
    """Router-loss gradients (zero advantages: nothing else moves): megatron's own schedule with a
    loss that counts every routed token, the case its per-token router-loss weighting is derived
    for; then run_update with a long and a short response on the same tokens."""
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gndpo.config.schema import AlgorithmConfig, OptimizerConfig
    from megatron_gndpo.engine.optimizer import build_optimizer, wrap_ddp
    from megatron_gndpo.engine.update import Targets, UpdateBatch, _micro_batches, run_update
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import build_student_groups

    groups = build_student_groups(ParallelLayout(world), seed=1)
    torch.manual_seed(0)
    net = build_gpt(_moe(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), ParallelConfig(), groups)
    ddp = wrap_ddp(net, use_distributed_optimizer=False)
    optimizer = build_optimizer(
        ddp,
        OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False),
    )
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(4))
    zeros = torch.zeros(tokens.shape)
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}

    def batch(first: int) -> UpdateBatch:  # the response starts at position `first`
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        mask[:, first:] = True
        return UpdateBatch(tokens, zeros, Targets(zeros), mask)

    def router_grads() -> torch.Tensor:
        return torch.cat([p.main_grad.flatten().clone() for n, p in ddp.named_parameters()
                          if "router" in n])  # fmt: skip

    def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
        m = next(data)
        positions = torch.arange(m["tokens"].shape[1]).expand_as(m["tokens"])
        routed = torch.tensor(m["tokens"].numel(), dtype=torch.int)
        return model(m["tokens"], positions, None), lambda o: ((o * 0.0).sum(), routed, {})

    micro = _micro_batches(batch(3), list(range(4)), 2)
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
        num_microbatches=len(micro), seq_length=16, micro_batch_size=2, forward_only=False,
    )  # fmt: skip
    out: dict[str, Any] = {"all_routed": router_grads()}
    for name, first in (("long", 3), ("short", 12)):
        run_update(
            ddp, optimizer, None, batch(first), head=TokenLogProbs(vocab_size=VOCAB),
            algorithm=AlgorithmConfig(), micro_batch_size=2, optimizer_steps=1,
            dp_group=groups.dp_cp,
        )  # fmt: skip
        out[name] = router_grads()
    out["moved"] = [n for n, p in ddp.named_parameters() if not torch.equal(p, before[n])]
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_router_losses_weigh_the_same_whatever_the_loss_counts() -> None:
    """Our loss counts response tokens, the router sees every token: the router losses must not
    weigh (routed tokens / response tokens) times more (engine/moe.py, router_loss_scale)."""
    [r] = run_distributed(_aux_scale_checks, 1, timeout_s=240)
    assert r["moved"] == []  # lr 0: every pass saw the same weights
    scale = r["all_routed"].abs().max().item()
    assert scale > 0
    for name in ("long", "short"):
        assert (r[name] - r["all_routed"]).abs().max().item() < 1e-5 * scale, name


def _trainer_checks(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.trainer import Trainer

    cfg = load_config(EXAMPLE, [f"logging.run_dir={run_dir}"])
    validate(cfg, world)
    trainer = Trainer(cfg)
    student = {n: p.detach().clone() for n, p in trainer.c.student.named_parameters()}
    teacher_model = trainer.c.teacher.model
    teacher = {n: p.detach().clone() for n, p in teacher_model.named_parameters()}
    steps = [trainer.step() for _ in range(2)]
    # a third step replays the sampler's experts (algorithm.routing_replay=rollout)
    algorithm = dataclasses.replace(cfg.algorithm, routing_replay="rollout")
    trainer.cfg = dataclasses.replace(cfg, algorithm=algorithm)
    replayed = trainer.step()
    experts = [n for n in student if ".local_experts." in n]
    out = {
        "steps": [
            {k: v for k, v in s.items() if k.startswith(("moe/", "loss", "grad_norm"))}
            for s in steps
        ],
        "mismatch": [s.get("moe/routing_mismatch") for s in steps],
        "replayed": {k: v for k, v in replayed.items() if k in ("loss", "moe/routing_mismatch")},
        "experts": len(experts),
        "unchanged_experts": [
            n
            for n, p in trainer.c.student.named_parameters()
            if n in experts and torch.equal(p, student[n])
        ],
        "teacher_moved": [
            n for n, p in teacher_model.named_parameters() if not torch.equal(p, teacher[n])
        ],
        "teacher_experts": sum(".local_experts." in n for n in teacher),
    }
    trainer.c.logger.close()
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_tiny_moe_example_trains_at_ep2_beside_an_ep1_teacher(tmp_path: Path) -> None:
    for r in run_distributed(_trainer_checks, 2, args=(str(tmp_path),), timeout_s=300):
        assert r["experts"] == 2 * 2 * 2  # 2 layers x 2 local experts x fc1/fc2
        assert r["teacher_experts"] == 2 * 4 * 2  # EP=1: every expert on every rank
        # 2 steps of 8 rollouts route hundreds of tokens to each of the 4 experts
        assert r["unchanged_experts"] == [], r
        assert r["teacher_moved"] == []
        for step in r["steps"]:
            assert step["moe/load_balancing_loss"] > 0 and step["moe/z_loss"] > 0, step
            assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]), step
        # the sampler's experts against the trainer's (fp32 CPU: the same, almost always)
        assert all(m is not None and 0.0 <= m < 0.05 for m in r["mismatch"]), r["mismatch"]
        assert math.isfinite(r["replayed"]["loss"]), r  # replayed: nothing left to compare
        assert "moe/routing_mismatch" not in r["replayed"], r


def _tp_ep_gradients(rank: int, world: int) -> dict[str, float]:
    """The same MoE weights at TP=2 x EP=2 + SP (megatron DDP and finalize_model_grads) and at
    TP=1 x EP=1: one forward/backward of each DP replica's own rows through the log-prob head
    gives the same log-probs and, summed over the replicas, the same gradients (router losses
    off, dropless). Leaves megatron's global state as it found it (none)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_gndpo.engine.optimizer import wrap_ddp
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import build_groups, build_student_groups
    from tests.trainers import reset_megatron

    groups = build_student_groups(ParallelLayout(world, tp=2, ep=2), seed=1234)
    ref_groups = build_groups(ParallelLayout(world), name="grad-reference")
    torch.manual_seed(0)
    ref = build_gpt(_moe(), ParallelConfig(), ref_groups)
    layout = ParallelConfig(tensor_parallel=2, expert_parallel=2, sequence_parallel=True)
    sp = build_gpt(_moe(), layout, groups)
    tp_rank, ep_rank = groups.coords["tp"], groups.layout.expert_coords(rank)["ep"]
    _copy_into_ep_shard(ref, sp, 2, ep_rank, tp=2, tp_rank=tp_rank)
    g = torch.Generator().manual_seed(30 + groups.coords["dp"])  # a replica's own rows
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    weights = torch.randn(2, 24, generator=g)
    positions, targets = torch.arange(24).expand_as(tokens), torch.roll(tokens, -1, dims=1)
    head = TokenLogProbs(vocab_size=VOCAB)
    ddp = wrap_ddp(sp, use_distributed_optimizer=False)
    logp = {}
    for name, net in (("ref", ref), ("sp", ddp)):
        lp = net(tokens, positions, None, output_processor=head, output_processor_context=targets)
        (lp * weights).sum().backward()
        logp[name] = lp.detach()
    finalize_model_grads([ddp])  # DP sum (per-token loss), norms and routers summed over TP
    full = {n: p.grad for n, p in ref.named_parameters()}
    for grad in full.values():  # every replica's rows, each counted by its two TP ranks
        torch.distributed.all_reduce(grad)
        grad /= 2
    worst = 0.0
    for name, param in sp.named_parameters():
        expected = full[_global_name(name, EXPERTS // 2, ep_rank)]
        if getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            halves = expected.chunk(2, 0) if "linear_fc1" in name else (expected,)  # SwiGLU
            expected = torch.cat([h.chunk(2, dim)[tp_rank] for h in halves])
        worst = max(worst, (param.main_grad - expected).abs().max().item())
    reset_megatron()
    return {
        "grad/logprob_diff": (logp["ref"] - logp["sp"]).abs().max().item(),
        "grad/diff": worst,
        "grad/scale": max(g.abs().max().item() for g in full.values()),
    }


def _tp_ep_checks(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """TP=2 x EP=2 with sequence parallelism on 4 ranks (expert TP=2; DP=2, EP out of it):
    gradients equal TP=1 x EP=1's (:func:`_tp_ep_gradients`); with an EP=1 TP=1 model's
    weights, the student scores and samples like it (on unequal work per EP rank); then
    ``examples/tiny_cpu_moe.yaml`` trains 2 steps through the Trainer."""
    from megatron_gndpo.compat import cpu

    cpu.enable()
    gradients = _tp_ep_gradients(rank, world)
    from megatron_gndpo.engine.scoring import score_batch
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import build_groups
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.trainer import Trainer

    cfg = load_config(EXAMPLE, [f"logging.run_dir={run_dir}", *TP_EP_SP])
    validate(cfg, world)
    trainer = Trainer(cfg)
    student, groups = trainer.c.student, trainer.c.student_groups
    ref_groups = build_groups(ParallelLayout(world), name="reference")
    torch.manual_seed(0)
    ref = build_gpt(cfg.model, ParallelConfig(), ref_groups)
    ep_rank, tp_rank = groups.layout.expert_coords(rank)["ep"], groups.coords["tp"]
    _copy_into_ep_shard(ref, student, 2, ep_rank, tp=2, tp_rank=tp_rank)

    out: dict[str, Any] = {"layout": groups.layout.describe(), **gradients}
    dp = groups.coords["dp"]  # the TP ranks of a replica share its rows; the DP ranks do not
    prompts = [[3, 4, 5]] if dp == 0 else [[7, 8], [9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_new_tokens=4 + 4 * dp, samples_per_prompt=2)
    seeds = [5 + dp + i for i in range(len(prompts))]
    vocab = cfg.model.vocab_size
    results = {}
    for name, net, g in (("ref", ref, ref_groups), ("student", student, groups)):
        gen = MegatronGenerator(net, g, vocab_size=vocab, pad_id=0, max_sequence_length=64)
        rollout = gen.generate(prompts, params, seeds=seeds)
        head = TokenLogProbs(vocab_size=vocab)
        budget = 64 if dp == 0 else 16  # 1 micro-batch against 4: unequal per EP rank
        scores = score_batch(
            net, g, rollout.tokens, rollout.lengths, head=head, token_budget=budget
        )
        assert scores is not None
        results[name] = (rollout, scores.logprobs)
    (a, lp_a), (b, lp_b) = results["ref"], results["student"]
    out["same_tokens"] = bool(torch.equal(a.tokens, b.tokens))
    out["sampler_logprob_diff"] = (a.sampler_logprobs - b.sampler_logprobs).abs().max().item()
    out["score_diff"] = (lp_a - lp_b).abs().max().item()
    out["sampled_routing"] = b.routing is not None  # not tracked under sequence parallelism

    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    teacher_model = trainer.c.teacher.model
    teacher = {n: p.detach().clone() for n, p in teacher_model.named_parameters()}
    steps = [trainer.step() for _ in range(2)]
    experts = [n for n in before if ".local_experts." in n]
    replicated = [n for n, p in student.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False)]  # fmt: skip
    flat = torch.cat([student.get_parameter(n).detach().flatten() for n in replicated])
    both = [torch.empty_like(flat) for _ in range(2)]
    torch.distributed.all_gather(both, flat, group=groups.tp)
    out |= {
        "steps": [
            {k: v for k, v in s.items() if k.startswith(("moe/", "loss", "grad_norm"))}
            for s in steps
        ],
        "experts": len(experts),
        "unchanged": [n for n, p in student.named_parameters() if torch.equal(p, before[n])],
        "replicated_equal_over_tp": bool(torch.equal(both[0], both[1])),
        "teacher_moved": [
            n for n, p in teacher_model.named_parameters() if not torch.equal(p, teacher[n])
        ],
    }
    trainer.c.logger.close()
    return out


TP_EP_SP = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2",
            "parallel.sequence_parallel=true")  # fmt: skip


@pytest.mark.distributed
@pytest.mark.megatron
def test_tiny_moe_example_trains_at_tp2_x_ep2_with_sequence_parallelism(tmp_path: Path) -> None:
    results = run_distributed(_tp_ep_checks, 4, args=(str(tmp_path),), timeout_s=420)
    # the router losses are averaged over TP x DP (each TP rank routes its own tokens under SP)
    assert len({str(r["steps"]) for r in results}) == 1, [r["steps"] for r in results]
    for r in results:
        print({k: v for k, v in r.items() if k != "unchanged"})
        assert "TP=2" in r["layout"] and "EP=2" in r["layout"], r["layout"]
        assert r["grad/logprob_diff"] < 1e-5, r
        assert r["grad/diff"] < 1e-5 * max(1.0, r["grad/scale"]), r
        assert r["same_tokens"] and r["sampler_logprob_diff"] < 1e-5, r
        assert r["score_diff"] < 1e-5, r
        assert not r["sampled_routing"]
        assert r["experts"] == 2 * 2 * 2  # 2 layers x 2 local experts x fc1/fc2
        # 2 steps of 8 rollouts route hundreds of tokens to each of the 4 experts
        assert r["unchanged"] == [], r["unchanged"]
        assert r["replicated_equal_over_tp"], r  # norms and routers: summed gradients over TP
        assert r["teacher_moved"] == []
        for step in r["steps"]:
            assert step["moe/load_balancing_loss"] > 0 and step["moe/z_loss"] > 0, step
            assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]), step


def test_plan_counts_expert_params_per_rank_divided_by_ep() -> None:
    from megatron_gndpo.plan import estimate_memory, format_model_plan, plan, stage_expert_params

    cfg = load_config(EXAMPLE, ["model.num_layers=4", "model.moe_layer_pattern=[1,0,1,0]"])
    model = cfg.model
    experts_ep1 = stage_expert_params(model, ParallelLayout(2), 0)
    experts_ep2 = stage_expert_params(model, ParallelLayout(2, ep=2), 0)
    # 2 MoE layers x 4 experts x (fc1 2x64x64 + fc2 64x64), halved at EP=2
    assert experts_ep1 == 2 * 4 * (2 * 64 * 64 + 64 * 64) == 2 * experts_ep2
    student, _ = plan(cfg, 2)
    assert student.stages[0].expert_params_per_rank == experts_ep2
    text = format_model_plan(student)
    assert "EP=2 EDP=1" in text and "experts/rank" in text and "EP group of rank 0" in text
    # memory: weights and grads of this rank's experts only; their optimizer state over EDP
    (row,) = estimate_memory(cfg, 2)
    dense = student.stages[0].params_per_rank - experts_ep2
    assert row.weights == student.stages[0].params_per_rank * 4  # fp32
    assert row.optimizer == dense * 8 / 2 + experts_ep2 * 8 / 1
