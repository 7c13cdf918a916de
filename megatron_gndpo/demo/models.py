"""The demo's task data, teacher and student, cached on disk.

    task = build_task(cache_dir)                                  # problems + tokenizer
    teacher = prepare(cache_dir, teacher_recipe(), groups, task)  # SFT until accurate (cached)
    student = prepare_pruned(cache_dir, teacher, task, groups)    # the teacher, layers dropped
    # or prepare(cache_dir, student_recipe(), groups, task)       # smaller, briefly fine-tuned
    # teacher.checkpoint -> teacher.load, student.checkpoint -> checkpoint.init

The teacher is described by a :class:`Recipe` (architecture, optimizer, steps, seed), a student
made by SFT too; the default student is pruned from the teacher (:class:`PruneRecipe`: the
layers kept are those whose removal moves the teacher least on its own answers, ``prune/``), as
compression by distillation is done in practice. Each model's model-only checkpoint (its
``model_config.yaml`` beside it, so ``convert mcore-to-hf`` needs no flags) and a ``model.json``
(recipe, held-out greedy accuracy, wall times) are written to ``CACHE/NAME/``; a later call with
the same recipe, tokenizer, data (and teacher) reuses them. Every rank of the
model's layout calls these functions together (the groups are the student's: megatron-core's
global parallel state), and rank 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megatron_gndpo.checkpoint.convert import describe_checkpoints
from megatron_gndpo.checkpoint.dist import MODEL_CONFIG_FILE, latest_step, save_checkpoint
from megatron_gndpo.checkpoint.load import load_model
from megatron_gndpo.config import to_dict
from megatron_gndpo.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.tasks import chains
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.demo.evaluate import greedy_accuracy
from megatron_gndpo.demo.tokenizer import task_corpus, train_tokenizer
from megatron_gndpo.parallel.distributed import barrier, rank
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.sft import encode_sft, sft_train
from megatron_gndpo.sft.loop import TEXT, SFTFamily

# The supervised data: drawn from its own seed, with every held-out prompt removed.
SFT_SEED = 2
SFT_PROBLEMS = 20_000

_META = "model.json"
_CHECKPOINT = "checkpoint"
# Bump when the way a cached model is made changes in a way its recipe does not show.
_CACHE_VERSION = 1


def max_new_tokens(difficulty: int) -> int:
    """Generation budget: a worked solution is ``6 * difficulty + 5`` tokens, then EOS; slack."""
    return 6 * difficulty + 12


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """The problems and the tokenizer both models share."""

    difficulty: int
    tokenizer: Tokenizer  # the demo's SentencePiece (benchmarks/cross_tokenizer.py: also char)
    sft: list[chains.Problem]  # supervised data (no held-out prompt)
    eval: list[chains.Problem]  # held-out problems (builtin:chains_eval)

    def describe(self) -> dict[str, Any]:
        return describe_task(self.difficulty, self.tokenizer, _digest(self.sft), _digest(self.eval))


def describe_task(difficulty: int, tokenizer: Tokenizer, sft: str, held_out: str) -> dict[str, Any]:
    """What a cached model depends on besides its recipe: the task's data by content (``sft``,
    ``held_out``: digests of the supervised and held-out problems)."""
    return {"difficulty": difficulty, "tokenizer": tokenizer.fingerprint(), "sft": sft,
            "eval": held_out}  # fmt: skip


def digest(chunks: Iterable[bytes]) -> str:
    """The SHA-256 of ``chunks`` one after another (hex)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _digest(problems: list[chains.Problem]) -> str:
    return digest(f"{p.prompt}\t{p.solution}\n".encode() for p in problems)


