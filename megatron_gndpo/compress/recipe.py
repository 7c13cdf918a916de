"""What a ``compress`` run is asked to do (:class:`Request`), and everything checked about it
before any model is loaded (:func:`plan`): the teacher's kind and architecture, the size asked
of the student, the trainer's config, the held-out questions and the training prompts.

The trainer's config is the base config (default ``examples/compress_smollm2.yaml``) with the
user's dotted overrides, where each model's architecture is its checkpoint's (a teacher or a
student of any depth and width needs no ``model.*`` override) and the paths, steps and run
directory are the recipe's own (:data:`OWN_KEYS`: set by the command's options instead).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from megatron_gndpo.compress.answers import Question, load_questions
from megatron_gndpo.config.schema import Config, ModelConfig
from megatron_gndpo.errors import UserError

# The recipe's record of what it was asked (compared on a rerun) and its finished stages.
REQUEST_FILE = "compress.json"
STAGES_DIR = "stages"
# Config keys the command's options set: an override of them is refused, naming the option.
OWN_KEYS = {
    "trainer.steps": "--steps", "checkpoint.init": "the recipe (the pruned or warmed-up student)",
    "teacher.load": "--teacher", "data.tokenizer": "--tokenizer", "logging.run_dir": "--out",
}  # fmt: skip
# ModelConfig fields a run chooses (precision, kernels, auxiliary losses): the config's; every
# other field is the architecture, read from the model's checkpoint.
RUN_CHOICES = frozenset({
    "params_dtype", "transformer_impl", "core_attention", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_capacity_factor", "vision",
})  # fmt: skip


class CompressError(UserError, ValueError):
    """A compression request that cannot be carried out (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """The command's options (``megatron-gndpo compress --help``)."""

    teacher: Path
    out: Path
    layers: int | None
    keep_layers: tuple[int, ...] | None
    importance: Literal["cosine", "kl"]
    calib_samples: int
    warmup_steps: int
    steps: int
    eval_interval: int
    eval_file: Path
    eval_samples: int
    config: Path
    overrides: tuple[str, ...]
    tokenizer: str | None

    def describe(self) -> dict[str, Any]:
        """The request as JSON values (``compress.json``)."""
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: what each stage reads."""

    request: Request
    teacher_kind: Literal["hf", "mcore"]
    teacher_checkpoint: Path  # the converted one (OUT/teacher) for a Hugging Face teacher
    teacher_model: ModelConfig
    tokenizer: str  # data.tokenizer of both models
    questions: list[Question]
    train_prompts: list[str]  # the calibration prompts and the warm-up's questions
    config: Config  # the trainer's config at the teacher's architecture (checked, not run)

    @property
    def out(self) -> Path:
        return self.request.out

    def stage_dir(self, name: str) -> Path:
        return self.out / name


def _check_numbers(r: Request) -> None:
    for flag, value, least in (("--steps", r.steps, 1), ("--eval-interval", r.eval_interval, 1),
                               ("--warmup-steps", r.warmup_steps, 0),
                               ("--calib-samples", r.calib_samples, 1),
                               ("--eval-samples", r.eval_samples, 1)):  # fmt: skip
        if value < least:
            raise CompressError(f"{flag} {value}: must be at least {least}")


def teacher_kind(teacher: Path) -> Literal["hf", "mcore"]:
    """``hf``: a Hugging Face model directory (its config.json); ``mcore``: anything else, a
    megatron checkpoint root or step, which the load checks."""
    if not teacher.exists():
        raise CompressError(
            f"--teacher {teacher} does not exist; name a Hugging Face model directory (with its "
            "config.json) or a megatron checkpoint (root or iter_* step)"
        )
    return "hf" if (teacher / "config.json").is_file() else "mcore"


def _teacher_model(teacher: Path, kind: str) -> ModelConfig:
    if kind == "hf":
        from megatron_gndpo.checkpoint import hf_mapping
        from megatron_gndpo.checkpoint.convert import read_hf_config

        return hf_mapping.model_config_from_hf(read_hf_config(teacher))
    from megatron_gndpo.prune.run import teacher_architecture

    return teacher_architecture(teacher)


def _tokenizer(r: Request, kind: str) -> str:
    if r.tokenizer is not None or kind == "hf":
        return r.tokenizer or str(r.teacher)  # an HF directory holds its tokenizer
    from megatron_gndpo.prune.cli import tokenizer_spec

    return tokenizer_spec(str(r.teacher), None)


def check_out(r: Request) -> None:
    """OUT is new, empty, or a compression of this very request (then it resumes)."""
    out = r.out
    if out.exists() and not out.is_dir():
        raise CompressError(f"--out {out} is a file; name a directory for the run")
    if not out.is_dir() or not any(out.iterdir()):
        return
    saved = out / REQUEST_FILE
    if not saved.is_file():
        raise CompressError(
            f"--out {out} is not empty and holds no {REQUEST_FILE} (not a compress run); name a "
            "new directory for the run"
        )
    before, now = json.loads(saved.read_text()), r.describe()
    changed = sorted(k for k in now if before.get(k) != now[k])
    if changed:
        what = ", ".join(f"{k} {before.get(k)!r} -> {now[k]!r}" for k in changed)
        raise CompressError(
            f"--out {out} holds a compress run made with other settings ({what}): its finished "
            "stages would not match; use a new --out, or delete that directory to start again"
        )


def record(r: Request) -> None:
    """OUT made, with the request in it (what a rerun is compared with)."""
    r.out.mkdir(parents=True, exist_ok=True)
    (r.out / REQUEST_FILE).write_text(json.dumps(r.describe(), indent=2) + "\n")


def plan(r: Request) -> Plan:
    """The request checked, everything read that the stages need, before any model is built."""
    from megatron_gndpo.data.datasets import PromptOptions, load_prompts
    from megatron_gndpo.data.tokenizer import load_tokenizer
    from megatron_gndpo.prune.run import check_shape

    _check_numbers(r)
    check_out(r)
    kind = teacher_kind(r.teacher)
    teacher_model = _teacher_model(r.teacher, kind)
    most = teacher_model.num_layers - 1
    if r.layers is not None and not 1 <= r.layers <= most:
        raise CompressError(
            f"--layers {r.layers}: the teacher has {teacher_model.num_layers} layers; the "
            f"student keeps 1 to {most}"
        )
    check_shape(teacher_model, num_layers=r.layers or 0, keep_layers=r.keep_layers,
                ffn_hidden_size=None)  # --keep-layers: distinct, in order, not all  # fmt: skip
    layers = len(r.keep_layers) if r.keep_layers is not None else int(r.layers or 0)
    checkpoint = r.out / "teacher" if kind == "hf" else r.teacher
    questions = load_questions(r.eval_file)
    tokenizer = _tokenizer(r, kind)
    load_tokenizer(tokenizer, setting="--tokenizer")  # a wrong one: said now, not after pruning
    config = trainer_config(
        r, student=r.out / "pruned", teacher=checkpoint, tokenizer=tokenizer,
        student_model=dataclasses.replace(teacher_model, num_layers=layers),
        teacher_model=teacher_model, run_dir=r.out / "distill",
    )  # fmt: skip
    from megatron_gndpo.checks import validate

    validate(config, 1)
    examples = load_prompts(
        config.data.train, prompt_key=config.data.prompt_key,
        named_by=PromptOptions(file="data.train (the training prompts)"),
    )  # fmt: skip
    return Plan(
        request=r, teacher_kind=kind, teacher_checkpoint=checkpoint, teacher_model=teacher_model,
        tokenizer=tokenizer, questions=questions, train_prompts=[e.prompt for e in examples],
        config=config,
    )  # fmt: skip


def trainer_config(
    r: Request, *, student: Path, teacher: Path, tokenizer: str, student_model: ModelConfig,
    teacher_model: ModelConfig, run_dir: Path,
) -> Config:  # fmt: skip
    """The base config with the user's overrides, the recipe's paths and steps, and each model's
    architecture (``student_model``, ``teacher_model``: its checkpoint's) where the user's
    overrides do not name the field."""
    from megatron_gndpo.config.loader import load_config

    given = {o.split("=", 1)[0] for o in r.overrides}
    clash = sorted(given & set(OWN_KEYS))
    if clash:
        key = clash[0]
        raise CompressError(f"override {key}: compress sets it from {OWN_KEYS[key]}; leave it out")
    ours = [
        f"checkpoint.init={student}", f"teacher.load={teacher}", f"data.tokenizer={tokenizer}",
        f"trainer.steps={r.steps}", f"logging.run_dir={run_dir}",
        # the recipe evaluates on its own questions (--eval) and saves the last step only
        "trainer.eval_interval=0", "data.eval=null", f"checkpoint.save_interval={r.steps}",
    ]  # fmt: skip
    cfg = load_config(r.config, [o for o in ours if o.split("=", 1)[0] not in given]
                      + list(r.overrides))  # fmt: skip
    return dataclasses.replace(
        cfg,
        model=_architecture(cfg.model, student_model, "model", given),
        teacher=dataclasses.replace(
            cfg.teacher,
            model=_architecture(cfg.teacher.model, teacher_model, "teacher.model", given),
        ),
    )


def _architecture(model: ModelConfig, saved: ModelConfig, section: str,
                  given: set[str]) -> ModelConfig:  # fmt: skip
    fields = {
        f.name: getattr(saved, f.name) for f in dataclasses.fields(ModelConfig)
        if f.name not in RUN_CHOICES and f"{section}.{f.name}" not in given
    }  # fmt: skip
    return dataclasses.replace(model, **fields)
