"""Checkpoints through megatron-core dist-checkpointing: atomic, verified, resharding on load.

Layout of a checkpoint root::

    ROOT/
      iter_0000100/              one step, written by every rank together
        <dist-checkpointing files>
        megatron_gndpo.json      step, run id, extra state (data position, ...), and the size and
                                 SHA-256 of every other file of the step
        train_state.pt           Megatron-Bridge's train state; with the architecture known,
        run_config.yaml          also its run config (and Megatron-LM's ``args`` in the common
                                 state): see checkpoint/interop.py
      latest                     text: the newest complete step ("100")
      latest_checkpointed_iteration.txt   the same, for Megatron-LM
      latest_train_state.pt      the same, for Megatron-Bridge
      model_config.yaml          the architecture (written by training and conversion)

A step is written into ``iter_XXXXXXX.tmp`` and renamed by rank 0 only after every rank has
finished and the checksums are written, then ``latest`` is replaced atomically: a run killed
mid-save leaves the previous checkpoint as ``latest``, and the half-written ``.tmp`` directory is
ignored (and removed by the next save); the trackers of the other tools are replaced the same
way, with ``latest`` (:func:`write_latest`). Nothing is saved when the student's weights or
optimizer state hold a NaN or an infinity. A load first checks every file against its checksum
(the ranks share the reading) and refuses a step that does not match, naming the file; after
loading, the weights are checked to be finite. Loading works at any TP/PP: dist-checkpointing
reshards the saved tensors onto the model it is given. Only the model is needed to load a
teacher; the student also saves its optimizer state.

Pruning (``keep_last``) only removes steps written by the same run (``run_id``, kept across
resumes), never another run's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.checkpoint import disk, foreign_config, interop, model_class
from megatron_gndpo.checkpoint.errors import CheckpointError, CorruptCheckpointError
from megatron_gndpo.checkpoint.integrity import (
    _META,
    _from_rank0,
    _gather,
    _manifest,
    _shown,
    nonfinite,
    read_meta,
    run_of,
    verify_step,
)
from megatron_gndpo.checkpoint.vocab_rows import vocab_rows_problem
from megatron_gndpo.compat import safe_pickle
from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.fileio import write_atomic
from megatron_gndpo.parallel.distributed import barrier, rank, world_size

_LATEST = "latest"
MODEL_CONFIG_FILE = "model_config.yaml"
_DIST_MARKER = "metadata.json"  # in every megatron-core dist checkpoint, whoever wrote it
# Root files pointing at the newest step, for us and for the other tools; moved with `latest`.
TRACKERS = (_LATEST, interop.MEGATRON_LM_TRACKER, interop.BRIDGE_TRACKER)
_STEP_NAME = re.compile(r"iter_(\d{7})")
# Optimizer sharding that reloads at another data-parallel size; "fully_reshardable" failed to
# load in megatron-core 0.19 (KeyError: 'step').
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def complete_steps(root: str | Path) -> list[int]:
    """Steps under ``root`` whose directory is complete (renamed, with its metadata), oldest
    first; ``.tmp`` and other directories are not steps."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_NAME.fullmatch(path.name)
        if match and (path / _META).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def training_steps(root: str | Path) -> list[int]:
    """The complete steps under ``root`` that a training run saved (with optimizer state),
    oldest first: what a resume continues from, and what conversion must never touch."""
    steps = []
    for step in complete_steps(root):
        try:
            if read_meta(step_dir(root, step)).get("has_optimizer"):
                steps.append(step)
        except CorruptCheckpointError:
            continue
    return steps


# What a run resuming from its own save directory may do instead of repairing `latest`.
START_FRESH = "set checkpoint.start_fresh=true to move the iterations aside and start at step 1"