def build_task(cache_dir: str | Path, difficulty: int = chains.DEFAULT_DIFFICULTY) -> DemoTask:
    """Held-out and supervised problems, and the tokenizer trained on them (cached)."""
    held_out = chains.split("eval", difficulty)
    excluded = {p.prompt for p in held_out}
    drawn = chains.generate(SFT_PROBLEMS, SFT_SEED, difficulty)
    sft = [p for p in drawn if p.prompt not in excluded]
    train = chains.split("train", difficulty)
    corpus = task_corpus((p.prompt, p.solution) for p in [*sft, *train])
    tokenizer = train_tokenizer(Path(cache_dir) / "tokenizer", corpus)
    return DemoTask(difficulty=difficulty, tokenizer=tokenizer, sft=sft, eval=held_out)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one demo model is made: its architecture and its supervised fine-tuning."""

    name: str
    model: ModelConfig
    optimizer: OptimizerConfig
    steps: int
    batch_size: int
    micro_batch_size: int
    seed: int


def language_model(num_layers: int, hidden: int, heads: int) -> ModelConfig:
    """A demo language model's architecture (the multimodal demo's VLMs use it too)."""
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_attention_heads=heads,
        vocab_size=128,  # >= the demo tokenizer's pieces (checked when the model is built)
        make_vocab_size_divisible_by=64,
        max_position_embeddings=128,
        params_dtype="fp32",
    )


def sft_optimizer(lr: float, warmup_steps: int) -> OptimizerConfig:
    """The demo models' SFT optimizer: cosine decay to a tenth, no weight decay."""
    return OptimizerConfig(
        lr=lr, min_lr=lr / 10, lr_schedule="cosine", warmup_steps=warmup_steps,
        weight_decay=0.0, clip_grad=1.0,
    )  # fmt: skip


def teacher_recipe(quick: bool = False) -> Recipe:
    """4 layers, hidden 128, trained until its held-out greedy accuracy is high.

    ``quick`` (``demo --quick``) trains fewer steps: held-out accuracy ~0.88 instead of ~1.0.
    It is cached under its own name, so a quick run does not evict the full teacher.
    """
    return Recipe(
        name="teacher_quick" if quick else "teacher",
        model=language_model(4, 128, 4),
        optimizer=sft_optimizer(3e-3, warmup_steps=20),
        # 2 CPU cores shared with other jobs: 250 steps ~50 s (held-out 0.88), 450 ~90 s (1.00)
        steps=250 if quick else 450,
        batch_size=64,
        micro_batch_size=64,
        seed=11,
    )


def student_recipe() -> Recipe:
    """2 layers, hidden 64, fine-tuned briefly: it writes the format but gets facts wrong."""
    return Recipe(
        name="student",
        model=language_model(2, 64, 4),
        optimizer=sft_optimizer(3e-3, warmup_steps=10),
        # 150 steps (~10 s): it copies the chain but gets sums wrong (held-out 0.22). The gap is
        # training, not capacity: 200 steps reach 0.58, 250 0.73, 400 0.93
        steps=150,
        batch_size=64,
        micro_batch_size=64,
        seed=22,
    )


def vllm_student_recipe() -> Recipe:
    """The student for ``demo --engine vllm``: 2 heads of 32 instead of 4 of 16 (vLLM's CPU
    attention takes head sizes of 32 and more), otherwise the same recipe, cached apart."""
    return dataclasses.replace(
        student_recipe(), name="student_vllm", model=language_model(2, 64, 2)
    )


@dataclasses.dataclass(frozen=True)
class PruneRecipe:
    """How the default student is made from the teacher: ``num_layers`` of its layers, chosen
    by ``importance`` on the teacher's greedy answers to ``calibration_prompts`` training
    prompts (``prune/``); optionally a narrower FFN."""

    name: str
    num_layers: int
    importance: str = "kl"
    calibration_prompts: int = 32
    ffn_hidden_size: int | None = None


def pruned_recipe() -> PruneRecipe:
    """Half the teacher's layers (2 of 4), chosen by the KL of their removal.

    Measured on the full teacher (docs/demo/RESULTS.md): the greedy search keeps layers 0 and
    1 (calibration KL 0.25 nats/token), held-out greedy 0.32 where the teacher has 0.98;
    dropping one layer instead starts at 0.74, too close to show much.
    """
    return PruneRecipe(name="student_pruned", num_layers=2)


def near_pruned_recipe() -> PruneRecipe:
    """The teacher with one layer dropped (3 of 4, by KL: held-out 0.742 where the teacher has
    0.984), for ``demo --stability``: a student close to its teacher, whose ordinary batches
    score little, so an outlier batch stands out."""
    return PruneRecipe(name="student_pruned3", num_layers=3)


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """A trained demo model on disk."""

    name: str
    checkpoint: Path  # model-only root: teacher.load / checkpoint.init
    model: ModelConfig
    accuracy: float  # greedy, on the held-out problems
    sft_seconds: float
    eval_seconds: float
    losses: list[float]
    cached: bool  # reused from an earlier run


