"""Built-in rollouts: sampling rules, KV-cached generation at any layout, sampler log-probs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.rollout.base import RowStreams, SamplingParams, sample_next
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 90
PAD = 0
MODEL = tiny_model(vocab_size=VOCAB, max_position_embeddings=48)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]


def test_sample_next_rules() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    streams = RowStreams([0, 1], samples_per_prompt=1)
    g = streams.uniform
    ids, logp = sample_next(logits, SamplingParams(max_new_tokens=1, temperature=0), g())
    assert ids.tolist() == [3, 0] and torch.all(logp == 0)
    for _ in range(20):  # top-k=1 is greedy whatever the temperature
        ids, logp = sample_next(logits, SamplingParams(max_new_tokens=1, top_k=1), g())
        assert ids.tolist() == [3, 0]
        assert torch.allclose(logp, torch.zeros(2))
    # top-p keeps the smallest prefix reaching p: with p tiny only the best token survives
    ids, _ = sample_next(logits, SamplingParams(max_new_tokens=1, top_p=1e-6), g())
    assert ids.tolist() == [3, 0]
    # log-probs are those of the tempered distribution
    params = SamplingParams(max_new_tokens=1, temperature=2.0)
    ids, logp = sample_next(logits, params, g())
    expected = (logits / 2.0).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected)
    # inverse-CDF sampling follows the distribution: frequencies over many independent rows
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    many = RowStreams(list(range(4000)), samples_per_prompt=1).uniform()
    ids, _ = sample_next(probs.log().expand(4000, -1), SamplingParams(max_new_tokens=1), many)
    freq = torch.bincount(ids, minlength=4).double() / 4000
    assert torch.allclose(freq, probs[0].double(), atol=0.03), freq
    # a row's draws depend only on its own seed, not on the batch around it
    alone = RowStreams([11], 2).uniform()
    together = RowStreams([5, 11], 2).uniform()
    assert torch.equal(alone, together[2:])
    # draws(n) is each row's next n draws of uniform(), all at once
    one_by_one, at_once = RowStreams([3, 4], 2), RowStreams([3, 4], 2).draws(5)
    assert torch.equal(torch.stack([one_by_one.uniform() for _ in range(5)], 1), at_once)


def _greedy_reference(model, prompt: list[int], steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.tensor([seq])
            logits = model(x, torch.arange(len(seq)).unsqueeze(0), None)[0, -1, :VOCAB]
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def _generate_at_layouts(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_gndpo.engine.scoring import broadcast_from_last_stage, score_tokens
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    student = build_student_groups(ParallelLayout(world, tp=2), seed=5)
    torch.manual_seed(0)
    save_checkpoint(root, 0, build_teacher(MODEL, ParallelConfig(tensor_parallel=2), student))
    ref_groups = build_groups(ParallelLayout(world), name="reference")
    reference = build_teacher(MODEL, ParallelConfig(), ref_groups)
    load_checkpoint(root, reference)
    out: dict[str, object] = {
        "reference": [_greedy_reference(reference, p, 6) for p in PROMPTS],
    }
    layouts = {
        "tp1": (ref_groups, ParallelConfig(), reference),
        "tp2": (student, ParallelConfig(tensor_parallel=2), None),
        "pp2": (build_groups(ParallelLayout(world, pp=2), name="pp2"), ParallelConfig(
            pipeline_parallel=2), None),
        "tp2pp2": (build_groups(ParallelLayout(world, tp=2, pp=2), name="tp2pp2"),
                   ParallelConfig(tensor_parallel=2, pipeline_parallel=2), None),
    }  # fmt: skip
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=7, temperature=1.0, samples_per_prompt=2)
    # an eighth of the vocabulary stops a row: rows finish at different steps, some not at all
    stopping = dataclasses.replace(sampled, stop_token_ids=tuple(range(30, 42)))
    for name, (groups, parallel, model) in layouts.items():
        if model is None:
            model = build_teacher(MODEL, parallel, groups)
            load_checkpoint(root, model)
        gen = MegatronGenerator(model, groups, vocab_size=VOCAB, pad_id=PAD, max_sequence_length=48)
        g = gen.generate(PROMPTS, greedy, seeds=[1, 2, 3])
        out[f"{name}/greedy"] = [
            g.tokens[i, g.prompt_lengths[i] : g.lengths[i]].tolist() for i in range(len(PROMPTS))
        ]
        r = gen.generate(PROMPTS, sampled, seeds=[7, 8, 9])
        again = gen.generate(PROMPTS, sampled, seeds=[7, 8, 9])
        assert torch.equal(r.tokens, again.tokens), "same seed must give the same samples"
        # The trainer's recomputed log-probs equal the sampler's (same weights): gap ~ 0
        scored = score_tokens(
            model, groups, r.tokens, r.lengths, head=TokenLogProbs(VOCAB), token_budget=64
        )
        scored = broadcast_from_last_stage(scored, r.tokens.shape, groups)
        mask = r.response_mask
        out[f"{name}/gap"] = float((scored - r.sampler_logprobs)[mask].abs().max())
        out[f"{name}/rollout"] = r
        # megatron's static path (all rows in lock-step) and the lean decoder with two rows at a
        # time (finished rows' slots refilled) sample the same rows
        static = MegatronGenerator(
            model, groups, vocab_size=VOCAB, pad_id=PAD, max_sequence_length=48, decoder="megatron"
        )
        two_rows = MegatronGenerator(
            model, groups, vocab_size=VOCAB, pad_id=PAD, max_sequence_length=48, max_batch_rows=2
        )
        out[f"{name}/stopping"] = {
            "lean": gen.generate(PROMPTS, stopping, seeds=[4, 5, 6]),
            "static": static.generate(PROMPTS, stopping, seeds=[4, 5, 6]),
            "two rows": two_rows.generate(PROMPTS, stopping, seeds=[4, 5, 6]),
            "static greedy": static.generate(PROMPTS, greedy, seeds=[1, 2, 3]),
        }
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_kv_cached_generation_equal_across_layouts(tmp_path: Path) -> None:
    results = run_distributed(_generate_at_layouts, 4, args=(str(tmp_path / "m"),), timeout_s=400)
    for res in results:
        for name in ("tp1", "tp2", "pp2", "tp2pp2"):
            # KV-cached greedy decoding equals full recomputation at every layout
            assert res[f"{name}/greedy"] == res["reference"], name
            assert res[f"{name}/gap"] < 1e-4, (name, res[f"{name}/gap"])
            r = res[f"{name}/rollout"]
            assert r.tokens.shape[0] == 2 * len(PROMPTS)
            assert r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
            assert torch.all(r.response_lengths >= 1) and torch.all(r.response_lengths <= 7)
            assert torch.equal(r.response_mask.sum(-1), r.response_lengths)
            for i in range(r.tokens.shape[0]):
                assert torch.all(r.tokens[i, r.lengths[i] :] == PAD)
                n = int(r.prompt_lengths[i])
                assert r.tokens[i, :n].tolist() == PROMPTS[int(r.prompt_index[i])]
            runs = res[f"{name}/stopping"]
            greedy = runs["static greedy"]
            assert [
                greedy.tokens[i, greedy.prompt_lengths[i] : greedy.lengths[i]].tolist()
                for i in range(len(PROMPTS))
            ] == res["reference"], name
            lean = runs["lean"]
            assert bool(lean.finished.any()) and not bool(lean.finished.all()), lean.finished
            for other in ("static", "two rows"):
                run = runs[other]
                assert torch.equal(run.tokens, lean.tokens), (name, other)
                assert torch.equal(run.lengths, lean.lengths) and torch.equal(
                    run.finished, lean.finished
                ), (name, other)
                torch.testing.assert_close(
                    run.sampler_logprobs, lean.sampler_logprobs, rtol=0, atol=1e-5
                )


# -------------------------------------------------------------------------------------------
# One process: a row's sample does not depend on its batch; a decode step's work does not grow
# with the cached length (beyond the attention itself).


def _work_per_op(generator, prompts: list[list[int]], new_tokens: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Elements each aten op (not views, not in-place writes, not attention) produces in a
    ``generate`` of ``new_tokens`` tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket)
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            # an in-place write returns its whole destination (the cache): not work done
            skip = func.is_view or func._schema.is_mutable or "attention" in name
            if inputs and not skip:
                outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
                counts[name] = counts.get(name, 0) + sum(o.numel() for o in outputs)
            return out

    with Count():
        generator.generate(prompts, SamplingParams(max_new_tokens=new_tokens), seeds=[1, 2])
    return counts


def _one_process_checks(rank: int, world: int) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    groups = build_student_groups(ParallelLayout(world), seed=3)
    torch.manual_seed(0)
    model = build_teacher(MODEL, ParallelConfig(), groups)
    gen = MegatronGenerator(model, groups, vocab_size=VOCAB, pad_id=PAD, max_sequence_length=48)
    params = SamplingParams(max_new_tokens=7, samples_per_prompt=2)
    alone = gen.generate(PROMPTS[1:2], params, seeds=[8])
    together = gen.generate(PROMPTS, params, seeds=[7, 8, 9])
    # equal prompt lengths: no attention mask, every decode step has the same shapes
    prompts = [[5, 6, 7], [8, 9, 10]]
    work = {n: _work_per_op(gen, prompts, n) for n in (4, 8, 12)}
    # a model the lean decoder does not cover takes megatron's static path, with the same draws
    lean = gen.generate(PROMPTS, params, seeds=[7, 8, 9])
    model.config.apply_query_key_layer_scaling = True  # (SDPAttention ignores it)
    fallback = MegatronGenerator(model, groups, vocab_size=VOCAB, pad_id=PAD,
                                 max_sequence_length=48)  # fmt: skip
    uncovered = fallback.generate(PROMPTS, params, seeds=[7, 8, 9])
    return {"alone": alone, "together": together, "work": work, "lean": lean,
            "uncovered": uncovered, "fallback_decoder": fallback.decoder}  # fmt: skip


@pytest.fixture(scope="module")
def one_process() -> dict[str, object]:
    return run_distributed(_one_process_checks, 1, timeout_s=300)[0]  # type: ignore[no-any-return]


@pytest.mark.distributed
@pytest.mark.megatron
def test_row_samples_do_not_depend_on_the_batch(one_process: dict[str, Any]) -> None:
    # prompt 1 (6 tokens) alone and beside a 2-token prompt: the same samples (its own draws)
    alone, together = one_process["alone"], one_process["together"]
    rows = together.prompt_index == 1
    width = int(alone.lengths.max())
    assert torch.equal(together.lengths[rows], alone.lengths)
    assert torch.equal(together.tokens[rows][:, :width], alone.tokens)
    torch.testing.assert_close(together.sampler_logprobs[rows][:, :width], alone.sampler_logprobs)


@pytest.mark.distributed
@pytest.mark.megatron
def test_decode_step_work_does_not_grow_with_the_cache(one_process: dict[str, Any]) -> None:
    # going from 4 to 8 new tokens costs what going from 8 to 12 does, op by op (a cache
    # re-rotated at every step makes each step cost more than the one before)
    work = one_process["work"]
    grown = {
        op: (work[8].get(op, 0) - work[4].get(op, 0), work[12].get(op, 0) - work[8].get(op, 0))
        for op in set(work[4]) | set(work[8]) | set(work[12])
    }
    assert {op: d for op, d in grown.items() if d[0] != d[1]} == {}


@pytest.mark.distributed
@pytest.mark.megatron
def test_uncovered_model_falls_back_to_megatrons_static_path(one_process: dict[str, Any]) -> None:
    assert one_process["fallback_decoder"] == "megatron"
    lean, uncovered = one_process["lean"], one_process["uncovered"]
    assert torch.equal(lean.tokens, uncovered.tokens)
    torch.testing.assert_close(lean.sampler_logprobs, uncovered.sampler_logprobs, rtol=0, atol=1e-5)


def test_decode_gemm_path_by_host_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN with a packed weight, except below 8 rows on an Intel CPU (MKL's GEMMs are faster
    there); both paths compute the same linear."""
    from megatron_gndpo.rollout import decode

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    weight, x = torch.randn(96, 64), torch.randn(4, 64)
    for intel, packed_rows in ((True, (8, 16)), (False, (1, 4, 8, 16))):
        monkeypatch.setattr(decode, "_intel_cpu", lambda intel=intel: intel)
        for rows in (1, 4, 8, 16):
            linear = decode._Linear.plain(weight, rows)
            assert (linear.packed is not None) == (rows in packed_rows), (intel, rows)
            torch.testing.assert_close(linear(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert decode._onednn(weight.bfloat16(), 16) is False  # fp32 only
