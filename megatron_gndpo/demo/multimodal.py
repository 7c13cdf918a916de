"""The multimodal demo's task, VLM teacher and VLM student: trained by SFT, cached on disk.

    teacher, student, task = prepare_multimodal(cache_dir, quick=True)   # student: pruned
    # task.train_prompts / task.eval_prompts -> data.prompts / eval prompts (JSONL + PNGs)
    # task.tokenizer_path -> data.tokenizer;  teacher.vision / student.vision -> VisionConfig
    # teacher.checkpoint -> teacher.load;     student.checkpoint -> checkpoint.init

The task is the built-in visual one (``data/tasks/visual.py``) at difficulty 1: two
seven-segment digits on a 56-pixel canvas, "what is their sum", a worked solution that names the
digits and then adds them. It is the easiest level, and it still cannot be answered without
reading the image. Both models are megatron-core ``LLaVAModel``s (``models/vlm.py``) with the
same image layout (a 28-pixel tile in 7-pixel patches: 16 image tokens) and a frozen random ViT,
as the paper freezes its encoder: the projector and the language model learn to read it.

The tokenizer is the text demo's SentencePiece recipe trained on the visual corpus. The image
placeholder is its ``<unk>`` id (3, ``data/images.py``'s default): with full character coverage
the task's text never produces it, which ``encode_multimodal`` checks on every row.

The prompts the trainer samples are written once as JSONL beside PNG files (lossless, so the
pixels are the ones the models were fine-tuned and measured on) and read back with
``load_multimodal_prompts``. Each model's checkpoint and ``model.json`` (recipe, held-out greedy
accuracy, wall times, losses) go to ``CACHE/NAME/``; a later call with the same recipe and data
reuses them. One process (world size 1), as the text demo.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.checkpoint.load import load_model
from megatron_gndpo.config import to_dict
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.images import (
    ImageLayout,
    MultimodalExample,
    MultimodalRow,
    encode_multimodal,
    load_multimodal_prompts,
)
from megatron_gndpo.data.tasks import visual
from megatron_gndpo.data.tokenizer import SentencePieceTokenizer, Tokenizer
from megatron_gndpo.demo.encoder import EncoderRecipe, PretrainedEncoder, pretrain_encoder
from megatron_gndpo.demo.models import (
    PreparedModel,
    Recipe,
    cache_key,
    describe_task,
    digest,
    language_model,
    load_meta,
    measured,
    pruned_cache_key,
    save_prepared,
    sft_meta,
    sft_optimizer,
    train_recipe,
)
from megatron_gndpo.demo.tokenizer import MODEL_FILE, task_corpus, train_tokenizer
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.sft import VisionFamily, encode_sft_multimodal

DIFFICULTY = 1
# Supervised data: its own seed, apart from the rollout prompts (TRAIN_SEED) and the held-out
# ones (EVAL_SEED). Two digits make only 100 questions; what varies is the drawing (offset,
# stroke, ink), so held-out problems are new pictures of known sums.
SFT_SEED = 2
SFT_PROBLEMS = 6_000
TRAIN_PROMPTS = 256  # as builtin:visual
EVAL_PROMPTS = 64  # as builtin:visual_eval
# The tokenizer's <unk>: never produced on the task's text (checked on every encoded row).
IMAGE_TOKEN_ID = 3

_TASK_DIR = "visual_task"
# Bump when the way a cached model or prompt file is made changes beyond what its key shows.
_CACHE_VERSION = 1


def max_new_tokens() -> int:
    """Generation budget: a worked solution is 17 tokens, then EOS; slack for a wrong one."""
    return 24


# ---------------------------------------------------------------------------------------------
# The task


@dataclasses.dataclass(frozen=True)
class VisualTask:
    """The problems, the prompt files and the tokenizer both models share."""

    difficulty: int
    tokenizer: SentencePieceTokenizer
    tokenizer_path: Path  # data.tokenizer
    train_prompts: Path  # JSONL (image paths): the trainer's prompts
    eval_prompts: Path  # JSONL: held-out problems, never in the supervised data
    sft: list[visual.VisualProblem]
    held_out: list[visual.VisualProblem]  # the problems of eval_prompts
    max_prompt_length: int  # expanded ids (image placeholders included) of the longest prompt
    max_response_length: int  # generation budget (max_new_tokens)
    encoder: PretrainedEncoder | None = None  # the shared frozen encoder, once pretrained

    def describe(self) -> dict[str, Any]:
        return describe_task(
            self.difficulty, self.tokenizer, _digest(self.sft), _file_digest(self.eval_prompts)
        )

    def eval_examples(self) -> list[MultimodalExample]:
        return load_multimodal_prompts(str(self.eval_prompts))


def _digest(problems: Sequence[visual.VisualProblem]) -> str:
    return digest(
        part
        for p in problems
        for part in (f"{p.prompt}\t{p.solution}\t".encode(), p.image.tobytes())
    )


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_visual_task(cache_dir: str | Path, difficulty: int = DIFFICULTY) -> VisualTask:
    """Supervised problems, rollout and held-out prompt files, and the tokenizer (cached)."""
    directory = Path(cache_dir) / _TASK_DIR
    sft = visual.generate(SFT_PROBLEMS, SFT_SEED, difficulty)
    train = visual.generate(TRAIN_PROMPTS, visual.TRAIN_SEED, difficulty)
    held_out = visual.generate(EVAL_PROMPTS, visual.EVAL_SEED, difficulty)
    corpus = task_corpus((p.prompt, p.solution) for p in [*sft, *train, *held_out])
    tokenizer = train_tokenizer(Path(cache_dir) / "visual_tokenizer", corpus)
    train_file = _write_prompts(directory, "train", train)
    eval_file = _write_prompts(directory, "eval", held_out)
    layout = ImageLayout.of(vision_config())
    longest = max(
        len(encode_multimodal(e, tokenizer, layout).ids)
        for e in load_multimodal_prompts(str(eval_file))[:1]
    )
    return VisualTask(
        difficulty=difficulty,
        tokenizer=tokenizer,
        tokenizer_path=Path(cache_dir) / "visual_tokenizer" / MODEL_FILE,
        train_prompts=train_file,
        eval_prompts=eval_file,
        sft=sft,
        held_out=held_out,
        max_prompt_length=longest,  # every prompt has the same text and one image
        max_response_length=max_new_tokens(),
    )


def _write_prompts(directory: Path, split: str, problems: Sequence[visual.VisualProblem]) -> Path:
    """``SPLIT.jsonl`` with one ``{"prompt", "answer", "images"}`` line per problem, each image a
    PNG under ``SPLIT/``; rewritten only when its content changed."""
    lines = []
    for i, p in enumerate(problems):
        record = {"prompt": p.prompt, "answer": p.answer, "images": f"{split}/{i:04d}.png"}
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    stamp = hashlib.sha256(f"{_CACHE_VERSION}\n{text}".encode() + _digest(problems).encode())
    jsonl, marker = directory / f"{split}.jsonl", directory / f"{split}.sha256"
    if jsonl.is_file() and marker.is_file() and marker.read_text() == stamp.hexdigest():
        return jsonl
    shutil.rmtree(directory / split, ignore_errors=True)
    (directory / split).mkdir(parents=True)
    for i, p in enumerate(problems):
        p.image.save(directory / split / f"{i:04d}.png")
    jsonl.write_text(text)
    marker.write_text(stamp.hexdigest())  # written last: marks a complete file set
    return jsonl


# ---------------------------------------------------------------------------------------------
# Recipes


def vision_config(**overrides: Any) -> VisionConfig:
    """The image layout both models share: a 28-pixel tile, 7-pixel patches (16 tokens), a
    frozen 2-layer CLIP-style ViT, a trainable MLP projector."""
    settings: dict[str, Any] = {
        "encoder": "clip",
        "image_size": 28,
        "patch_size": 7,
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 2,
        "image_token_id": IMAGE_TOKEN_ID,
        "freeze_encoder": True,
    }
    return VisionConfig(**{**settings, **overrides})


@dataclasses.dataclass(frozen=True)
class VisionRecipe(Recipe):
    """How one demo VLM is made: a text demo model's recipe (the language model and its
    supervised fine-tuning) and the image encoder and projector."""

    vision: VisionConfig


def teacher_recipe(quick: bool = False) -> VisionRecipe:
    """4 language layers, hidden 128, fine-tuned until it reads the digits reliably.

    ``quick`` trains fewer steps; it is cached under its own name.
    """
    return VisionRecipe(
        name="vlm_teacher_quick" if quick else "vlm_teacher",
        model=language_model(4, 128, 4),
        vision=vision_config(),
        optimizer=sft_optimizer(3e-3, warmup_steps=20),
        # 2 shared CPU cores: 400 steps ~60 s reached held-out 0.80; 200 steps of 64 only 0.55
        steps=450 if quick else 800,
        batch_size=32,
        micro_batch_size=32,
        seed=11,
    )


@dataclasses.dataclass(frozen=True)
class PrunedVisionRecipe:
    """The default VLM student: the teacher with ``num_layers`` of its language model's layers,
    chosen by the KL of their removal on ``calibration`` worked solutions (``prune/``); the
    frozen encoder and the projector are the teacher's.

    3 of the teacher's 4 (measured on the quick teacher, held-out 0.81, docs/demo/RESULTS.md):
    the student starts at 0.375 greedy and GNDPO/OPD reach 0.59-0.61 in 40 steps; with 2 of 4
    it starts at 0.03 and reaches only 0.11-0.13 in the same steps (its reverse KL -65%).
    """

    name: str = "vlm_student_pruned"
    num_layers: int = 3
    importance: str = "kl"
    calibration: int = 32


def student_recipe() -> VisionRecipe:
    """2 language layers, hidden 64, fine-tuned briefly: it writes the format, misreads digits."""
    return VisionRecipe(
        name="vlm_student",
        model=language_model(2, 64, 4),
        vision=vision_config(),
        optimizer=sft_optimizer(3e-3, warmup_steps=10),
        # ~10 s; 300 steps reached held-out 0.19 (same encoder: the gap is the language model's)
        steps=200,
        batch_size=32,
        micro_batch_size=32,
        seed=22,
    )


# ---------------------------------------------------------------------------------------------
# Preparation


@dataclasses.dataclass(frozen=True)
class PreparedVLM(PreparedModel):
    """A trained demo VLM on disk: a demo model with its image encoder and projector."""

    vision: VisionConfig


def prepare_multimodal(
    cache_dir: str | Path,
    quick: bool = False,
    *,
    teacher: VisionRecipe | None = None,
    student: VisionRecipe | PrunedVisionRecipe | None = None,
    encoder: EncoderRecipe | None = None,
    on_step: Callable[[str, int, dict[str, float]], None] | None = None,
) -> tuple[PreparedVLM, PreparedVLM, VisualTask]:
    """The task, the shared pretrained encoder, then the teacher (:func:`teacher_recipe`) and
    the student on it, each made or reused; returns ``(teacher, student, task)``. The student
    is pruned from the teacher (:class:`PrunedVisionRecipe`, the default) or fine-tuned on its
    own (a :class:`VisionRecipe`, e.g. :func:`student_recipe`: the weak-student regime).
    ``teacher``/``student``/``encoder`` replace the default recipes (tests);
    ``on_step(name, step, metrics)`` runs after every SFT step. Initialises (and then shuts down)
    a one-process world when none exists; the megatron parallel state it builds is destroyed
    before it returns."""
    from megatron_gndpo.parallel.world import distributed_world, one_process_world

    with distributed_world(alone="the demo"):
        task = build_visual_task(cache_dir)
        with one_process_world(seed=0) as groups:
            pretrained = pretrain_encoder(
                Path(cache_dir) / "vlm_encoder", vision_config(), student_recipe().model, groups,
                task.sft, task.held_out, encoder,
            )  # fmt: skip
            task = dataclasses.replace(task, encoder=pretrained)
            prepared = []
            student = student or PrunedVisionRecipe()
            sft = [teacher or teacher_recipe(quick)]
            sft += [student] if isinstance(student, VisionRecipe) else []
            for recipe in sft:
                step_hook = None
                if on_step is not None:
                    step_hook = lambda step, m, name=recipe.name: on_step(name, step, m)
                prepared.append(
                    prepare_vlm(cache_dir, recipe, groups, task, pretrained, on_step=step_hook)
                )
            if isinstance(student, PrunedVisionRecipe):
                prepared.append(prepare_pruned_vlm(cache_dir, prepared[0], task, groups, student))
    return prepared[0], prepared[1], task


def prepare_vlm(
    cache_dir: str | Path,
    recipe: VisionRecipe,
    groups: ParallelGroups,
    task: VisualTask,
    encoder: PretrainedEncoder,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> PreparedVLM:
    """Fine-tune ``recipe`` (its frozen encoder loaded from ``encoder``) on the worked
    solutions, measure it, save it; or reuse the cache."""
    directory = Path(cache_dir) / recipe.name
    key = cache_key({
        "version": _CACHE_VERSION, "recipe": to_dict(recipe), "task": task.describe(),
        "encoder": _file_digest(encoder.path),
    })  # fmt: skip
    cached = load_meta(directory, key, recipe.model, recipe.vision)
    if cached is not None:
        return _prepared(directory, recipe, cached, cached=True)

    tokenizer = task.tokenizer
    layout = ImageLayout.of(recipe.vision)
    sequences = encode_sft_multimodal(
        tokenizer,
        layout,
        (
            (MultimodalExample(p.prompt, p.answer, (p.image,), i), p.solution)
            for i, p in enumerate(task.sft)
        ),
    )
    started = time.perf_counter()
    family = VisionFamily(recipe.vision, encoder=encoder.state_dict())
    trained, history = train_recipe(recipe, groups, sequences, tokenizer, on_step, family)
    sft_seconds = time.perf_counter() - started
    started = time.perf_counter()
    rows = [encode_multimodal(e, tokenizer, layout) for e in task.eval_examples()]
    accuracy = greedy_accuracy_multimodal(
        trained.model, groups, tokenizer, rows, max_new_tokens=task.max_response_length
    )
    meta = sft_meta(
        key, recipe, task.describe(), accuracy=accuracy, sft_seconds=sft_seconds,
        eval_seconds=time.perf_counter() - started, history=history,
    )  # fmt: skip
    save_prepared(directory, recipe.steps, trained.model, meta, recipe.model, recipe.vision)
    return _prepared(directory, recipe, meta, cached=False)


def prepare_pruned_vlm(
    cache_dir: str | Path,
    teacher: PreparedVLM,
    task: VisualTask,
    groups: ParallelGroups,
    recipe: PrunedVisionRecipe | None = None,
) -> PreparedVLM:
    """The VLM student pruned from ``teacher`` (:class:`PrunedVisionRecipe`), measured and
    saved; or reused from the cache (keyed by the teacher's own key). One process."""
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.prune.importance import calibration_batches, select_layers
    from megatron_gndpo.prune.run import load_pruned
    from megatron_gndpo.prune.student import pruned_state

    recipe = recipe or PrunedVisionRecipe()
    directory = Path(cache_dir) / recipe.name
    key = pruned_cache_key(teacher.checkpoint.parent, recipe, _CACHE_VERSION)
    model = dataclasses.replace(teacher.model, num_layers=recipe.num_layers)
    named = VisionRecipe(
        name=recipe.name, model=model, vision=teacher.vision, optimizer=sft_optimizer(1e-3, 0),
        steps=0, batch_size=1, micro_batch_size=1, seed=0,
    )  # fmt: skip
    cached = load_meta(directory, key, model, teacher.vision)
    if cached is not None:
        return _prepared(directory, named, cached, cached=True)

    started = time.perf_counter()
    net = load_prepared(teacher, groups)
    tokenizer, layout = task.tokenizer, ImageLayout.of(teacher.vision)
    rows = encode_sft_multimodal(
        tokenizer, layout,
        ((MultimodalExample(p.prompt, p.answer, (p.image,), i), p.solution)
         for i, p in enumerate(task.sft[: recipe.calibration])),
    )  # fmt: skip
    batches = calibration_batches(
        [(r.tokens, r.prompt_length) for r in rows], pad_id=tokenizer.pad_id, batch_size=8,
        images=[r.pixels for r in rows],
    )  # fmt: skip
    choice = select_layers(
        net, batches, num_layers=recipe.num_layers, vocab_size=tokenizer.vocab_size,
        importance=recipe.importance,  # type: ignore[arg-type]
    )  # fmt: skip
    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    student = build_vlm(model, teacher.vision, parallel, groups)
    load_pruned(student, pruned_state(net.state_dict(), choice.keep, swiglu=model.swiglu))
    student.eval()
    prune_seconds = time.perf_counter() - started
    started = time.perf_counter()
    accuracy = greedy_accuracy_multimodal(
        student, groups, tokenizer,
        [encode_multimodal(e, tokenizer, layout) for e in task.eval_examples()],
        max_new_tokens=task.max_response_length,
    )  # fmt: skip
    meta = {
        "key": key, "recipe": dataclasses.asdict(recipe), "teacher": teacher.name,
        "keep_layers": list(choice.keep), "calibration_kl": choice.kl, "accuracy": accuracy,
        "sft_seconds": prune_seconds, "eval_seconds": time.perf_counter() - started, "losses": [],
    }  # fmt: skip
    save_prepared(directory, 0, student, meta, model, teacher.vision)
    return _prepared(directory, named, meta, cached=False)


def greedy_accuracy_multimodal(
    model: Any,
    groups: ParallelGroups,
    tokenizer: Tokenizer,
    rows: Sequence[MultimodalRow],
    *,
    max_new_tokens: int,
    batch_size: int = 64,
) -> float:
    """Fraction of ``rows`` whose greedy response (KV-cached, images prefilled) states the
    reference answer (:func:`megatron_gndpo.rewards.verifiable.reward`). One model replica:
    every rank of its layout decodes every row."""
    from megatron_gndpo.rewards.verifiable import reward
    from megatron_gndpo.rollout.greedy import greedy_answers
    from megatron_gndpo.rollout.multimodal import MultimodalGenerator

    if not rows or any(r.example.answer is None for r in rows):
        raise ValueError("greedy_accuracy_multimodal needs rows, each with a reference answer")
    inner = getattr(model, "module", model)
    generator = MultimodalGenerator(
        inner, groups, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
        max_sequence_length=int(inner.language_model.max_sequence_length),
    )  # fmt: skip
    answers = greedy_answers(
        generator, [r.ids for r in rows], max_new_tokens=max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,), batch_size=batch_size,
        images=[r.pixels for r in rows],
    )  # fmt: skip
    correct = sum(
        reward(tokenizer.decode(a.response), str(r.example.answer))
        for a, r in zip(answers, rows, strict=True)
    )
    return correct / len(rows)


def _prepared(
    directory: Path, recipe: VisionRecipe, meta: dict[str, Any], *, cached: bool
) -> PreparedVLM:
    return PreparedVLM(
        name=recipe.name, model=recipe.model, vision=recipe.vision, cached=cached,
        **measured(directory, meta),
    )  # fmt: skip


def load_prepared(prepared: PreparedVLM, groups: ParallelGroups) -> Any:
    """The prepared model rebuilt on ``groups`` and loaded from its checkpoint (eval mode)."""
    return load_model(prepared.checkpoint, groups, model=prepared.model, vision=prepared.vision)