def prepare(
    cache_dir: str | Path,
    recipe: Recipe,
    groups: ParallelGroups,
    task: DemoTask,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    new_tokens: int | None = None,
) -> PreparedModel:
    """Fine-tune ``recipe`` on the worked solutions, measure it, save it; or reuse the cache.

    ``new_tokens``: the held-out evaluation's generation budget; None: :func:`max_new_tokens`,
    sized for the demo tokenizer (a character-level model needs about three times more).
    """
    directory = Path(cache_dir) / recipe.name
    key = cache_key({"version": _CACHE_VERSION, "recipe": to_dict(recipe), "task": task.describe()})
    cached = load_meta(directory, key, recipe.model)
    if cached is not None:
        return _prepared(directory, recipe.name, recipe.model, cached, cached=True)

    tokenizer = task.tokenizer
    sequences = encode_sft(tokenizer, [(p.prompt, p.solution) for p in task.sft])
    started = time.perf_counter()
    trained, history = train_recipe(recipe, groups, sequences, tokenizer, on_step)
    sft_seconds = time.perf_counter() - started
    started = time.perf_counter()
    accuracy = greedy_accuracy(
        trained.model, groups, tokenizer, task.eval,
        max_new_tokens=new_tokens or max_new_tokens(task.difficulty),
    )  # fmt: skip
    meta = sft_meta(
        key, recipe, task.describe(), accuracy=accuracy, sft_seconds=sft_seconds,
        eval_seconds=time.perf_counter() - started, history=history,
        world_size=groups.layout.world_size,
    )  # fmt: skip
    save_prepared(directory, recipe.steps, trained.model, meta, recipe.model)
    return _prepared(directory, recipe.name, recipe.model, meta, cached=False)


def train_recipe(
    recipe: Any,
    groups: ParallelGroups,
    sequences: Any,
    tokenizer: Tokenizer,
    on_step: Any,
    family: SFTFamily = TEXT,
) -> tuple[Any, list[dict[str, float]]]:
    """A recipe's model trained by SFT on ``sequences`` at the layout of ``groups`` (the text
    demo's and, with the VLM ``family``, the VLM demo's)."""
    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    return sft_train(
        recipe.model, parallel, groups, sequences,
        optimizer=recipe.optimizer, steps=recipe.steps, batch_size=recipe.batch_size,
        micro_batch_size=recipe.micro_batch_size, seed=recipe.seed,
        vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, on_step=on_step, family=family,
    )  # fmt: skip


def sft_meta(
    key: str,
    recipe: Any,
    task: dict[str, Any],
    *,
    history: list[dict[str, float]],
    **measured: Any,
) -> dict[str, Any]:
    """The ``model.json`` of a model made by SFT: its cache key, recipe (a dataclass) and task
    description, what was ``measured`` (accuracy, wall times) and its loss at every step."""
    losses = [m["loss"] for m in history]
    return {"key": key, "recipe": to_dict(recipe), "task": task, **measured, "losses": losses}


