"""The multimodal demo's model preparation: a pretrained frozen encoder, a VLM teacher and student.

A tiny setting (a few steps each) of ``prepare_multimodal`` into a temporary cache: accuracies
are fractions, the prompt files load and encode, both checkpoints exist and reload into a fresh
VLM, the reloaded encoder equals the pretrained one bitwise (SFT never touched it) while the
trained parts moved away from their initialisation, and a second call reuses the cache.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_gndpo.checkpoint.dist import latest_step
from megatron_gndpo.demo import multimodal as mm
from megatron_gndpo.demo.encoder import EncoderRecipe

pytestmark = [pytest.mark.megatron]

TINY_ENCODER = EncoderRecipe(steps=5, batch_size=16)
TINY_TEACHER = dataclasses.replace(mm.teacher_recipe(quick=True), name="t", steps=3)
TINY_STUDENT = dataclasses.replace(mm.student_recipe(), name="s", steps=2)


def _prepare(cache: Path) -> tuple[mm.PreparedVLM, mm.PreparedVLM, mm.VisualTask]:
    return mm.prepare_multimodal(
        cache, teacher=TINY_TEACHER, student=TINY_STUDENT, encoder=TINY_ENCODER
    )


def test_prepare_multimodal_tiny(tmp_path: Path) -> None:
    from megatron.core import parallel_state

    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.data.images import ImageLayout, encode_multimodal, load_multimodal_prompts
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.parallel.distributed import init_distributed, shutdown_distributed
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    steps: list[tuple[str, int]] = []
    teacher, student, task = mm.prepare_multimodal(
        tmp_path, teacher=TINY_TEACHER, student=TINY_STUDENT, encoder=TINY_ENCODER,
        on_step=lambda name, step, metrics: steps.append((name, step)),
    )  # fmt: skip
    assert steps == [("t", 1), ("t", 2), ("t", 3), ("s", 1), ("s", 2)]
    assert task.encoder is not None and 0.0 <= task.encoder.accuracy <= 1.0
    for prepared, recipe in ((teacher, TINY_TEACHER), (student, TINY_STUDENT)):
        assert 0.0 <= prepared.accuracy <= 1.0 and not prepared.cached
        assert len(prepared.losses) == recipe.steps
        assert all(torch.isfinite(torch.tensor(prepared.losses)))
        assert latest_step(prepared.checkpoint) == recipe.steps
    assert teacher.vision == student.vision  # one image layout: the teacher scores student rows

    # the prompt files hold the task's problems and encode with the placeholder the models use
    examples = load_multimodal_prompts(str(task.train_prompts))
    assert len(examples) == mm.TRAIN_PROMPTS and task.tokenizer_path.is_file()
    row = encode_multimodal(examples[0], task.tokenizer, ImageLayout.of(teacher.vision))
    assert row.ids.count(mm.IMAGE_TOKEN_ID) == teacher.vision.tokens_per_tile
    assert len(row.ids) == task.max_prompt_length
    assert len(load_multimodal_prompts(str(task.eval_prompts))) == mm.EVAL_PROMPTS

    # both reload; the frozen encoder is the pretrained one, bitwise; trained parts moved
    pretrained = task.encoder.state_dict()
    init_distributed()
    try:
        groups = build_student_groups(ParallelLayout(1), seed=0)
        for prepared, recipe in ((teacher, TINY_TEACHER), (student, TINY_STUDENT)):
            model = mm.load_prepared(prepared, groups)
            for name, value in model.vision_model.state_dict().items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, pretrained[name]), name
            assert not any(p.requires_grad for p in model.vision_model.parameters())
            torch.manual_seed(recipe.seed)  # the initialisation SFT started from
            start = build_vlm(recipe.model, recipe.vision, ParallelConfig(), groups)
            moved = [
                n
                for (n, p), (_, q) in zip(
                    model.named_parameters(), start.named_parameters(), strict=True
                )
                if p.requires_grad and not torch.equal(p, q)
            ]
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
            assert moved == trainable
    finally:
        parallel_state.destroy_model_parallel()
        shutdown_distributed()

    again = _prepare(tmp_path)
    assert again[0].cached and again[1].cached
    assert again[0].accuracy == teacher.accuracy and again[1].accuracy == student.accuracy
