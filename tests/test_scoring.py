"""Scoring across the pipeline: the same log-probs at TP=1, TP=2, PP=2, TP2xPP2, padded or packed.

One 4-rank launch: a model saved once at TP=2 with dist-checkpointing is loaded into models of
other layouts built on the same world (the way the teacher loads a checkpoint saved at another
TP/PP); a TP=1 copy gives the float64 reference from full logits, and every layout scores the
same ragged batch through the fused log-prob head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.engine.scoring import plan_packed, plan_padded
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 100
MODEL = tiny_model(num_layers=4, vocab_size=VOCAB, add_qkv_bias=True)
LENGTHS = [5, 17, 9, 2, 17, 11]


def test_plans_cover_every_row_once_within_budget() -> None:
    lengths = [5, 17, 9, 2, 17, 11, 40, 1]
    for plan in (plan_padded, plan_packed):
        for budget in (1, 16, 34, 64, 1000):
            batches = plan(lengths, budget)
            rows = sorted(r for b in batches for r in b)
            assert rows == list(range(len(lengths)))
            for b in batches:
                if len(b) > 1:
                    cost = (
                        len(b) * max(lengths[r] for r in b)
                        if plan is plan_padded
                        else sum(lengths[r] for r in b)
                    )
                    assert cost <= budget
    assert len(plan_padded(lengths, 1000)) == 1
    with pytest.raises(ValueError, match="token_budget"):
        plan_padded(lengths, 0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=g)
    lengths = torch.tensor(LENGTHS)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
    return tokens, lengths


def _reference_logprobs(model, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    with torch.no_grad():
        for row, n in enumerate(lengths.tolist()):
            seq = tokens[row : row + 1, :n]
            logits = model(seq, torch.arange(n).unsqueeze(0), None)[0, :, :VOCAB].double()
            logp = logits.log_softmax(-1)[:-1].gather(-1, seq[0, 1:].unsqueeze(-1)).squeeze(-1)
            out[row, 1:n] = logp
    return out


def _score_at_layouts(rank: int, world: int, root: str) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_gndpo.engine.scoring import broadcast_from_last_stage, score_tokens
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.parallel.groups import ParallelLayout, build_groups, build_student_groups

    tokens, lengths = _batch()
    head = TokenLogProbs(vocab_size=VOCAB, chunk_tokens=7)

    # Only the student's layout (megatron's global parallel state) writes checkpoints: the
    # replica ids of a saved tensor come from the global state.
    student = build_student_groups(ParallelLayout(world, tp=2), seed=11)
    torch.manual_seed(0)
    save_checkpoint(root, 0, build_teacher(MODEL, ParallelConfig(tensor_parallel=2), student))
    reference_groups = build_groups(ParallelLayout(world), name="reference")
    reference = build_teacher(MODEL, ParallelConfig(), reference_groups)
    load_checkpoint(root, reference)
    expected = _reference_logprobs(reference, tokens, lengths)

    results: dict[str, object] = {"expected": expected}
    layouts = {
        "tp2": (student, ParallelConfig(tensor_parallel=2)),
        "pp2": (
            build_groups(ParallelLayout(world, pp=2), name="pp2"),
            ParallelConfig(pipeline_parallel=2),
        ),
        "tp2pp2": (
            build_groups(ParallelLayout(world, tp=2, pp=2), name="tp2pp2"),
            ParallelConfig(tensor_parallel=2, pipeline_parallel=2),
        ),
    }
    for name, (groups, parallel) in layouts.items():
        model = build_teacher(MODEL, parallel, groups)
        load_checkpoint(root, model)
        for pack in (False, True):
            got = score_tokens(
                model, groups, tokens, lengths, head=head, token_budget=24, pack=pack
            )
            got = broadcast_from_last_stage(got, tokens.shape, groups)
            results[f"{name}/{'packed' if pack else 'padded'}"] = got
    return results


@pytest.mark.distributed
@pytest.mark.megatron
def test_scoring_equal_across_layouts_padded_and_packed(tmp_path: Path) -> None:
    results = run_distributed(_score_at_layouts, 4, args=(str(tmp_path / "ref"),), timeout_s=400)
    for rank, result in enumerate(results):
        expected = result["expected"]
        for key, got in result.items():
            if key == "expected":
                continue
            assert got.dtype == torch.float32
            torch.testing.assert_close(
                got.double(), expected, rtol=1e-5, atol=2e-5, msg=f"rank {rank} {key}"
            )
            # position 0 and padding carry exactly 0
            for row, n in enumerate(LENGTHS):
                assert got[row, 0] == 0 and torch.all(got[row, n:] == 0)