def latest_step(root: str | Path, *, instead: str | None = None) -> int | None:
    """The newest complete step under ``root`` (its ``latest`` file), or None when there is none.
    A corrupt ``latest`` is a CheckpointError naming the fix: repair it, name a step directory
    instead of the root, or ``instead`` (a resuming run: :data:`START_FRESH`)."""
    marker = Path(root) / _LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    steps = complete_steps(root)
    other = instead or "name a complete iter_* step directory instead of its root"
    if not text.isdigit():
        newest = f"; the newest complete step is {steps[-1]}" if steps else ""
        raise CheckpointError(
            f"{marker} is corrupt (holds {text!r}, expected a step number){newest}. Write the "
            f"step of a complete iter_* directory into it (echo {steps[-1] if steps else 'N'} > "
            f"{marker}), or {other}"
        )
    step = int(text)
    if step not in steps:
        older = [s for s in steps if s < step]
        fix = (
            f"point it at the newest older complete step (echo {older[-1]} > {marker})"
            if older
            else other
        )
        raise CheckpointError(
            f"{marker} names step {step} but {step_dir(root, step)} is incomplete or missing; "
            f"restore that directory, or {fix}"
        )
    return step


def saved_tensors(directory: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor saved in a step directory, read from its
    dist-checkpointing metadata alone (no tensor data; any process, no collective)."""
    from megatron.core import dist_checkpointing

    try:
        with safe_pickle.restricted_unpickling():
            meta = dist_checkpointing.load_tensors_metadata(str(directory))
    except safe_pickle.UnsafePickleError as err:
        raise CheckpointError(f"cannot load {directory}: {err}") from None
    except Exception as err:  # megatron raises its own CheckpointingException and OSErrors
        raise CheckpointError(f"cannot read the tensor metadata of {directory}: {err}") from err
    return {key: (tuple(t.global_shape), t.dtype) for key, t in meta.items()}


# ---------------------------------------------------------------------------------------------
# Save


def _model_state(model: Any) -> dict[str, Any]:
    # DDP's sharded_state_dict keys carry a "module." prefix that load rejects: use the inner model.
    inner = getattr(model, "module", model)
    # Replica ids come from megatron's global data-parallel group unless the model's own is
    # given: the teacher's layout (another DP size) needs its own.
    pgs = getattr(inner, "pg_collection", None)
    if pgs is not None and hasattr(pgs, "dp_cp"):
        return inner.sharded_state_dict(metadata={"dp_cp_group": pgs.dp_cp})
    return inner.sharded_state_dict()


def _save_refusal(root: Path, step: int, model: Any, optimizer: Any, run_id: str | None) -> str:
    """Why ``step`` must not be saved (empty when it may); the same answer on every rank."""
    bad = nonfinite(model, optimizer)
    steps = complete_steps(root)
    intact = f"; the newest checkpoint, {step_dir(root, steps[-1])}, is intact" if steps else ""
    if bad:
        return (
            f"refusing to save step {step}: non-finite values (NaN or inf) in {_shown(bad)}. "
            f"Nothing was written{intact}; a restart resumes from it. Lower optimizer.lr or "
            "check the data and the initial checkpoint"
        )
    final = step_dir(root, step)
    other = None
    if rank() == 0 and (final / _META).is_file():
        theirs = run_of(final)
        other = theirs if theirs != run_id else None
    other = _from_rank0(other)
    if other is not None:
        return (
            f"refusing to save step {step}: {final} belongs to another run (run id {other}) and "
            "would be overwritten; give this run its own checkpoint.save directory"
        )
    return ""


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Any,
    *,
    optimizer: Any = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    run_id: str | None = None,
    model_config: ModelConfig | None = None,
    tokenizer: str | None = None,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) at ``step`` under ``root`` on every rank; atomic.

    ``extra`` (JSON-serialisable: data position, RNG seeds, metrics) is stored beside the tensors;
    ``run_id`` names the run, whose own older steps beyond ``keep_last`` are then deleted.
    ``model_config`` (a text model's) also writes what Megatron-LM and Megatron-Bridge need to
    load the weights: their ``args`` and ``run_config.yaml`` (``checkpoint/interop.py``);
    ``tokenizer`` (``data.tokenizer``) adds Megatron-LM's tokenizer arguments to the ``args``.
    ``extra_files`` writes further files of this rank into the step directory (called on every rank
    with it, before the checksums that cover them).
    Raises :class:`CheckpointError`, writing nothing, when a weight or optimizer value is not
    finite or ``root`` holds this step from another run, and, keeping nothing of the step, when
    the disk fills up (``checkpoint/disk.py``). Returns the final step directory.
    """
    root = Path(root)
    refusal = _save_refusal(root, step, model, optimizer, run_id)
    if refusal:
        raise CheckpointError(refusal)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if optimizer is not None:
        # A run whose every step so far was skipped (a filter that dropped every row) has
        # taken no optimizer step: its state is what a fresh optimizer starts from.
        _init_empty_optimizer_state(optimizer)
    steps = complete_steps(root)
    needed = disk.step_bytes(step_dir(root, steps[-1]) if steps else None, model)
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    writer_errors = disk.HeldWriterErrors()  # megatron's writer logs a failure: said below
    try:
        with writer_errors:
            _write_step(tmp, step, model, optimizer, model_config, tokenizer, extra_files)
        files = _manifest(tmp)
        if rank() == 0:
            meta = {
                "step": step, "run_id": run_id, "has_optimizer": optimizer is not None,
                "extra": extra or {}, "files": files,
            }  # fmt: skip
            (tmp / _META).write_text(json.dumps(meta, indent=2))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            write_latest(root, step)
    except BaseException as err:  # torch's CheckpointException is a BaseException
        interrupted = isinstance(err, KeyboardInterrupt | SystemExit)
        full = None if interrupted else disk.disk_full(err, tmp, needed)  # before tmp goes
        if rank() == 0:  # no half-written step is left behind (the next save would remove it)
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            newest = step_dir(root, steps[-1]) if steps else None
            raise CheckpointError(disk.cannot_save(step, full, newest)) from err
        writer_errors.release()
        raise
    if rank() == 0 and keep_last:
        _prune(root, keep_last, run_id)
    barrier()
    return final


def _write_step(
    tmp: Path,
    step: int,
    model: Any,
    optimizer: Any,
    model_config: ModelConfig | None,
    tokenizer: str | None,
    extra_files: Callable[[Path], None] | None,
) -> None:
    """The tensors and the other tools' files of a step into ``tmp`` (every rank)."""
    from megatron.core import dist_checkpointing

    from megatron_gndpo.compat import saving

    sharded: dict[str, Any] = {"model": _model_state(model)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(
            sharded["model"], metadata=_OPTIMIZER_METADATA
        )
    tp, pp = _tp_pp(model)
    text_model = model_config if model_config is not None and model_config.vision is None else None
    # Megatron-LM's entries of the common state (args, iteration, checkpoint_version)
    sharded.update(interop.megatron_lm_common(
        text_model, step=step, tp=tp, pp=pp, world_size=world_size(), tokenizer=tokenizer
    ))  # fmt: skip
    saving.keep_write_results_in_process()  # no manager process to outlive a killed rank
    dist_checkpointing.save(sharded, str(tmp), content_metadata=_OPTIMIZER_METADATA)
    barrier()
    if rank() == 0:  # before the checksums: they cover these too
        interop.write_bridge_step_files(tmp, step, text_model, tp=tp, pp=pp)
    if extra_files is not None:
        extra_files(tmp)
        barrier()


def write_latest(root: str | Path, step: int) -> None:
    """Point ``latest``, and the trackers of Megatron-LM and Megatron-Bridge, at ``step``
    (rank 0 only), each replaced atomically; ``latest`` last, so that what we resume from is
    never ahead of the others."""
    root = Path(root)
    write_atomic(root / interop.MEGATRON_LM_TRACKER, f"{step}".encode())
    write_atomic(root / interop.BRIDGE_TRACKER, interop.bridge_train_state_bytes(step))
    write_atomic(root / _LATEST, f"{step}\n".encode())


def _tp_pp(model: Any) -> tuple[int, int]:
    """The tensor- and pipeline-parallel sizes ``model`` was built at (1, 1 when not megatron)."""
    config = getattr(getattr(model, "module", model), "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    pp = getattr(config, "pipeline_model_parallel_size", 1)
    return (tp, pp) if isinstance(tp, int) and isinstance(pp, int) else (1, 1)


def _prune(root: Path, keep_last: int, run_id: str | None) -> None:
    """Delete this run's steps beyond the newest ``keep_last``; another run's are never touched
    (steps saved before run ids were written have none, and are kept)."""
    if not run_id:
        return
    ours = [s for s in complete_steps(root) if run_of(step_dir(root, s)) == run_id]
    for old in ours[:-keep_last]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    for stale in root.glob("iter_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _init_empty_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer the state tensors a checkpoint load fills in place.

    With torch's Adam (no Transformer Engine or apex: CPU, or GPUs without TE) megatron-core
    0.19's distributed optimizer reads a ``step`` from every parameter state when it describes
    its checkpoint layout, and its own ``init_state_fn`` creates the moments but no ``step``.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        init_state_fn = getattr(chained, "init_state_fn", None)
        if inner is None or init_state_fn is None:
            continue
        init_state_fn(inner, getattr(chained, "config", None))
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for state in inner.state.values():
                state.setdefault("step", torch.tensor(0.0))


def _restore_torch_adam_step(optimizer: Any, loaded: Any) -> None:
    """Put the saved step back into torch Adam's per-parameter state after a load.

    megatron-core 0.19 restores the step from the saved param groups and then, in the
    dp_reshardable path, copies every tensor of the template's parameter state over it, ``step``
    included, which resets it to the freshly initialised optimizer's value. Only torch's Adam
    (no TE/apex) keeps ``step`` per parameter.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for index, opt in enumerate(chained):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        saved = loaded if len(chained) == 1 else loaded[index]
        steps = {g["step"] for g in saved["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for param_state in inner.state.values():
            param_state["step"] = torch.tensor(step)


def resolve(path: str | Path) -> Path:
    """A checkpoint root (use its latest step) or a step directory -> the step directory.

    Also a root or step written by Megatron-LM or Megatron-Bridge: a megatron-core dist
    checkpoint found through their trackers (``latest_checkpointed_iteration.txt``,
    ``latest_train_state.pt``) when there is no ``latest``."""
    path = Path(path)
    if (path / _META).is_file():
        return path
    if (path / _DIST_MARKER).is_file() and not path.name.endswith(".tmp"):  # not ours mid-save
        return path
    step = latest_step(path)
    if step is None:
        step = _foreign_latest(path)
    if step is None:
        raise CheckpointError(
            f"no checkpoint at {path}: expected a directory with a '{_LATEST}' file (or "
            f"Megatron-LM's {interop.MEGATRON_LM_TRACKER}, Megatron-Bridge's "
            f"{interop.BRIDGE_TRACKER}) or an iter_* step directory"
        )
    directory = step_dir(path, step)
    if not (directory / _META).is_file() and not (directory / _DIST_MARKER).is_file():
        raise CheckpointError(
            f"{path}'s tracker names step {step} but {directory} is not a complete checkpoint "
            f"(no {_META} or {_DIST_MARKER}); point --load/teacher.load at a step directory"
        )
    return directory


def _foreign_latest(root: Path) -> int | None:
    """The step Megatron-LM's or Megatron-Bridge's tracker at ``root`` names (None: neither)."""
    tracker = root / interop.MEGATRON_LM_TRACKER
    if tracker.is_file() and tracker.read_text().strip().isdigit():
        return int(tracker.read_text().strip())
    tracker = root / interop.BRIDGE_TRACKER
    if tracker.is_file():
        try:
            return int(torch.load(tracker, map_location="cpu", weights_only=True)["step"])
        except Exception as err:  # a pickle, key or type error: not a train state
            raise CheckpointError(
                f"{tracker} is not a Megatron-Bridge train state ({err})"
            ) from err
    return None


def _foreign_meta(directory: Path) -> dict[str, Any]:
    """What :func:`load_checkpoint` returns for a step another tool wrote (no checksums, no
    optimizer state in our layout, no run state)."""
    match = _STEP_NAME.fullmatch(directory.name)
    step = int(match.group(1)) if match else 0
    return {"step": step, "run_id": None, "has_optimizer": False, "extra": {}, "foreign": True}


def load_checkpoint(
    path: str | Path,
    model: Any,
    *,
    optimizer: Any = None,
    verify: bool = True,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Load ``model`` (and ``optimizer``) from a root or step directory, at any TP/PP.

    A checkpoint with another vocabulary padding (another TP size or padding multiple, or
    Megatron-Bridge's exact row count) loads: missing rows are zeros, extra rows are dropped
    after checking that they are not tokens (``checkpoint/vocab_rows.py``; ``vocab_size``, the
    model's real vocabulary, also refuses a checkpoint with fewer rows than it).
    With ``verify`` every file is first checked against the checksums saved with it. Returns the
    stored metadata (``step``, ``extra``, ``run_id``, and ``verified``: whether checksums were
    checked). A file that does not match, or a loaded weight that is not finite, is a
    :class:`CorruptCheckpointError`; missing or mismatched tensors are a
    :class:`CheckpointError`; both name the checkpoint.
    """
    directory = resolve(path)
    ours = (directory / _META).is_file()
    meta = read_meta(directory) if ours else _foreign_meta(directory)
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(_not_a_resume_point(directory, foreign=not ours))
    meta["verified"] = verify_step(directory) if verify and ours else False
    with safe_pickle.restricted_unpickling():  # no pickle of the checkpoint runs code
        state = _load_state(directory, model, optimizer, vocab_size)
    inner = getattr(model, "module", model)
    # no_grad: with fp32 parameters the distributed optimizer copies its dp_reshardable state
    # into views of the (grad-requiring) parameters.
    with torch.no_grad():
        inner.load_state_dict(state["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
            _restore_torch_adam_step(optimizer, state["optimizer"])
    bad = nonfinite(model, optimizer)
    if bad:
        raise CorruptCheckpointError(
            f"{directory} holds non-finite values (NaN or inf) in {_shown(bad)}"
        )
    return meta


def _load_state(
    directory: Path, model: Any, optimizer: Any, vocab_size: int | None
) -> dict[str, Any]:
    """The state dict of ``directory`` resharded onto ``model`` (and ``optimizer``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    sharded = {"model": _model_state(model)}
    _check_vocab_rows(directory, sharded["model"], vocab_size)
    if optimizer is not None:
        _init_empty_optimizer_state(optimizer)
        sharded["optimizer"] = optimizer.sharded_state_dict(
            sharded["model"], is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    # a GPTModel checkpoint into a HybridModel: its keys retargeted (checkpoint/model_class.py)
    saved = _from_rank0(
        model_class.saved_layout(set(saved_tensors(directory))) if rank() == 0 else None
    )
    refusal = model_class.match(directory, sharded["model"], model, saved)
    if refusal:
        raise CheckpointError(refusal)
    try:
        with torch.no_grad():
            state: dict[str, Any] = dist_checkpointing.load(
                sharded,
                str(directory),
                # The access check is about writers: megatron derives replica ids from its
                # global parallel state, which is the student's, so a model on another layout
                # (the teacher's) fails it although every rank reads exactly what it needs.
                validate_access_integrity=False,
                # A tensor the model needs but the checkpoint lacks is an error up front.
                strict=StrictHandling.RAISE_UNEXPECTED,
            )
    # torch's CheckpointException derives from BaseException, not Exception
    except (Exception, CheckpointException) as err:
        unsafe = _first_failure(err)
        if isinstance(unsafe, safe_pickle.UnsafePickleError):
            raise CheckpointError(f"cannot load {directory}: {unsafe}") from None
        raise CheckpointError(
            f"could not load {directory}: {_reason(err)}. Check that the checkpoint was written "
            "for this architecture (layers, hidden size, heads, vocabulary)"
        ) from err
    return state


def _not_a_resume_point(directory: Path, *, foreign: bool) -> str:
    """Why a step without our optimizer state cannot be resumed from, and what to do instead."""
    if foreign:
        tool = foreign_config.written_by(directory)
        return (
            f"{directory} was written by {tool}, not by megatron-gndpo: its optimizer state (if "
            f"it saved one) is not in this project's layout, so a run cannot resume from it; to "
            f"start from its weights with a fresh optimizer, set checkpoint.init={directory} "
            "instead of checkpoint.load"
        )
    trained = training_steps(directory.parent)
    newest = (
        f". {directory.parent} also holds {step_dir(directory.parent, trained[-1])}, a complete "
        f"training checkpoint: to resume from it, set checkpoint.load to it (or point "
        f"{directory.parent / _LATEST} at it: echo {trained[-1]} > {directory.parent / _LATEST})"
        if trained
        else ""
    )
    return (
        f"{directory} holds no optimizer state (a model-only checkpoint, e.g. converted from "
        f"Hugging Face); load it as initial weights (checkpoint.init), not as a resume point"
        f"{newest}"
    )


def _check_vocab_rows(
    directory: Path, sharded_model: dict[str, Any], vocab_size: int | None
) -> None:
    """Refuse a load that would lose or invent vocabulary rows (``checkpoint/vocab_rows.py``).

    Collective: the ranks pool the shapes of their row-flexible tensors (the embedding and the
    output layer live on different pipeline stages); rank 0 reads the checkpoint and decides.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    mine = {
        t.key: tuple(t.global_shape)
        for t in nested_values(sharded_model)
        if isinstance(t, ShardedTensor) and t.allow_shape_mismatch
    }
    flexible = {key: shape for part in _gather(mine) for key, shape in part.items()}
    problem = None
    if rank() == 0 and flexible:
        saved = saved_tensors(directory)
        problem = vocab_rows_problem(
            directory, flexible, saved, vocab_size=vocab_size,
            saved_vocab=saved_vocab_size(directory),
            read=lambda key: _read_tensor(directory, key, *saved[key]),
            config_path=directory.parent / MODEL_CONFIG_FILE,
        )  # fmt: skip
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)


def saved_vocab_size(directory: str | Path) -> int | None:
    """The vocabulary size written beside a step directory, or None where nothing tells it: the
    ``model_config.yaml`` at its root (ours), or Megatron-Bridge's ``run_config.yaml`` (its
    model section) in the step itself."""
    import yaml

    directory = Path(directory)
    for path, section in (
        (directory.parent / MODEL_CONFIG_FILE, None),
        (directory / interop.BRIDGE_RUN_CONFIG, "model"),
    ):
        if not path.is_file():
            continue
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue  # unreadable: as if absent, the zero-row check then decides
        if section is not None:
            data = data.get(section) if isinstance(data, dict) else None
        value = data.get("vocab_size") if isinstance(data, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _read_tensor(
    directory: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """One whole saved tensor, read by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp

    out = torch.empty(shape, dtype=dtype)
    with safe_pickle.restricted_unpickling():
        dcp.load({key: out}, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return out


def _first_failure(err: BaseException) -> BaseException:
    """The first rank's own error of torch's CheckpointException (else ``err`` itself)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first: BaseException = sorted(failures.items())[0][1][0]
        return first
    return err


def _reason(err: BaseException) -> str:
    """One line on why a load failed: the first rank's own error for torch's
    CheckpointException (its text is every rank's traceback)."""
    err = _first_failure(err)
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
