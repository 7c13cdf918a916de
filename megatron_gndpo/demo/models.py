"""The demo's task data, teacher and student, cached on disk.

    task = build_task(cache_dir)                               # problems + tokenizer
    teacher = prepare_teacher(cache_dir, groups, task)         # SFT until accurate (cached)
    student = prepare_pruned(cache_dir, teacher, task, groups) # the teacher, layers dropped
    # or prepare_student(cache_dir, groups, task)              # smaller, briefly fine-tuned
    # teacher.checkpoint -> teacher.load, student.checkpoint -> checkpoint.init

The teacher is described by a :class:`Recipe` (architecture, optimizer, steps, seed), a student
made by SFT too; the default student is pruned from the teacher (:class:`PruneRecipe`: the
layers kept are those whose removal moves the teacher least on its own answers, ``prune/``), as
compression by distillation is done in practice. Each model's model-only checkpoint and a
``model.json`` (recipe, held-out greedy accuracy, wall times) are written to ``CACHE/NAME/``; a
later call with the same recipe, tokenizer, data (and teacher) reuses them. Every rank of the
model's layout calls these functions together (the groups are the student's: megatron-core's
global parallel state), and rank 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_gndpo.checkpoint.dist import latest_step, save_checkpoint
from megatron_gndpo.config import to_dict
from megatron_gndpo.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_gndpo.data.tasks import chains
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.demo.evaluate import greedy_accuracy
from megatron_gndpo.demo.tokenizer import task_corpus, train_tokenizer
from megatron_gndpo.parallel.distributed import barrier, rank
from megatron_gndpo.parallel.groups import ParallelGroups
from megatron_gndpo.sft import encode_sft, sft_train

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
        """What a cached model depends on besides its recipe (the data by content)."""
        return {
            "difficulty": self.difficulty,
            "tokenizer": self.tokenizer.fingerprint(),
            "sft": _digest(self.sft),
            "eval": _digest(self.eval),
        }


def _digest(problems: list[chains.Problem]) -> str:
    h = hashlib.sha256()
    for p in problems:
        h.update(f"{p.prompt}\t{p.solution}\n".encode())
    return h.hexdigest()


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


def _model(num_layers: int, hidden: int, heads: int) -> ModelConfig:
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


def _optimizer(lr: float, warmup_steps: int) -> OptimizerConfig:
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
        model=_model(4, 128, 4),
        optimizer=_optimizer(3e-3, warmup_steps=20),
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
        model=_model(2, 64, 4),
        optimizer=_optimizer(3e-3, warmup_steps=10),
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
    return dataclasses.replace(student_recipe(), name="student_vllm", model=_model(2, 64, 2))


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


def prepare_teacher(
    cache_dir: str | Path,
    groups: ParallelGroups,
    task: DemoTask,
    *,
    recipe: Recipe | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> PreparedModel:
    """The teacher of :func:`teacher_recipe` (or ``recipe``), trained or reused."""
    return prepare(cache_dir, recipe or teacher_recipe(), groups, task, on_step=on_step)


def prepare_student(
    cache_dir: str | Path,
    groups: ParallelGroups,
    task: DemoTask,
    *,
    recipe: Recipe | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> PreparedModel:
    """The student start of :func:`student_recipe` (or ``recipe``), trained or reused."""
    return prepare(cache_dir, recipe or student_recipe(), groups, task, on_step=on_step)


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
    key = _cache_key(recipe, task)
    cached = _load_meta(directory, key)
    if cached is not None:
        return _prepared(directory, recipe.name, recipe.model, cached, cached=True)

    tokenizer = task.tokenizer
    sequences = encode_sft(tokenizer, [(p.prompt, p.solution) for p in task.sft])
    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    started = time.perf_counter()
    trained, history = sft_train(
        recipe.model, parallel, groups, sequences,
        optimizer=recipe.optimizer, steps=recipe.steps, batch_size=recipe.batch_size,
        micro_batch_size=recipe.micro_batch_size, seed=recipe.seed,
        vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, on_step=on_step,
    )  # fmt: skip
    sft_seconds = time.perf_counter() - started
    started = time.perf_counter()
    accuracy = greedy_accuracy(
        trained.model, groups, tokenizer, task.eval,
        max_new_tokens=new_tokens or max_new_tokens(task.difficulty),
    )  # fmt: skip
    eval_seconds = time.perf_counter() - started

    if rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    barrier()
    save_checkpoint(directory / _CHECKPOINT, recipe.steps, trained.model)
    meta = {
        "key": key,
        "recipe": to_dict(recipe),
        "task": task.describe(),
        "accuracy": accuracy,
        "sft_seconds": sft_seconds,
        "eval_seconds": eval_seconds,
        "world_size": groups.layout.world_size,
        "losses": [m["loss"] for m in history],
    }
    if rank() == 0:  # written last: its presence marks a complete cache entry
        (directory / _META).write_text(json.dumps(meta, indent=2) + "\n")
    barrier()
    return _prepared(directory, recipe.name, recipe.model, meta, cached=False)


def pruned_cache_key(teacher_dir: Path, recipe: Any, version: int) -> str:
    """The cache key of a student pruned by ``recipe`` (a dataclass) from the cached teacher
    in ``teacher_dir``: the recipe, the teacher's own key and the caller's cache version."""
    teacher_key = json.loads((teacher_dir / _META).read_text())["key"]
    payload = {"version": version, "recipe": dataclasses.asdict(recipe), "teacher": teacher_key}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


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
    cached = _load_meta(directory, key)
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
    accuracy = _checkpoint_accuracy(model, directory / _CHECKPOINT, groups, task)
    meta = {
        "key": key, "recipe": dataclasses.asdict(recipe), "teacher": teacher.name,
        "keep_layers": list(result.choice.keep), "calibration_kl": result.kl,
        "accuracy": accuracy, "sft_seconds": prune_seconds,
        "eval_seconds": time.perf_counter() - started, "losses": [],
    }  # fmt: skip
    if rank() == 0:  # written last: its presence marks a complete cache entry
        (directory / _META).write_text(json.dumps(meta, indent=2) + "\n")
    barrier()
    return _prepared(directory, recipe.name, model, meta, cached=False)


def _checkpoint_accuracy(
    model: ModelConfig, checkpoint: Path, groups: ParallelGroups, task: DemoTask
) -> float:
    """Held-out greedy accuracy of the model saved at ``checkpoint``."""
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.models.gpt import build_gpt

    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    net = build_gpt(model, parallel, groups)
    load_checkpoint(checkpoint, net)
    net.eval()
    return greedy_accuracy(
        net, groups, task.tokenizer, task.eval, max_new_tokens=max_new_tokens(task.difficulty)
    )


def keep_layers(student: PreparedModel) -> list[int] | None:
    """The teacher layers a pruned student kept (None for a student made by SFT)."""
    meta = json.loads((student.checkpoint.parent / _META).read_text())
    kept = meta.get("keep_layers")
    return None if kept is None else [int(i) for i in kept]


def _cache_key(recipe: Recipe, task: DemoTask) -> str:
    payload = {"version": _CACHE_VERSION, "recipe": to_dict(recipe), "task": task.describe()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _load_meta(directory: Path, key: str) -> dict[str, Any] | None:
    meta_file = directory / _META
    if not meta_file.is_file() or latest_step(directory / _CHECKPOINT) is None:
        return None
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    return meta if meta.get("key") == key else None


def _prepared(
    directory: Path, name: str, model: ModelConfig, meta: dict[str, Any], *, cached: bool
) -> PreparedModel:
    return PreparedModel(
        name=name,
        checkpoint=directory / _CHECKPOINT,
        model=model,
        accuracy=float(meta["accuracy"]),
        sft_seconds=float(meta["sft_seconds"]),
        eval_seconds=float(meta["eval_seconds"]),
        losses=[float(x) for x in meta["losses"]],
        cached=cached,
    )
