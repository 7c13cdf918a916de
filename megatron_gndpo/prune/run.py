"""Make a student from a teacher checkpoint: fewer layers (and a narrower FFN), same tokenizer.

    result = prune_checkpoint("ckpt/teacher", "ckpt/student", num_layers=10,
                              prompts=load_prompts("builtin:chains"), tokenizer=tok)
    # result.out -> checkpoint.init of a distillation run, with the teacher as teacher.load

The calibration text is the teacher's own: each calibration prompt in the teacher's chat
template, followed by the teacher's greedy answer (the built-in KV-cached generator), so the
layers are chosen for the distribution on-policy distillation then trains on. Or pass
``sequences`` (token ids with their prompt lengths) to calibrate on a text of your own.

The teacher loads at TP=1/PP=1 in one process (a checkpoint saved at any layout reshards on
load), the student is saved as a model-only checkpoint at step 0 with the teacher's side files
(tokenizer, ``hf_config.json`` with the new depth and width) and ``prune.json``: what was kept,
the importance measured and the calibration KL. It loads at any TP/PP like any other.

This prunes on the CPU or one GPU, in fp32 or the checkpoint's dtype, and measures what it
cuts; NVIDIA ModelOpt's Minitron pruning (``modelopt.torch.prune``) searches width in more
axes (attention heads, embedding channels) and needs a GPU: prefer it for large models on a
cluster, and this for depth pruning and anywhere without one (docs/PRUNING.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_gndpo.checkpoint import hf_mapping
from megatron_gndpo.checkpoint.convert import (
    HF_CONFIG_FILE,
    VISION_CONFIG_FILE,
    SavedModel,
    describe_checkpoints,
    saved_model,
)
from megatron_gndpo.checkpoint.dist import save_checkpoint
from megatron_gndpo.checkpoint.load import load_model
from megatron_gndpo.config.schema import Dtype, ModelConfig, ParallelConfig
from megatron_gndpo.data.tokenizer import Tokenizer, copy_tokenizer_files
from megatron_gndpo.errors import UserError
from megatron_gndpo.prune.importance import (
    Importance,
    LayerChoice,
    calibration_batches,
    ffn_importance,
    kl_from_reference,
    only_layers,
    reference_logprobs,
    select_layers,
)
from megatron_gndpo.prune.student import pruned_state, student_config, top_neurons

REPORT_FILE = "prune.json"
_STEP = re.compile(r"iter_\d{7}")  # a checkpoint's step directory
# Calibration sequences scored together: bounds the [B, S, V] logits of one forward.
BATCH_SIZE = 8


class PruneError(UserError, ValueError):
    """A pruning request that cannot be carried out (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What :func:`prune_checkpoint` wrote and measured."""

    out: Path
    model: ModelConfig  # the student's architecture
    choice: LayerChoice  # the teacher layers kept and the search's measurements
    kl: float  # the student's per-token KL from the teacher on the calibration tokens
    teacher_parameters: int
    student_parameters: int
    calibration_sequences: int
    calibration_tokens: int
    seconds: float

    def describe(self) -> dict[str, Any]:
        return {
            "keep_layers": list(self.choice.keep),
            "importance": self.choice.importance,
            "scores": self.choice.scores,
            "kl_layers_only": self.choice.kl,
            "kl": self.kl,
            "num_layers": self.model.num_layers,
            "ffn_hidden_size": self.model.ffn_hidden_size,
            "teacher_parameters": self.teacher_parameters,
            "student_parameters": self.student_parameters,
            "calibration_sequences": self.calibration_sequences,
            "calibration_tokens": self.calibration_tokens,
            "seconds": self.seconds,
        }


def _parameters(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for k, t in state.items() if not hf_mapping.is_extra_state(k))


def check_output(out: Path, overwrite: bool, teacher: str | Path | None = None) -> None:
    """Refuse an output directory whose content the student would replace or delete: the
    ``teacher`` checkpoint (the directory itself, one inside it or one holding it), a training
    run's checkpoints (or a run directory holding them), and, without ``overwrite``, any
    directory that is not empty. ``overwrite`` replaces a student that prune wrote there before
    (its prune.json is there), nothing else: the directory is removed first."""
    if out.exists() and not out.is_dir():
        raise PruneError(f"--out {out} is a file; name a new directory for the student")
    if teacher is not None:
        _check_apart_from_teacher(out, Path(teacher))
    if not out.is_dir():
        return
    run = _training_run(out)
    if run is not None:
        raise PruneError(
            f"--out {out} {run}: prune never writes there (the student would replace its "
            "latest and model_config.yaml, and --overwrite would delete its steps); name a new "
            "directory for the student"
        )
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    if not overwrite:
        raise PruneError(
            f"--out {out} is not empty (it holds {shown}); name a new directory for the student "
            "(or pass --overwrite to replace a student prune wrote there before)"
        )
    if not (out / REPORT_FILE).is_file():
        raise PruneError(
            f"--out {out} holds {shown}, not a student prune wrote (no {REPORT_FILE}): "
            "--overwrite replaces only such a student, so nothing of yours is deleted; name a "
            "new directory for the student"
        )


def _check_apart_from_teacher(out: Path, teacher: Path) -> None:
    """``out`` must neither be the teacher checkpoint (root or step) nor hold it nor lie in it."""
    where = out.resolve()
    t = teacher.resolve()
    roots = [t, t.parent] if _STEP.fullmatch(t.name) else [t]
    how = (
        "is the teacher checkpoint" if where in roots
        else "lies inside the teacher checkpoint" if any(where.is_relative_to(r) for r in roots)
        else "holds the teacher checkpoint" if t.is_relative_to(where)
        else None
    )  # fmt: skip
    if how is not None:
        raise PruneError(
            f"--out {out} {how} ({teacher}): writing the student there would delete the "
            "teacher's steps and tokenizer; name a new directory for the student"
        )


def _training_run(out: Path) -> str | None:
    """What of a training run ``out`` holds (its checkpoints, or a run's lock file), directly or
    in a directory one level down (a run directory's checkpoints/); None when nothing."""
    from megatron_gndpo.checkpoint.dist import step_dir, training_steps
    from megatron_gndpo.job.runlock import LOCK_FILE

    for directory in [out, *sorted(p for p in out.iterdir() if p.is_dir())]:
        steps = training_steps(directory)
        inside = "" if directory == out else f" in {directory.name}/"
        if steps:
            newest = step_dir(directory, steps[-1]).name
            return f"holds a training run's checkpoints{inside} (newest {newest})"
        if (directory / LOCK_FILE).exists():
            return f"belongs to a training run (its lock file is there{inside.rstrip('/')})"
    return None


def teacher_sequences(
    net: Any,
    groups: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
) -> list[tuple[list[int], int]]:
    """Each prompt in the chat template followed by the teacher's greedy answer (ids, prompt
    length)."""
    from megatron_gndpo.rollout.builtin import MegatronGenerator
    from megatron_gndpo.rollout.greedy import greedy_answers

    answers = greedy_answers(
        MegatronGenerator.for_model(net, groups, tokenizer),
        [tokenizer.apply_chat_template(p) for p in prompts], max_new_tokens=max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,),
    )  # fmt: skip
    return [(a.ids, a.prompt_length) for a in answers]


def prune_checkpoint(
    teacher: str | Path,
    out: str | Path,
    *,
    num_layers: int,
    tokenizer: Tokenizer,
    prompts: Sequence[str] = (),
    sequences: Sequence[tuple[Sequence[int], int]] | None = None,
    ffn_hidden_size: int | None = None,
    keep_layers: Sequence[int] | None = None,
    importance: Importance = "kl",
    max_new_tokens: int = 64,
    overwrite: bool = False,
    dtype: Dtype | None = None,
    model: ModelConfig | None = None,
) -> PruneResult:
    """Write the student pruned from checkpoint ``teacher`` to ``out`` (module docstring).

    ``keep_layers`` names the teacher layers to keep instead of searching; ``sequences``
    replaces the teacher-written calibration text of ``prompts``. ``dtype`` ("fp32", "bf16")
    builds the teacher in that dtype for the measurements (default: as saved); the student is
    saved in it. ``model``: the teacher's architecture when no ``model_config.yaml`` is
    beside the checkpoint (``--model-config``). Runs in this process's world (one process;
    started and ended here if none).
    """
    from megatron_gndpo.parallel.world import one_process_world

    out = Path(out)
    check_output(out, overwrite, teacher)
    saved = _read_teacher(teacher, model, dtype or "saved")
    model = saved.model
    num_layers = _check_request(
        model, tokenizer, num_layers=num_layers, keep_layers=keep_layers,
        ffn_hidden_size=ffn_hidden_size, calibrated=sequences is not None or bool(prompts),
    )  # fmt: skip
    # the teacher loads at TP=1/PP=1 whatever layout it was saved at
    with one_process_world(reuse=True, alone="prune") as groups:
        began = time.perf_counter()
        net = load_model(saved.step, groups, model=model, vocab_size=tokenizer.vocab_size)
        if sequences is None:
            sequences = teacher_sequences(
                net, groups, tokenizer, list(prompts), max_new_tokens=max_new_tokens
            )
        batches = calibration_batches(sequences, pad_id=tokenizer.pad_id, batch_size=BATCH_SIZE)
        vocab = tokenizer.vocab_size
        if keep_layers is None:
            choice = select_layers(
                net, batches, num_layers=num_layers, vocab_size=vocab, importance=importance
            )
        else:
            choice = _given_layers(net, batches, keep_layers, importance, vocab)
        neurons = None
        if ffn_hidden_size is not None:  # measured on the kept layers, as the student runs
            with only_layers(net, choice.keep):
                activity = ffn_importance(net, batches)
            neurons = [top_neurons(a, ffn_hidden_size) for a in activity]
        student_model = student_config(
            model, num_layers=len(choice.keep), ffn_hidden_size=ffn_hidden_size
        )
        student = _build_student(net, model, student_model, choice.keep, neurons, groups)
        result = PruneResult(
            out=out, model=student_model, choice=choice,
            kl=kl_from_reference(student, batches, reference_logprobs(net, batches, vocab), vocab),
            teacher_parameters=_parameters(net.state_dict()),
            student_parameters=_parameters(student.state_dict()),
            calibration_sequences=len(sequences),
            calibration_tokens=sum(int(b.mask.sum()) for b in batches),
            seconds=time.perf_counter() - began,
        )  # fmt: skip
        del net
        _write(result, student, saved.root, overwrite)
    return result


def _read_teacher(
    teacher: str | Path, model: ModelConfig | None, dtype: Dtype | Literal["saved"] | None
) -> SavedModel:
    """The teacher checkpoint and its architecture (``model`` when given), in ``dtype`` ("saved":
    the dtype it was saved in; None: as the architecture says, reading no tensor); a
    CheckpointError or PruneError before anything is built."""
    saved = saved_model(teacher, model, dtype=dtype)
    if (saved.root / VISION_CONFIG_FILE).is_file():
        raise PruneError(
            f"{teacher} is a vision-language checkpoint; prune takes text models (prune the "
            "language model of a VLM through the demo's multimodal recipe, or ModelOpt)"
        )
    return saved


def teacher_architecture(teacher: str | Path, model: ModelConfig | None = None) -> ModelConfig:
    """The teacher checkpoint's architecture (``model`` when given, else what is beside it),
    read without touching its weights: what :func:`check_shape` checks a request against."""
    return _read_teacher(teacher, model, dtype=None).model


def _check_request(
    model: ModelConfig,
    tokenizer: Tokenizer,
    *,
    num_layers: int,
    keep_layers: Sequence[int] | None,
    ffn_hidden_size: int | None,
    calibrated: bool,
) -> int:
    """How many teacher layers the student keeps, once the request fits the teacher ``model``;
    a PruneError naming the fix where it does not."""
    if tokenizer.vocab_size > model.vocab_size:
        raise PruneError(
            f"the tokenizer produces {tokenizer.vocab_size} ids but the teacher's vocabulary is "
            f"{model.vocab_size}: pass the teacher's own tokenizer (--tokenizer)"
        )
    if not calibrated:
        raise PruneError("pruning needs calibration prompts (--calib-data) or sequences")
    return check_shape(
        model, num_layers=num_layers, keep_layers=keep_layers, ffn_hidden_size=ffn_hidden_size
    )


def check_shape(
    model: ModelConfig,
    *,
    num_layers: int,
    keep_layers: Sequence[int] | None,
    ffn_hidden_size: int | None,
) -> int:
    """How many of the teacher ``model``'s layers the student keeps (``--num-layers`` or
    ``--keep-layers``, and ``--ffn-hidden-size``), or a PruneError naming the fix; needs only
    the architecture, so the command checks it before loading anything."""
    width_only = ffn_hidden_size is not None  # then every layer may stay
    if keep_layers is not None:
        _check_keep(keep_layers, model.num_layers, width_only)
        num_layers = len(keep_layers)
    most = model.num_layers if width_only else model.num_layers - 1
    if not 1 <= num_layers <= most:
        raise PruneError(
            f"--num-layers {num_layers}: the teacher has {model.num_layers} layers; keep 1 to "
            f"{most}{'' if width_only else ' (or cut the FFN with --ffn-hidden-size)'}"
        )
    if ffn_hidden_size is not None and not 1 <= ffn_hidden_size <= model.ffn_hidden_size:
        raise PruneError(
            f"--ffn-hidden-size {ffn_hidden_size}: the teacher's FFN is {model.ffn_hidden_size} "
            f"wide; choose 1 to {model.ffn_hidden_size}"
        )
    if ffn_hidden_size is not None and model.is_moe:
        raise PruneError(
            "--ffn-hidden-size prunes a dense FFN; this teacher is a mixture-of-experts model: "
            "prune it in depth only (leave out --ffn-hidden-size)"
        )
    return num_layers


def _given_layers(
    net: Any, batches: Any, keep: Sequence[int], importance: Importance, vocab: int
) -> LayerChoice:
    """The layers ``keep`` the user chose, with the KL of keeping only them."""
    reference = reference_logprobs(net, batches, vocab)
    with only_layers(net, keep):
        kl = kl_from_reference(net, batches, reference, vocab)
    return LayerChoice(tuple(keep), importance, {"given": True}, kl)


def _build_student(
    net: Any,
    teacher: ModelConfig,
    model: ModelConfig,
    keep: Sequence[int],
    neurons: list[torch.Tensor] | None,
    groups: Any,
) -> Any:
    """The student of architecture ``model``: the teacher ``net``'s layers ``keep`` (and FFN
    ``neurons``), in eval mode."""
    from megatron_gndpo.models.build import build_model

    student = build_model(model, ParallelConfig(), groups)
    load_pruned(student, pruned_state(
        net.state_dict(), keep, neurons=neurons, swiglu=teacher.swiglu,
        model_class=teacher.model_class,
    ))  # fmt: skip
    student.eval()
    return student


def _check_keep(keep: Sequence[int], total: int, width_only: bool) -> None:
    if not keep or list(keep) != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= total:
        raise PruneError(
            f"--keep-layers {','.join(map(str, keep))}: name distinct teacher layers in "
            f"increasing order, each 0 to {total - 1}"
        )
    if len(keep) == total and not width_only:
        raise PruneError(
            f"--keep-layers keeps all {total} layers: leave at least one out, or cut the FFN "
            "with --ffn-hidden-size"
        )


def load_pruned(student: Any, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``student``; every weight must be there with the student's shape."""
    own = {k: v for k, v in student.state_dict().items() if not hf_mapping.is_extra_state(k)}
    missing = [k for k in own if k not in state]
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or wrong:  # a bug of the mapping, never a user's mistake
        raise RuntimeError(f"pruned state does not fit the student: missing {missing[:4]}, "
                           f"shape {wrong[:4]}")  # fmt: skip
    # megatron's _extra_state entries (FP8 metadata) stay the student's own
    student.load_state_dict({k: state.get(k, v) for k, v in student.state_dict().items()})


def _write(result: PruneResult, student: Any, base: Path, overwrite: bool) -> None:
    out = result.out
    if overwrite and out.is_dir():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, 0, student, model_config=result.model, tokenizer=str(base))
    describe_checkpoints(out, result.model)
    copy_tokenizer_files(base, out)
    source = base / HF_CONFIG_FILE
    if source.is_file():  # the source's config.json (token ids, family) at the new size
        hf = json.loads(source.read_text())
        hf["num_hidden_layers"] = result.model.num_layers
        if "intermediate_size" in hf:
            hf["intermediate_size"] = result.model.ffn_hidden_size
        (out / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    report = {"teacher": str(base)} | result.describe()
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