def cache_key(payload: dict[str, Any]) -> str:
    """The key of a cached model: a digest of everything it depends on (recipe, data, teacher)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def pruned_cache_key(teacher_dir: Path, recipe: Any, version: int) -> str:
    """The cache key of a student pruned by ``recipe`` (a dataclass) from the cached teacher
    in ``teacher_dir``: the recipe, the teacher's own key and the caller's cache version."""
    teacher_key = json.loads((teacher_dir / _META).read_text())["key"]
    return cache_key(
        {"version": version, "recipe": dataclasses.asdict(recipe), "teacher": teacher_key}
    )


def save_prepared(
    directory: Path,
    step: int,
    net: Any,
    meta: dict[str, Any],
    model: ModelConfig,
    vision: VisionConfig | None = None,
) -> None:
    """Replace the cache entry ``directory`` with ``net``'s model-only checkpoint at ``step``,
    its architecture beside it and ``meta`` (:func:`finish_entry`)."""
    if rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    barrier()
    save_checkpoint(directory / _CHECKPOINT, step, net)
    finish_entry(directory, meta, model, vision)


def finish_entry(
    directory: Path, meta: dict[str, Any], model: ModelConfig, vision: VisionConfig | None = None
) -> None:
    """Complete the cache entry ``directory`` whose checkpoint is written: the architecture
    beside the checkpoint unless it is there (``prune`` writes its own), then ``meta``, last:
    its presence marks a complete entry. Rank 0 writes."""
    if rank() == 0:
        _describe(directory / _CHECKPOINT, model, vision)
        (directory / _META).write_text(json.dumps(meta, indent=2) + "\n")
    barrier()


def _describe(checkpoint: Path, model: ModelConfig, vision: VisionConfig | None) -> None:
    # model_config.yaml (and a VLM's vision_config.yaml): convert mcore-to-hf, prune and
    # checkpoint.load_model read the architecture from it
    if not (checkpoint / MODEL_CONFIG_FILE).is_file():
        describe_checkpoints(checkpoint, model, vision)


def prepare_pruned(
    cache_dir: str | Path,
    teacher: PreparedModel,
    task: DemoTask,
    groups: ParallelGroups,
    recipe: PruneRecipe | None = None,
) -> PreparedModel:
    """The student pruned from ``teacher`` by ``recipe`` (:func:`pruned_recipe`), its held-out
    greedy accuracy measured; or reused from the cache (keyed by the teacher's own key)."""
    from megatron_gndpo.prune.run import prune_checkpoint

    recipe = recipe or pruned_recipe()
    directory = Path(cache_dir) / recipe.name
    key = pruned_cache_key(teacher.checkpoint.parent, recipe, _CACHE_VERSION)
    model = dataclasses.replace(teacher.model, num_layers=recipe.num_layers)
    if recipe.ffn_hidden_size is not None:
        model = dataclasses.replace(model, ffn_hidden_size=recipe.ffn_hidden_size)
    cached = load_meta(directory, key, model)
    if cached is not None:
        return _prepared(directory, recipe.name, model, cached, cached=True)
    if rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    barrier()
    started = time.perf_counter()
    result = prune_checkpoint(
        teacher.checkpoint, directory / _CHECKPOINT, num_layers=recipe.num_layers,
        tokenizer=task.tokenizer, importance=recipe.importance,  # type: ignore[arg-type]
        prompts=[p.prompt for p in chains.split("train")[: recipe.calibration_prompts]],
        ffn_hidden_size=recipe.ffn_hidden_size, model=teacher.model,
        max_new_tokens=max_new_tokens(task.difficulty),
    )  # fmt: skip
    prune_seconds = time.perf_counter() - started
    started = time.perf_counter()
    accuracy = _checkpoint_accuracy(directory / _CHECKPOINT, groups, task)
    meta = {
        "key": key, "recipe": dataclasses.asdict(recipe), "teacher": teacher.name,
        "keep_layers": list(result.choice.keep), "calibration_kl": result.kl,
        "accuracy": accuracy, "sft_seconds": prune_seconds,
        "eval_seconds": time.perf_counter() - started, "losses": [],
    }  # fmt: skip
    finish_entry(directory, meta, model)
    return _prepared(directory, recipe.name, model, meta, cached=False)


def _checkpoint_accuracy(checkpoint: Path, groups: ParallelGroups, task: DemoTask) -> float:
    """Held-out greedy accuracy of the model saved at ``checkpoint`` (its own architecture:
    a HybridModel's checkpoint loads as one)."""
    net = load_model(checkpoint, groups)
    return greedy_accuracy(
        net, groups, task.tokenizer, task.eval, max_new_tokens=max_new_tokens(task.difficulty)
    )


def keep_layers(student: PreparedModel) -> list[int] | None:
    """The teacher layers a pruned student kept (None for a student made by SFT)."""
    meta = json.loads((student.checkpoint.parent / _META).read_text())
    kept = meta.get("keep_layers")
    return None if kept is None else [int(i) for i in kept]


def load_meta(
    directory: Path, key: str, model: ModelConfig, vision: VisionConfig | None = None
) -> dict[str, Any] | None:
    """The ``model.json`` of a complete cache entry made under ``key``, else None. An entry
    made before the architecture was written beside its checkpoint gets it now."""
    meta_file = directory / _META
    if not meta_file.is_file() or latest_step(directory / _CHECKPOINT) is None:
        return None
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    if meta.get("key") != key:
        return None
    if rank() == 0:
        _describe(directory / _CHECKPOINT, model, vision)
    barrier()
    return meta


def measured(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A cache entry's checkpoint and measurements, as :class:`PreparedModel` holds them."""
    return {
        "checkpoint": directory / _CHECKPOINT,
        "accuracy": float(meta["accuracy"]),
        "sft_seconds": float(meta["sft_seconds"]),
        "eval_seconds": float(meta["eval_seconds"]),
        "losses": [float(x) for x in meta["losses"]],
    }


def _prepared(
    directory: Path, name: str, model: ModelConfig, meta: dict[str, Any], *, cached: bool
) -> PreparedModel:
    return PreparedModel(name=name, model=model, cached=cached, **measured(directory, meta))
