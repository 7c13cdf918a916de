"""Sequence parallelism on CPU: TP=2 with ``sequence_parallel=true`` against TP=1.

megatron's local spec (no Apex, no Transformer Engine) builds torch norms, which refuse sequence
parallelism; ``compat/cpu.py`` builds them anyway and marks their parameters as Apex's and TE's
norms are marked. One 2-rank launch (``_sp_checks``) holds, with the same weights at TP=1 and at
TP=2 + SP (RMSNorm, q/k norms, QKV bias, SwiGLU):

- logits, and the gradients of one forward/backward through the fused log-prob head, megatron's
  DDP and ``finalize_model_grads``: every norm's gradient (q/k norms included) is each TP rank's
  half of the sequence until finalize sums it over TP; then both ranks hold TP=1's;
- ``score_batch``, padded and packed, on ragged rows of odd lengths; also by a teacher at TP=2 +
  SP on its own groups;
- the built-in generator, lean decoder and megatron's static path: TP=1's tokens.

A second launch (``_trainer_checks``) trains ``examples/tiny_cpu.yaml`` at TP=2 + SP through the
real Trainer (scoring, the update, the generator): every student weight moves, and the weights
that TP replicates (norms) stay identical on both TP ranks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.config.schema import ParallelConfig
from tests.harness import run_distributed
from tests.tiny import copy_tp_shards, tiny_model

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

VOCAB = 120
MODEL = tiny_model(hidden_size=64, ffn_hidden_size=128, vocab_size=VOCAB, qk_layernorm=True,
                   add_qkv_bias=True)  # fmt: skip
LENGTHS = [5, 17, 9, 2, 17, 11]  # odd widths: a micro-batch is padded to a multiple of TP


def _ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=g)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
    return tokens, torch.tensor(LENGTHS)


def _gathered(logits: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(logits) for _ in range(group.size())]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _expected_grad(full: torch.Tensor, param: torch.nn.Parameter, name: str, rank: int) -> Any:
    """This TP rank's slice of the TP=1 gradient (SwiGLU's fc1 holds a slice of both halves)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if "linear_fc1" in name:
        return torch.cat([h.chunk(2, dim)[rank] for h in full.chunk(2, 0)])
    return full.chunk(2, dim)[rank]


def _sp_checks(rank: int, world: int) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron.core.distributed import finalize_model_grads

    from megatron_gndpo.engine.optimizer import wrap_ddp
    from megatron_gndpo.engine.scoring import score_batch
    from megatron_gndpo.models.gpt import build_gpt, build_teacher
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups

    student = build_student_groups(ParallelLayout(world, tp=2), seed=1234)
    reference_groups = build_groups(ParallelLayout(world), name="reference")
    tp_rank = student.coords["tp"]
    torch.manual_seed(0)
    ref = build_gpt(MODEL, ParallelConfig(), reference_groups)
    sp = build_gpt(MODEL, ParallelConfig(tensor_parallel=2, sequence_parallel=True), student)
    copy_tp_shards(ref, sp, tp=2, rank=tp_rank, swiglu=MODEL.swiglu)
    out: dict[str, Any] = {
        "marked": sorted(
            n for n, p in sp.named_parameters() if getattr(p, "sequence_parallel", False)
        )
    }

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(24).expand_as(tokens)
    with torch.no_grad():
        logits_ref = ref(tokens, positions, None)[..., :VOCAB]
        logits_sp = _gathered(sp(tokens, positions, None), student.tp)[..., :VOCAB]
    out["logit_diff"] = (logits_ref - logits_sp).abs().max().item()

    # one forward/backward through the log-prob head; the SP model through megatron's DDP
    head = TokenLogProbs(vocab_size=VOCAB, chunk_tokens=7)
    targets = torch.roll(tokens, -1, dims=1)
    weights = torch.randn(2, 24, generator=torch.Generator().manual_seed(6))
    ddp = wrap_ddp(sp, use_distributed_optimizer=False)
    logp = {}
    for name, net in (("ref", ref), ("sp", ddp)):
        lp = net(tokens, positions, None, output_processor=head, output_processor_context=targets)
        (lp * weights).sum().backward()
        logp[name] = lp.detach()
    out["logprob_diff"] = (logp["ref"] - logp["sp"]).abs().max().item()
    ref_grads = dict(ref.named_parameters())
    norms = [n for n, p in sp.named_parameters() if "layernorm" in n]
    partial = {n: p.main_grad.clone() for n, p in sp.named_parameters() if n in norms}
    finalize_model_grads([ddp])
    worst, worst_norm, partial_norm = 0.0, 0.0, 0.0
    for name, param in sp.named_parameters():
        expected = _expected_grad(ref_grads[name].grad, param, name, tp_rank)
        diff = (param.main_grad - expected).abs().max().item()
        worst = max(worst, diff)
        if name in norms:
            worst_norm = max(worst_norm, diff)
            partial_norm = max(partial_norm, (partial[name] - expected).abs().max().item())
    out["grad_diff"], out["norm_grad_diff"] = worst, worst_norm
    out["partial_norm_grad_diff"] = partial_norm  # before finalize: this rank's half only
    out["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
    mine = torch.cat([sp.get_parameter(n).main_grad.flatten() for n in norms])
    theirs = _gathered(mine[None], student.tp).view(2, -1)
    out["norm_grads_equal_over_tp"] = bool(torch.equal(theirs[0], theirs[1]))
    out["norms"] = norms

    # a teacher at TP=2 + SP on its own groups (no global state) scores like the student
    teacher_groups = build_groups(ParallelLayout(world, tp=2), name="teacher")
    teacher = build_teacher(
        MODEL, ParallelConfig(tensor_parallel=2, sequence_parallel=True), teacher_groups
    )
    teacher.load_state_dict(sp.state_dict())
    ragged, lengths = _ragged_batch()
    for pack in (False, True):
        scores = {}
        for name, net, g in (("ref", ref, reference_groups), ("sp", ddp, student),
                             ("teacher", teacher, teacher_groups)):  # fmt: skip
            s = score_batch(net, g, ragged, lengths, head=head, token_budget=40, pack=pack)
            assert s is not None
            scores[name] = s.logprobs
        key = "packed" if pack else "padded"
        out[f"score_{key}_diff"] = max(
            (scores["ref"] - scores[name]).abs().max().item() for name in ("sp", "teacher")
        )
    out |= _generator_checks(ref, reference_groups, ddp, student)
    out["sp_restored"] = bool(sp.config.sequence_parallel)
    with torch.no_grad():
        again = _gathered(sp(tokens, positions, None), student.tp)[..., :VOCAB]
    out["logit_diff_after_generate"] = (logits_ref - again).abs().max().item()
    return out


def _generator_checks(ref: Any, ref_groups: Any, sp: Any, groups: Any) -> dict[str, Any]:
    """TP=1 and TP=2 + SP sample the same tokens, on either decoding path."""
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12]]  # the lock-step path prefills 3, then one a step
    params = SamplingParams(max_new_tokens=5, samples_per_prompt=2)
    out: dict[str, Any] = {}
    for decoder in ("lean", "megatron"):
        rollouts = {}
        for name, net, g in (("ref", ref, ref_groups), ("sp", sp, groups)):
            gen = MegatronGenerator(net, g, vocab_size=VOCAB, pad_id=0, max_sequence_length=64,
                                    decoder=decoder)  # fmt: skip
            rollouts[name] = gen.generate(prompts, params, seeds=[11, 12])
            out[f"{decoder}/{name}_decoder"] = gen.decoder
        a, b = rollouts["ref"], rollouts["sp"]
        out[f"{decoder}/same_tokens"] = bool(torch.equal(a.tokens, b.tokens))
        diff = (a.sampler_logprobs - b.sampler_logprobs).abs().max().item()
        out[f"{decoder}/logprob_diff"] = diff
    return out


