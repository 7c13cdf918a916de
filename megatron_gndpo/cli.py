"""The ``megatron-gndpo`` command.

    megatron-gndpo train [--config FILE] [section.key=value ...]     (under torchrun or srun)
    megatron-gndpo launch [torchrun options] train|convert ...         (torchrun, one-line failures)
    megatron-gndpo plan [--config FILE] [--world-size N] [--ranks] [--gpu-memory-gib G] [--mfu M]
                        [--interconnect-gbps B] [section.key=value ...]  (memory and step time too)
    megatron-gndpo config show|validate|fields [--config FILE] [--world-size N] [overrides]
    megatron-gndpo demo [--quick] [--multimodal] [--methods gndpo,opd,...] [--seeds N]
                        [--student pruned|sft] [--run-dir DIR]
    megatron-gndpo demo --stability [--quick] [--run-dir DIR] [--cache-dir DIR]
    megatron-gndpo prune --teacher CKPT --out DIR --num-layers N --calib-data PROMPTS
    megatron-gndpo compress --teacher HF_DIR|CKPT --out DIR --layers N [--warmup-steps K]
                            [--steps S] [--eval-interval E] [--eval FILE] [section.key=value ...]

Without ``--config`` the embedded default is used: ``plan``/``config`` start from the release
defaults with tiny models; ``train`` runs ``megatron_gndpo/configs/tiny_cpu.yaml`` (a tiny
student and teacher on built-in prompts, CPU-friendly). Overrides are
dotted ``section.key=value`` pairs whose values are read as YAML.

One error boundary: an error the project raises on purpose (:class:`~megatron_gndpo.errors.
UserError`: config, data, checkpoint, missing extra, distributed start-up) is printed once for the
job as ``megatron-gndpo: error: ...`` and the command exits with status 2; any other exception is
a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_gndpo.checks import validate
from megatron_gndpo.cli_options import add_options, option
from megatron_gndpo.compress import cli as compress_cli
from megatron_gndpo.config import (
    Config,
    load_config,
    save_dir,
    save_resolved,
    teacher_sections,
    to_yaml,
)
from megatron_gndpo.config.docs import format_fields
from megatron_gndpo.errors import UserError
from megatron_gndpo.methods import config_names
from megatron_gndpo.prune import cli as prune_cli
from megatron_gndpo.version import __version__

if TYPE_CHECKING:
    from megatron_gndpo.job.runlock import RunLock

# Where the commands that read a config point for its fields (910 lines: `config fields` only).
_FIELDS_EPILOG = (
    "Every configuration field, with its type, default and meaning: `megatron-gndpo config "
    "fields` (also docs/CONFIG.md). Overrides are section.key=value, the value read as YAML."
)
# The two configs a command without --config starts from.
RELEASE_DEFAULTS = (
    "YAML config (default: the release defaults, with tiny models; `megatron-gndpo config show` "
    "prints them; train's default is another: examples/tiny_cpu.yaml)"
)
TINY_CPU_DEFAULT = (
    "YAML config (default: the tiny CPU example, examples/tiny_cpu.yaml, embedded as "
    "megatron_gndpo/configs/tiny_cpu.yaml: a tiny student and teacher on built-in prompts; "
    "`megatron-gndpo config show -c examples/tiny_cpu.yaml` prints it)"
)


def _add_config_args(
    parser: argparse.ArgumentParser,
    *,
    config_help: str,
    world_default: int | None = None,
    world_help: str | None = None,
) -> None:
    """--config, the overrides and (``world_help``: for plan and config) --world-size."""
    parser.add_argument("--config", "-c", type=Path, help=config_help)
    if world_help is not None:
        parser.add_argument("--world-size", "-n", type=int, default=world_default, help=world_help)
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="dotted config overrides"
    )


# The demo's thread count, whatever the machine has: the README's numbers were measured with it.
DEMO_THREADS = 2


def _threads(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


# plan's options beside the config's: what it prints, and the hardware it plans for
_PLAN_OPTIONS = (
    option("--ranks", "also list every rank's coordinates", action="store_true"),
    option("--out", "write the resolved config to OUT/config.yaml", type=Path),
    option("--gpu-memory-gib", "memory of one GPU in GiB (default: 80, an H100 80GB)",
           type=_positive, default=80.0),
    option("--mfu", "model FLOPs utilisation assumed for the step time (default: 0.35)",
           type=_fraction, default=0.35),
    option("--peak-tflops", "dense bf16 peak of one GPU in TFLOP/s (default: 989, an H100 SXM)",
           type=_positive, default=989.0),
    option("--hbm-tbps", "memory bandwidth of one GPU in TB/s, for the decode floor (default: "
           "3.35, H100 SXM)", type=_positive, default=3.35),
    option("--interconnect-gbps", "GB/s of the trainer -> rollout weight broadcast "
           "(rollout.disaggregate; default: 25, one 200 Gb/s HDR InfiniBand NIC)",
           type=_positive, default=25.0),
)  # fmt: skip

_DEMO_OPTIONS = (
    option("--quick", "a smaller run (under 5 minutes)", action="store_true"),
    option("--methods", "comma-separated subset of gndpo,opd,rlvr,tgpo,tropd,vopd (default: "
           "gndpo,opd,rlvr; gndpo,opd with --multimodal)", default=None),
    option("--multimodal", "the visual task (digits in images) with vision-language teacher and "
           "student", action="store_true"),
    option("--seed", "seed of the first training run (default 1234; the cached teacher and "
           "student stay the same)", type=int, default=None),
    option("--seeds", "how many seeds each method runs, from --seed on (default 3; 1 with "
           "--quick)", type=int, default=None),
    option("--student", "pruned: the teacher with half its layers dropped (default); sft: a "
           "smaller model fine-tuned briefly on its own, the regime where the sampled-token "
           "methods do not teach", choices=("pruned", "sft"), default="pruned"),
    option("--stability", "the stability study instead: a near-teacher student, outlier "
           "batches every 10th step, OPD vs GNDPO and GNDPO's two halves over 2 seeds (about 7 "
           "minutes on 2 CPU cores, docs/demo/RESULTS.md; --cache-dir runs/demo/cache reuses the "
           "demo's teacher)", action="store_true"),
    option("--engine", "where rollouts are sampled: the built-in generator, or a real vLLM "
           "(the vLLM tier; each method runs in its own process)",
           choices=("builtin", "vllm"), default="builtin"),
    option("--run-dir", "report folder (default runs/demo, runs/demo_stability with "
           "--stability)", type=Path, default=None),
    option("--cache-dir", "tokenizer and trained models (default: RUN_DIR/cache)", type=Path),
    option("--threads", "CPU threads the demo computes with (default 2, whatever the machine "
           "has): its numbers depend on the thread count, which orders the floating-point sums; "
           "with 2 they are the README's", type=_threads, default=DEMO_THREADS),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    documented: dict[str, Any] = dict(epilog=_FIELDS_EPILOG)
    parser = argparse.ArgumentParser(
        prog="megatron-gndpo",
        description="On-policy distillation with GNDPO on megatron-core. `megatron-gndpo "
        "COMMAND --help` for a command's options.",
        **documented,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_plan = sub.add_parser(
        "plan",
        help="print both models' layouts, per-rank parameters and memory, and the step time "
        "(no GPU needed)",
        description="Validate the config for N ranks and print both models' parallel layouts, "
        "per-rank parameter counts, an estimate of per-rank memory (with a WARNING for ranks "
        "that will not fit the GPU), the step time at a stated MFU and the resolved config. "
        "Needs no GPU and starts nothing.",
        **documented,
    )
    _add_config_args(
        p_plan, config_help=RELEASE_DEFAULTS, world_default=8,
        world_help="number of ranks (GPUs) to plan for (default: 8)",
    )  # fmt: skip
    add_options(p_plan, *_PLAN_OPTIONS)

    p_train = sub.add_parser(
        "train",
        help="run GNDPO training (one process on a CPU; several under `megatron-gndpo launch` "
        "or srun)",
        description="Train the student against the teacher. Launch one process per GPU with "
        "`megatron-gndpo launch` (torchrun) or Slurm's srun, which set the number of ranks; "
        "without a launcher it runs as a single process. Resumes from the newest checkpoint in "
        "the save directory automatically. Ctrl-C (or SIGTERM) stops after the current step "
        "with a checkpoint; a second Ctrl-C stops at once.",
        **documented,
    )
    _add_config_args(p_train, config_help=TINY_CPU_DEFAULT)

    p_convert = sub.add_parser(
        "convert",
        help="convert checkpoints: hf-to-mcore (under torchrun) or mcore-to-hf",
        description="hf-to-mcore: Hugging Face directory -> megatron dist-checkpoint at a chosen "
        "TP/PP (launch TP*PP processes). mcore-to-hf: megatron checkpoint saved at any TP/PP -> "
        "Hugging Face safetensors + config + tokenizer. `convert DIRECTION --help` for options.",
    )
    p_convert.add_argument("direction", choices=("hf-to-mcore", "mcore-to-hf"))
    p_convert.add_argument("rest", nargs=argparse.REMAINDER, help="options of the direction")

    p_prune = sub.add_parser(
        "prune",
        help="make a student from a teacher checkpoint: fewer layers (and a narrower FFN), "
        "chosen by measured importance",
        description="Write a model-only student checkpoint pruned from a teacher checkpoint: "
        "the layers whose removal moves the teacher's output least on its own answers to "
        "calibration prompts are left out (and, with --ffn-hidden-size, the least active FFN "
        "neurons). One process; the student keeps the teacher's tokenizer (docs/PRUNING.md).",
    )
    prune_cli.add_arguments(p_prune)

    p_compress = sub.add_parser(
        "compress",
        help="a teacher made into a smaller student and distilled on-policy, as one resumable "
        "command: convert, prune, warm up, distil, evaluate, report",
        description="Convert the teacher (a Hugging Face directory) or use its megatron "
        "checkpoint, prune it to --layers, optionally warm the student up with sequence-level "
        "KD (--warmup-steps), distil it on-policy through the trainer (--steps; the base "
        "--config with the dotted overrides) and evaluate it on held-out questions at step 0, "
        "every --eval-interval steps and at the end; the report (report.md, curves.png) goes "
        "into --out. Each stage is skipped on a rerun once complete, so an interrupted run "
        "resumes. One process (docs/PRUNING.md).",
        **documented,
    )
    compress_cli.add_arguments(p_compress)

    p_launch = sub.add_parser(
        "launch",
        add_help=False,
        help="torchrun for train/convert: the same options, one line instead of a traceback "
        "when a worker fails, and the worker's exit code",
        description="megatron-gndpo launch [torchrun options] train|convert ... "
        "(`megatron-gndpo launch --help`: its page)",
    )
    p_launch.add_argument(
        "rest", nargs=argparse.REMAINDER, help="torchrun's options, then the command"
    )

    p_cfg = sub.add_parser(
        "config",
        help="show, validate or document the configuration",
        description="show: print the resolved configuration (defaults, then the --config file, "
        "then the overrides) as YAML, every field included. validate: check it (against "
        "--world-size ranks when given) and say `config is valid`, or name what is wrong and "
        "the fix. fields: every field with its type, default and meaning. Without --config "
        "both start from the release defaults, as plan does; train's default is the tiny CPU "
        "example (`config show -c examples/tiny_cpu.yaml`).",
        **documented,
    )
    p_cfg.add_argument(
        "action", choices=("show", "validate", "fields"), help="show, validate or fields (above)"
    )
    _add_config_args(
        p_cfg, config_help=RELEASE_DEFAULTS,
        world_help="validate against this many ranks (GPUs) too (default: no rank-count checks)",
    )  # fmt: skip

    p_demo = sub.add_parser(
        "demo",
        help="distil a tiny reasoning teacher into a student on the CPU: GNDPO vs OPD vs RLVR",
        description="Train a small teacher on the built-in chains task and make a student from "
        "it by pruning half its layers (both cached), then train the student with GNDPO, OPD "
        "and RLVR from the same start over 3 seeds and write a report (greedy and sampled "
        "accuracy, reverse KL to the teacher, plots, summary.md) into the run directory. One "
        "process; no GPU and no downloads needed.",
    )
    add_options(p_demo, *_DEMO_OPTIONS)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_gndpo import plan as planner

    if args.ranks and args.world_size > planner.MAX_LISTED_RANKS:
        raise UserError(
            f"--ranks lists every rank, one line each: at most {planner.MAX_LISTED_RANKS:,} "
            f"(asked for {args.world_size:,}); leave it out, the plan itself takes any size"
        )
    cfg = validate(load_config(args.config, args.overrides), args.world_size)
    hw = planner.Hardware(
        gpu_memory_gib=args.gpu_memory_gib, peak_flops=args.peak_tflops * 1e12, mfu=args.mfu,
        hbm_bytes_per_s=args.hbm_tbps * 1e12,
        interconnect_bytes_per_s=args.interconnect_gbps * 1e9,
    )  # fmt: skip
    split = planner.rank_split(cfg, args.world_size)
    student, _ = planner.plan(cfg, args.world_size)
    memory = planner.estimate_memory(cfg, args.world_size, hw)
    warnings = planner.fit_warnings(memory, hw)
    print(f"megatron-gndpo {__version__} plan for {args.world_size} ranks")
    if split.rollout_ranks:
        print(
            f"rollout.disaggregate: ranks 0-{split.trainer_ranks - 1} train (the layouts below "
            f"cover them), ranks {split.trainer_ranks}-{args.world_size - 1} only generate"
        )
    print(planner.format_model_plan(student, per_rank=args.ranks))
    for teacher in planner.teacher_plans(cfg, args.world_size):
        print(planner.format_model_plan(teacher, per_rank=args.ranks))
    for key, section in teacher_sections(cfg):
        if section.server is not None:
            print(
                f"{key}: served at {section.server.url} (no weights on these ranks; its "
                "forward runs on the server and is not in the step time below)"
            )
    print(planner.format_memory(cfg, memory, hw))
    print("\n".join(warnings) if warnings else "every rank fits")
    if split.rollout_ranks:
        from megatron_gndpo.plan.disaggregated import format_disaggregated

        print(format_disaggregated(cfg, args.world_size, hw))
    else:
        step_time = planner.estimate_step_time(cfg, args.world_size, hw)
        print(planner.format_step_time(step_time, args.world_size, hw))
    batch = cfg.rollout.rollout_batch_size
    print(
        f"rollout: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} "
        f"samples = {batch} sequences per step, {batch // student.layout.dp} per student "
        f"data-parallel rank; GNDPO statistics all-reduced over DPxCP "
        f"({student.layout.dp * student.layout.cp} ranks)"
    )
    print("--- resolved config ---")
    print(to_yaml(cfg), end="")
    if args.out:
        print(f"wrote {save_resolved(cfg, args.out)}")
    return 0


TINY_CPU = Path(__file__).parent / "configs" / "tiny_cpu.yaml"


def _cmd_convert(args: argparse.Namespace) -> int:
    from megatron_gndpo.checkpoint import convert_cli

    if args.direction == "hf-to-mcore":
        convert_cli.hf_to_mcore_main(args.rest)
    else:
        convert_cli.mcore_to_hf_main(args.rest)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_gndpo.checks import check_paths
    from megatron_gndpo.compat import cpu, notices
    from megatron_gndpo.config import check_environment
    from megatron_gndpo.job.watchdog import Watchdog, report_error
    from megatron_gndpo.parallel import launch
    from megatron_gndpo.parallel.distributed import (
        DEFAULT_TIMEOUT_S,
        barrier,
        init_distributed,
        shutdown_distributed,
    )

    cfg = load_config(args.config or TINY_CPU, args.overrides)  # config errors before start-up
    notices.name_gpt_models(_gpt_models(cfg))
    t = cfg.trainer
    # A timeout <= 0 is reported by validate() below, once for the job: start with the default
    timeout_s = t.collective_timeout_s if t.collective_timeout_s > 0 else DEFAULT_TIMEOUT_S
    d = cfg.rollout.disaggregate
    env = init_distributed(timeout_s=timeout_s, rollout_ranks=d.ranks)
    rollout_rank = 0 < d.ranks < env.world_size and env.rank >= env.world_size - d.ranks
    watchdog, lock, code = None, None, 0
    if env.world_size > 1 and t.heartbeat_timeout_s > 0:
        watchdog = Watchdog(env, t.heartbeat_timeout_s)
    try:
        validate(cfg, env.world_size)
        check_environment(cfg)
        check_paths(cfg)  # before any model is built (and before megatron-core is imported)
        lock = _lock_run_dirs(cfg, env.rank)  # this job owns its directories (rank 0 holds)
        notices.log_to(Path(cfg.logging.run_dir) / notices.NOTICES_FILE)
        cpu.enable_if_no_cuda()
        if rollout_rank:  # rollout.disaggregate: this rank only samples, for the trainer
            from megatron_gndpo.engine.probe import model_probe
            from megatron_gndpo.rollout.remote import RolloutWorker

            RolloutWorker(cfg, probe=model_probe).run()
        else:
            from megatron_gndpo.trainer import Trainer

            trainer = Trainer(cfg)
            if env.rank == 0:  # only once the run has started: a failed resume keeps the old one
                print(f"resolved config written to {save_resolved(cfg, cfg.logging.run_dir)}")
            trainer.train()
            if trainer.interrupted:  # a first Ctrl-C: stopped after a step, and saved it
                code = _interrupted("train", saved=(trainer.step_count, trainer.c.save_dir))
    except UserError as err:
        report_error(str(err))  # once for the job, while the other ranks can still be asked
        if watchdog is not None:
            watchdog.stop(failed=True)  # the ranks still waiting for this one end too
        return 2
    except BaseException as err:
        if watchdog is not None:
            watchdog.stop(failed=True, said_why=False)  # a crash: the launcher names this rank
        if (gone := launch.lost_a_rank(err)) is None:
            raise
        _say_lost_rank(env.rank, gone)  # not this rank's failure: the launcher names the one
        return launch.LOST_A_RANK_EXIT
    else:
        if watchdog is not None:
            watchdog.stop()
            barrier()  # no rank exits (maybe taking the store along) before all have stopped
    finally:
        if lock is not None:
            lock.release()
        shutdown_distributed()
    return code


def _gpt_models(cfg: Config) -> list[str]:
    """The config sections of the models this run builds as a GPTModel (model_class=gpt)."""
    sections = [("model", cfg.model)] + [
        (f"{key}.model", t.model) for key, t in teacher_sections(cfg) if t.server is None
    ]
    return [key for key, model in sections if model.model_class == "gpt"]


def _say_lost_rank(rank: int, gone: str) -> None:
    """A collective of this rank failed because another rank went away: nothing under
    ``megatron-gndpo launch`` (its line names the rank that failed first), else one line."""
    from megatron_gndpo.parallel import launch

    if os.environ.get(launch.LAUNCHED_ENV) != "1":
        print(
            f"megatron-gndpo: rank {rank} stopped: another rank went away during a collective "
            f"({gone}); the launcher's output names it",
            file=sys.stderr, flush=True,
        )  # fmt: skip


def _lock_run_dirs(cfg: Config, rank: int) -> RunLock | None:
    """Rank 0 takes the locks of the run directory and of the checkpoint directory for the job
    (both: another run whose checkpoint.save names this run's checkpoints is refused, wherever
    its own run directory is); every rank raises the same refusal when another run holds one."""
    import torch.distributed as dist

    from megatron_gndpo.job.runlock import RunDirLockedError, RunLock

    lock, refusal = None, [""]
    if rank == 0:
        lock = RunLock([cfg.logging.run_dir, save_dir(cfg)], "train")
        try:
            lock.acquire()
        except RunDirLockedError as err:
            lock, refusal = None, [str(err)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise RunDirLockedError(refusal[0])
    if lock is not None:
        from megatron_gndpo.job.exit import on_forced_exit

        on_forced_exit(lock.release)  # the watchdog's os._exit runs no finally
    return lock


def _cmd_config(args: argparse.Namespace) -> int:
    if args.action == "fields":
        print(format_fields(names=config_names()))
        return 0
    cfg = validate(load_config(args.config, args.overrides), args.world_size)
    if args.action == "show":
        print(to_yaml(cfg), end="")
    else:
        where = f" for {args.world_size} ranks" if args.world_size else ""
        print(f"config is valid{where}")
    return 0


@contextlib.contextmanager
def _pinned_threads(threads: int) -> Iterator[None]:
    """Compute with ``threads`` CPU threads here and in the processes started meanwhile (the
    demo's numbers depend on the thread count: docs/demo/RESULTS.md); as before afterwards."""
    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def _cmd_demo(args: argparse.Namespace) -> int:
    with _pinned_threads(args.threads):
        return _cmd_demo_pinned(args)


def _cmd_demo_pinned(args: argparse.Namespace) -> int:
    from megatron_gndpo.compat import notices
    from megatron_gndpo.demo.report import summary_numbers, summary_table, verdict
    from megatron_gndpo.demo.run import SEED, run_demo
    from megatron_gndpo.job.runlock import locked

    if args.stability:
        return _cmd_demo_stability(args)
    args.run_dir = args.run_dir or Path("runs/demo")
    notices.log_to(args.run_dir / notices.NOTICES_FILE)
    methods = None
    if args.methods is not None:
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    with locked([args.run_dir], "demo"):  # one demo a run directory
        summary = run_demo(
            args.run_dir, args.cache_dir, quick=args.quick, methods=methods,
            seed=SEED if args.seed is None else args.seed, seeds=args.seeds,
            multimodal=args.multimodal, engine=args.engine, student=args.student,
        )  # fmt: skip
    numbers = summary_numbers(summary)
    print(f"report written to {summary.run_dir / 'summary.md'}")
    print(summary_table(numbers), end="")
    print(verdict(numbers), end="")
    return 0


def _cmd_demo_stability(args: argparse.Namespace) -> int:
    from megatron_gndpo.compat import notices
    from megatron_gndpo.demo.stability import (
        run_stability,
        stability_table,
        stability_verdict,
        study_numbers,
    )
    from megatron_gndpo.job.runlock import locked

    run_dir = args.run_dir or Path("runs/demo_stability")
    notices.log_to(run_dir / notices.NOTICES_FILE)
    with locked([run_dir], "demo --stability"):
        study = run_stability(run_dir, args.cache_dir, quick=args.quick)
    numbers = study_numbers(study)
    print(f"report written to {study.run_dir / 'stability.md'}")
    print(stability_table(numbers), end="")
    print(stability_verdict(numbers), end="")
    return 0


def _rollout_ranks(command: Sequence[str]) -> int:
    """``rollout.disaggregate.ranks`` of a ``train`` command's config, for the launcher's
    failure line; 0 for another command or a config that does not load (its workers said why)."""
    if not command or command[0] != "train":
        return 0
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a usage error: the workers print it
            args, extra = build_parser().parse_known_args(list(command))
        overrides = [*args.overrides, *(arg for arg in extra if not arg.startswith("-"))]
        return load_config(args.config or TINY_CPU, overrides).rollout.disaggregate.ranks
    except (Exception, SystemExit):
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # every later argument is torchrun's or the command's
        from megatron_gndpo.parallel import launch

        return launch.main(argv[1:], rollout_ranks=_rollout_ranks)
    parser = build_parser()
    # argparse fills a positional list only once: overrides after an option (`config validate
    # -n 8 a.b=1`, `plan a.b=1 -n 8 c.d=2`) come back unparsed. They are overrides all the same.
    args, extra = parser.parse_known_args(argv)
    handlers = {
        "plan": _cmd_plan, "config": _cmd_config, "train": _cmd_train, "demo": _cmd_demo,
        "convert": _cmd_convert, "prune": prune_cli.main, "compress": compress_cli.main,
    }  # fmt: skip
    if args.command == "convert":  # its options belong to the conversion's own parser
        args.rest = [*args.rest, *extra]
    else:
        unknown = [arg for arg in extra if arg.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command in ("demo", "prune"):  # they take no config overrides
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            if (
                args.command == "demo"
                and args.stability
                and (
                    args.methods
                    or args.multimodal
                    or args.seed is not None
                    or args.seeds is not None
                    or args.student != "pruned"
                    or args.engine != "builtin"
                )
            ):
                parser.error(
                    "demo --stability runs its own methods, seeds and student on the text task "
                    "with the built-in generator: leave out --methods, --multimodal, --seed, "
                    "--seeds, --student and --engine"
                )
        else:
            args.overrides = [*args.overrides, *extra]
    from megatron_gndpo.compat import notices
    from megatron_gndpo.engine.host_memory import reuse_freed_memory

    installed = notices.quiet_known_notices()  # every command; before megatron-core's import
    computes = args.command in ("train", "demo", "compress", "prune")  # they build models
    try:
        with reuse_freed_memory() if computes else contextlib.nullcontext():
            return handlers[args.command](args)
    except UserError as err:
        from megatron_gndpo.job.watchdog import report_error

        report_error(str(err))
        return 2
    except BrokenPipeError:  # `megatron-gndpo plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C: the user's own stop, not a bug
        return _interrupted(args.command)
    finally:
        if installed:  # a caller's process (a test) gets its warning hooks back
            notices.restore()


def _interrupted(command: str, saved: tuple[int, Path] | None = None) -> int:
    """One line for Ctrl-C (on the launcher's rank 0: every rank gets the signal), exit 130.
    ``saved``: train stopped on the first Ctrl-C, after saving (step, save directory)."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        if saved is not None:
            resume = (
                f": step {saved[0]} is saved in {saved[1]}, and the same command resumes from it"
            )
        elif command == "train":  # a second Ctrl-C, or one before the first step
            resume = (
                ": the checkpoints already written are intact, and the same command resumes "
                "from the newest (a single Ctrl-C during training saves the step first)"
            )
        elif command == "compress":
            resume = ": the finished stages are kept, and the same command resumes from the next"
        else:
            resume = ""
        print(f"megatron-gndpo: interrupted (Ctrl-C){resume}", file=sys.stderr, flush=True)
    return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
