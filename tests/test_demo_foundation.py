"""The demo's foundation: chains task, tokenizer, SFT on megatron, greedy accuracy, model cache."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from megatron_gndpo.data.tasks import chains
from megatron_gndpo.rewards.verifiable import extract_answer, reward
from tests.harness import run_distributed
from tests.tiny import tiny_model

# ---------------------------------------------------------------------------- task


def _evaluate_chain(prompt: str) -> tuple[int, list[int]]:
    """The value of "a + b - c = ?" read left to right, and the running totals."""
    words = prompt.removesuffix(" = ?").split()
    total, totals = int(words[0]), []
    for op, operand in zip(words[1::2], words[2::2], strict=True):
        total = total + int(operand) if op == "+" else total - int(operand)
        totals.append(total)
    return total, totals


@pytest.mark.parametrize("difficulty", range(1, chains.MAX_DIFFICULTY + 1))
def test_chains_are_deterministic_worked_and_verified(difficulty: int) -> None:
    problems = chains.generate(200, seed=7, difficulty=difficulty)
    assert problems == chains.generate(200, seed=7, difficulty=difficulty)
    assert problems != chains.generate(200, seed=8, difficulty=difficulty)
    for p in problems:
        value, totals = _evaluate_chain(p.prompt)
        assert p.answer == str(value) and min(totals) >= 0
        steps = p.solution.split(", ")
        assert len(steps) == difficulty + 1 and steps[-1] == f"so \\boxed{{{value}}}"
        assert [int(s.rsplit(" = ", 1)[1]) for s in steps[:-1]] == totals
        assert reward(p.solution, p.answer) == 1.0
        assert reward(p.solution, str(value + 1)) == 0.0


def test_chains_splits_and_errors() -> None:
    train, held_out = chains.split("train"), chains.split("eval")
    assert (len(train), len(held_out)) == (chains.TRAIN_SIZE, chains.EVAL_SIZE)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert len({p.prompt for p in held_out}) == len(held_out)
    assert chains.prompt_examples("eval") == [(p.prompt, p.answer) for p in held_out]
    with pytest.raises(ValueError, match="number of operations"):
        chains.generate(3, difficulty=chains.MAX_DIFFICULTY + 1)
    with pytest.raises(ValueError, match="'train' or 'eval'"):
        chains.split("test")
    with pytest.raises(ValueError, match="too few distinct"):
        chains.held_out(200, seed=1, difficulty=1, exclude=set())


# ---------------------------------------------------------------------------- tokenizer


def _corpus(n: int = 2000) -> list[chains.Problem]:
    return chains.generate(n, seed=3, difficulty=chains.DEFAULT_DIFFICULTY)


def test_tokenizer_round_trips_and_is_cached(tmp_path: Path) -> None:
    from megatron_gndpo.demo.tokenizer import MODEL_FILE, task_corpus, train_tokenizer

    problems = _corpus()
    corpus = task_corpus((p.prompt, p.solution) for p in problems)
    tok = train_tokenizer(tmp_path, corpus)
    assert 64 <= tok.vocab_size <= 160 and tok.eos_id == 2 and tok.pad_id == 0
    for p in chains.generate(100, seed=4):  # other problems than the corpus
        assert tok.decode(tok.encode(p.solution)) == p.solution
        prompt = tok.apply_chat_template(p.prompt)
        ids = [*prompt, *tok.encode(p.solution), tok.eos_id]
        response = tok.decode(ids[len(prompt) :])
        assert response == p.solution and reward(response, p.answer) == 1.0
        assert tok.decode(ids) == f"Q: {p.prompt} A: {p.solution}"  # newline -> space
    # every number is one piece: the worked solution is 6 tokens a step + 5
    lengths = {len(tok.encode(p.solution)) for p in problems}
    assert lengths == {6 * chains.DEFAULT_DIFFICULTY + 5}

    model = tmp_path / MODEL_FILE
    stamp = model.stat().st_mtime_ns
    again = train_tokenizer(tmp_path, corpus)
    assert model.stat().st_mtime_ns == stamp and again.fingerprint() == tok.fingerprint()
    train_tokenizer(tmp_path, corpus[:1000])  # another corpus: retrained in place
    assert model.stat().st_mtime_ns != stamp


# ---------------------------------------------------------------------------- SFT batches


def test_sft_micro_batch_masks_the_response_only() -> None:
    import torch

    from megatron_gndpo.data.tokenizer import CharTokenizer
    from megatron_gndpo.sft import encode_sft, micro_batch

    tok = CharTokenizer()
    seqs = encode_sft(tok, [("1 + 2 = ?", "3"), ("10 - 1 = ?", "9 ok")])
    assert seqs[0].tokens[-1] == tok.eos_id
    mb = micro_batch(seqs, tok.pad_id)
    for row, s in enumerate(seqs):
        positions = mb["mask"][row].nonzero().flatten().tolist()
        # the head at t predicts t + 1: the positions of the response tokens' predecessors
        assert positions == list(range(s.prompt_length - 1, len(s.tokens) - 1))
        targets = mb["targets"][row, positions].tolist()
        assert targets == list(s.tokens[s.prompt_length :])
    assert tok.decode(mb["targets"][1, mb["mask"][1]].tolist()) == "9 ok"
    # under sequence parallelism the width is a multiple of TP; the padding is outside the mask
    wide = micro_batch(seqs, tok.pad_id, multiple=4)
    width = mb["tokens"].shape[1]
    assert wide["tokens"].shape[1] % 4 == 0 and wide["tokens"].shape[1] >= width
    assert torch.equal(wide["mask"][:, :width], mb["mask"]) and not wide["mask"][:, width:].any()


# ---------------------------------------------------------------------------- on megatron


def _tiny_recipe(steps: int, batch: int, micro: int):  # type: ignore[no-untyped-def]
    from megatron_gndpo.config.schema import OptimizerConfig
    from megatron_gndpo.demo.models import Recipe

    model = tiny_model(vocab_size=128, num_query_groups=None)
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=2, weight_decay=0.0)
    return Recipe("tiny", model, optimizer, steps, batch, micro, seed=5)


def _world(world: int, tp: int = 1, pp: int = 1):  # type: ignore[no-untyped-def]
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    return build_student_groups(ParallelLayout(world, tp=tp, pp=pp), seed=0)


def _tiny_task(cache: str):  # type: ignore[no-untyped-def]
    from megatron_gndpo.demo.models import DemoTask
    from megatron_gndpo.demo.tokenizer import task_corpus, train_tokenizer

    problems = _corpus()
    corpus = task_corpus((p.prompt, p.solution) for p in problems)
    tok = train_tokenizer(Path(cache) / "tokenizer", corpus)
    return DemoTask(difficulty=3, tokenizer=tok, sft=problems[16:], eval=problems[:16])


def _sft(
    groups: Any, task: Any, steps: int, batch: int, micro: int, init: str | None = None
) -> tuple[Any, list[dict[str, float]]]:
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.sft import encode_sft, sft_train

    tok, recipe = task.tokenizer, _tiny_recipe(steps, batch, micro)
    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    return sft_train(
        recipe.model, parallel, groups,
        encode_sft(tok, [(p.prompt, p.solution) for p in task.sft]),
        optimizer=recipe.optimizer, steps=steps, batch_size=batch, micro_batch_size=micro,
        seed=recipe.seed, vocab_size=tok.vocab_size, pad_id=tok.pad_id, init=init,
    )  # fmt: skip


def _losses_and_norms(history: list[dict[str, float]]) -> list[float]:
    return [h["loss"] for h in history] + [h["grad_norm"] for h in history]


def _sft_layouts(rank: int, world: int, cache: str) -> dict[str, list[float]]:
    """A few SFT steps at DP=2, TP=2 and PP=2 from the initial weights in CACHE/init."""
    from megatron.core import parallel_state

    out = {}
    for name, tp, pp in (("dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        groups = _world(world, tp=tp, pp=pp)
        _, history = _sft(groups, _tiny_task(cache), 4, 8, 2, init=f"{cache}/init")
        out[name] = _losses_and_norms(history)
        parallel_state.destroy_model_parallel()
    return out


def _sft_and_evaluate(rank: int, world: int, cache: str) -> dict:
    from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.demo import models
    from megatron_gndpo.demo.evaluate import greedy_accuracy, greedy_texts
    from megatron_gndpo.models.gpt import build_gpt

    groups, task = _world(world), _tiny_task(cache)
    tok = task.tokenizer
    save_checkpoint(
        f"{cache}/init", 0, build_gpt(_tiny_recipe(1, 1, 1).model, ParallelConfig(), groups)
    )
    _, layout_reference = _sft(groups, task, 4, 8, 2, init=f"{cache}/init")
    trained, history = _sft(groups, task, steps=40, batch=16, micro=8)
    model = trained.model
    texts = greedy_texts(model, groups, tok, [p.prompt for p in task.eval], max_new_tokens=30)
    # Half the references are what the model answered, half can never match: a known accuracy.
    examples = [
        dataclasses.replace(p, answer=(extract_answer(t) or "none") if i % 2 else "never")
        for i, (p, t) in enumerate(zip(task.eval, texts, strict=True))
    ]
    by_hand = sum(reward(t, e.answer) for t, e in zip(texts, examples, strict=True)) / len(texts)
    out = {
        "layout_reference": _losses_and_norms(layout_reference),
        "losses": [h["loss"] for h in history],
        "texts": texts,
        "by_hand": by_hand,
        "accuracy": greedy_accuracy(model, groups, tok, examples, max_new_tokens=30),
        "task_accuracy": greedy_accuracy(model, groups, tok, task.eval, max_new_tokens=30),
    }

    # The demo's cache: a recipe is trained once; its checkpoint loads into a fresh model.
    recipe = _tiny_recipe(steps=3, batch=8, micro=8)
    first = models.prepare(cache, recipe, groups, task)
    second = models.prepare(cache, recipe, groups, task)
    reloaded = build_gpt(recipe.model, ParallelConfig(), groups)
    load_checkpoint(first.checkpoint, reloaded)
    out["cache"] = (first, second)
    out["reloaded_accuracy"] = greedy_accuracy(reloaded, groups, tok, task.eval, max_new_tokens=30)
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_sft_at_any_layout_greedy_accuracy_and_model_cache(tmp_path: Path) -> None:
    r = run_distributed(_sft_and_evaluate, 1, args=(str(tmp_path),), timeout_s=300)[0]
    losses = r["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses  # SFT clearly reduces the loss

    assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["task_accuracy"] <= 1.0
    assert r["accuracy"] == pytest.approx(r["by_hand"]) and r["by_hand"] > 0
    assert all(isinstance(t, str) for t in r["texts"])

    first, second = r["cache"]
    assert not first.cached and second.cached
    assert second.checkpoint == first.checkpoint and second.accuracy == first.accuracy
    assert len(first.losses) == 3 and (first.checkpoint / "latest").is_file()
    assert r["reloaded_accuracy"] == first.accuracy  # the checkpoint is the measured model

    # From the same weights, DP=2 (the same global batches), TP=2 and PP=2 give the losses and
    # gradient norms of DP=1, on every rank (the loss is shared with every pipeline stage)
    layouts = run_distributed(_sft_layouts, 2, args=(str(tmp_path),), timeout_s=300)
    for per_rank in layouts:
        for name, values in per_rank.items():
            assert values == pytest.approx(r["layout_reference"], rel=1e-4), name


def _hybrid_teacher_and_pruned_student(rank: int, world: int, cache: str) -> dict:
    from megatron_gndpo.checkpoint.convert import convert_mcore_to_hf, read_model_config
    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.demo import models

    groups, task = _world(world), _tiny_task(cache)
    tiny = _tiny_recipe(steps=2, batch=8, micro=8)
    recipe = dataclasses.replace(
        tiny, name="tiny_hybrid", model=dataclasses.replace(tiny.model, model_class="hybrid")
    )
    teacher = models.prepare(cache, recipe, groups, task)
    # the cached checkpoint describes itself: the export needs no --model-config
    described = read_model_config(teacher.checkpoint)
    convert_mcore_to_hf(teacher.checkpoint, f"{cache}/hf", family="llama")
    # the pruned student's accuracy is measured on a HybridModel, as it was saved
    prune = models.PruneRecipe("tiny_hybrid_pruned", num_layers=1, calibration_prompts=2)
    student = models.prepare_pruned(cache, teacher, task, groups, prune)
    frozen = load_model(teacher.checkpoint, groups, frozen=True)  # as a teacher loads
    return {
        "frozen": (
            type(frozen).__name__,
            frozen.training,
            any(p.requires_grad for p in frozen.parameters()),
        ),
        "described": described,
        "model": recipe.model,
        "exported": sorted(p.name for p in Path(f"{cache}/hf").iterdir()),
        "student_class": read_model_config(student.checkpoint).model_class,
        "student_accuracy": student.accuracy,
    }


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_hybrid_demo_teacher_is_described_exported_and_pruned_as_one(tmp_path: Path) -> None:
    r = run_distributed(_hybrid_teacher_and_pruned_student, 1, args=(str(tmp_path),))[0]
    assert r["described"] == r["model"] and r["model"].model_class == "hybrid"
    assert "config.json" in r["exported"] and "model.safetensors" in r["exported"]
    assert r["student_class"] == "hybrid"
    assert 0.0 <= r["student_accuracy"] <= 1.0
    kind, training, trainable = r["frozen"]
    assert "Hybrid" in kind and not training and not trainable