def test_tp2_sequence_parallel_equals_tp1() -> None:
    for r in run_distributed(_sp_checks, 2, timeout_s=240):
        print({k: v for k, v in r.items() if k not in ("marked", "norms")})
        # every norm (input, pre-MLP, q/k, final) and only the norms are marked
        assert r["marked"] == sorted(r["norms"]) and len(r["norms"]) == 2 * 4 + 1, r["marked"]
        assert r["logit_diff"] < 1e-5 and r["logprob_diff"] < 1e-5, r
        tol = 1e-5 * max(1.0, r["grad_scale"])
        assert r["grad_diff"] < tol and r["norm_grad_diff"] < tol, r
        assert r["partial_norm_grad_diff"] > 100 * tol, r  # the TP sum was needed
        assert r["norm_grads_equal_over_tp"], r
        assert r["score_padded_diff"] < 1e-5 and r["score_packed_diff"] < 1e-5, r
        for decoder in ("lean", "megatron"):
            assert r[f"{decoder}/sp_decoder"] == decoder, r  # SP needs no fallback
            assert r[f"{decoder}/same_tokens"], r
            assert r[f"{decoder}/logprob_diff"] < 1e-5, r
        assert r["sp_restored"] and r["logit_diff_after_generate"] < 1e-5, r


def _trainer_checks(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from tests.trainers import snapshot, tiny_trainer

    trainer = tiny_trainer(run_dir, "parallel.tensor_parallel=2", "parallel.sequence_parallel=true")
    student = trainer.c.student
    before = snapshot(student)
    steps = [trainer.step() for _ in range(2)]
    replicated = [n for n, p in student.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False)]  # fmt: skip
    flat = torch.cat([student.get_parameter(n).detach().flatten() for n in replicated])
    tp_group = trainer.c.student_groups.tp
    both = [torch.empty_like(flat) for _ in range(tp_group.size())]
    torch.distributed.all_gather(both, flat, group=tp_group)
    out = {
        "losses": [s["loss"] for s in steps],
        "grad_norms": [s["grad_norm"] for s in steps],
        "unchanged": [n for n, p in student.named_parameters() if torch.equal(p, before[n])],
        "replicated_equal_over_tp": all(torch.equal(both[0], x) for x in both),
        "replicated": len(replicated),
    }
    trainer.c.logger.close()
    return out


def test_tiny_example_trains_at_tp2_with_sequence_parallelism(tmp_path: Path) -> None:
    for r in run_distributed(_trainer_checks, 2, args=(str(tmp_path),), timeout_s=300):
        print(r)
        assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"]), r
        assert r["unchanged"] == [], r
        assert r["replicated"] > 0 and r["replicated_equal_over_tp"], r
