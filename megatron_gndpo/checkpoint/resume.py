"""Where a training run starts, and nothing lost on the way.

:func:`plan_start` reads the save directory before any model is built and decides: resume from
its ``latest`` (or from ``checkpoint.load``), or start at step 0. It refuses what would lose or
mix runs: starting over in a directory that holds iterations without ``latest``, or saving a run
resumed from elsewhere into a directory that holds another run's iterations.
:func:`resume_from` then loads the newest candidate that is intact (checksums, finite values),
falling back to an older one loudly when the newest is corrupt. Only after that succeeded does
:func:`set_aside` touch the directory: iterations the run will not continue from (newer than
the one it resumed, corrupt ones, or all of them for ``checkpoint.start_fresh``) are moved into
``SAVE/previous-<time>/`` with a copy of the metrics, never deleted, and ``latest`` is pointed
at the resumed step.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron_gndpo.checkpoint.dist import (
    START_FRESH,
    TRACKERS,
    CheckpointError,
    CorruptCheckpointError,
    complete_steps,
    latest_step,
    read_meta,
    resolve,
    step_dir,
    write_latest,
)
from megatron_gndpo.config.schema import CheckpointConfig
from megatron_gndpo.errors import UserError

_LATEST = "latest"
_ASIDE_PREFIX = "previous-"
# Beside the iterations, describing them (written by the trainer): moved with them on a fresh start.
_DESCRIPTIONS = ("model_config.yaml", "vision_config.yaml")


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """Where a run starts, decided from the file system alone."""

    save_dir: Path
    candidates: tuple[Path, ...]
    """Step directories to resume from, newest first; empty: start at step 0."""
    explicit: bool
    """The candidates come from checkpoint.load (a corrupt one is not skipped silently there)."""
    start_fresh: bool
    """checkpoint.start_fresh: move the save directory's iterations aside first."""


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The outcome of :func:`resume_from`."""

    step: int
    run_id: str
    directory: Path | None
    """The step directory loaded; None for a run starting at step 0."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The loaded step's metadata (``extra``: the data position, the schedule)."""
    skipped: tuple[tuple[Path, str], ...] = ()
    """Newer candidates found corrupt, with why."""


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[-4:])
    return f"{len(steps)} iteration(s) (steps {'..., ' if len(steps) > 4 else ''}{shown})"


def plan_start(ck: CheckpointConfig, save_dir: Path) -> StartPlan:
    """Decide where to start; :class:`CheckpointError` (naming the fix) when it is not clear."""
    steps = complete_steps(save_dir)
    if ck.start_fresh:
        return StartPlan(save_dir, (), explicit=False, start_fresh=True)
    if ck.load is not None:
        return _plan_explicit(Path(ck.load), save_dir, steps)
    if not steps and not (save_dir / _LATEST).exists():
        return StartPlan(save_dir, (), explicit=False, start_fresh=False)
    if not (save_dir / _LATEST).is_file():
        newest = step_dir(save_dir, steps[-1])
        raise CheckpointError(
            f"{save_dir} holds {_steps_text(steps)} but no '{_LATEST}' file, so this run would "
            f"start at step 1 and overwrite them. To continue from the newest, set "
            f"checkpoint.load={newest} (or: echo {steps[-1]} > {save_dir / _LATEST}); to start "
            "at step 1 anyway, set checkpoint.start_fresh=true (the iterations are moved into "
            f"{save_dir}/{_ASIDE_PREFIX}<time>/ first, none is deleted)"
        )
    step = latest_step(save_dir, instead=START_FRESH)  # a corrupt `latest`: names the fix
    assert step is not None
    older = [s for s in reversed(steps) if s <= step]
    return StartPlan(
        save_dir, tuple(step_dir(save_dir, s) for s in older), explicit=False, start_fresh=False
    )


def _plan_explicit(source: Path, save_dir: Path, steps: list[int]) -> StartPlan:
    directory = resolve(source)  # a missing checkpoint is an error naming the path
    inside = directory.parent.resolve() == save_dir.resolve()
    if steps and not inside:
        raise CheckpointError(
            f"checkpoint.load={source} is outside the save directory {save_dir}, which already "
            f"holds {_steps_text(steps)}: this run's checkpoints would mix with them. To continue "
            "those, leave checkpoint.load unset; to resume from the other checkpoint, point "
            "checkpoint.save (or logging.run_dir) at a new directory"
        )
    if directory != source and (source / _LATEST).is_file():  # a root: its older steps may help
        root_steps = complete_steps(source)
        newest = int(directory.name.removeprefix("iter_"))
        candidates = tuple(step_dir(source, s) for s in reversed(root_steps) if s <= newest)
    else:
        candidates = (directory,)
    return StartPlan(save_dir, candidates, explicit=True, start_fresh=False)


def warn(message: str) -> None:
    print(f"megatron-gndpo: warning: {message}", file=sys.stderr, flush=True)


def resume_from(
    plan: StartPlan,
    load: Callable[[Path], dict[str, Any]],
    *,
    say: Callable[[str], None] = warn,
    verify: bool = True,
) -> Resumed:
    """Load the newest intact candidate with ``load`` (collective; returns the step's metadata).

    A corrupt candidate is skipped for the next older one, said loudly through ``say``; when
    none is left, a :class:`CheckpointError` lists what was wrong with each. Any other load
    error (a checkpoint of another architecture) is raised as it is: an older step would fail
    the same way. ``verify``: whether ``load`` checks the checksums (checkpoint.verify); without
    it a damaged file fails like a mismatch, and the error says how to tell them apart.
    """
    if not plan.candidates:
        return Resumed(step=0, run_id=uuid.uuid4().hex[:12], directory=None)
    skipped: list[tuple[Path, str]] = []
    for index, directory in enumerate(plan.candidates):
        has_checksums = "files" in _meta_or_empty(directory)
        try:
            meta = load(directory)
        except CorruptCheckpointError as err:
            skipped.append((directory, str(err)))
            continue
        except CheckpointError as err:
            older = plan.candidates[index + 1 :]
            if not older or (has_checksums and verify):
                raise
            if has_checksums:  # checkpoint.verify=false: its checksums were not read
                raise CheckpointError(
                    f"{err}. Or a file of it is damaged: checkpoint.verify=false skipped its "
                    f"checksums, which tell the two apart; with checkpoint.verify=true (the "
                    f"default) a damaged checkpoint is set aside for the newest intact one, or "
                    f"resume from the previous one with checkpoint.load={older[0]}"
                ) from err
            raise CheckpointError(
                f"{err}. {directory} was saved without checksums, so a damaged file cannot be "
                f"told from a mismatch: if it is damaged, resume from the previous one with "
                f"checkpoint.load={older[0]}"
            ) from err
        if skipped:
            say(
                "; ".join(why for _, why in skipped)  # each names its directory
                + f". Resuming from the newest intact checkpoint, {directory} (step "
                f"{meta['step']}), instead"
                + (
                    f"; the corrupt one(s) are moved into {plan.save_dir}/{_ASIDE_PREFIX}<time>/"
                    if directory.parent.resolve() == plan.save_dir.resolve()
                    else ""
                )
            )
        if not verify:
            say(f"{directory} loaded without checking its checksums (checkpoint.verify=false)")
        elif not meta.get("verified"):
            say(f"{directory} has no checksums (saved by an older version): loaded unverified")
        run_id = meta.get("run_id") or uuid.uuid4().hex[:12]
        return Resumed(int(meta["step"]), run_id, directory, meta, tuple(skipped))
    reasons = "\n".join(f"  - {why}" for _, why in skipped)
    fix = (
        "point checkpoint.load at another checkpoint"
        if plan.explicit
        else "restore them, or set checkpoint.start_fresh=true to move them aside and start at "
        "step 1"
    )
    raise CheckpointError(f"no intact checkpoint to resume from:\n{reasons}\n{fix}")


def _meta_or_empty(directory: Path) -> dict[str, Any]:
    try:
        return read_meta(directory)
    except CheckpointError:
        return {}


def _aside_dir(save_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = save_dir / f"{_ASIDE_PREFIX}{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = save_dir / f"{_ASIDE_PREFIX}{stamp}-{n}"
    return target


def set_aside(plan: StartPlan, resumed: Resumed, metrics: Path) -> Path | None:
    """After a successful start (rank 0 only): move away what the run will not continue, point
    ``latest`` at the resumed step. Returns the directory things were moved into, if any."""
    save_dir = plan.save_dir
    in_save_dir = (
        resumed.directory is not None and resumed.directory.parent.resolve() == save_dir.resolve()
    )
    if plan.start_fresh or resumed.directory is None:
        moved = [step_dir(save_dir, s) for s in complete_steps(save_dir)]
        moved += [save_dir / name for name in (*TRACKERS, *_DESCRIPTIONS)]
    elif in_save_dir:
        moved = [step_dir(save_dir, s) for s in complete_steps(save_dir) if s > resumed.step]
    else:
        moved = []
    moved = [p for p in moved if p.exists()]
    fresh_metrics = resumed.directory is None and metrics.is_file() and metrics.stat().st_size
    if not moved and not fresh_metrics:
        return None
    target = _aside_dir(save_dir)
    target.mkdir(parents=True)
    for path in moved:
        path.rename(target / path.name)
    if metrics.is_file():  # its records past the resumed step are about to be dropped
        if resumed.directory is None:
            metrics.rename(target / metrics.name)
        else:
            shutil.copy2(metrics, target / metrics.name)
    if in_save_dir:
        write_latest(save_dir, resumed.step)
    return target


@dataclasses.dataclass(frozen=True)
class TokenizerStamp:
    """The tokenizer a run trains with, saved in its checkpoints (``extra["tokenizer"]``) as a
    part of :func:`run_state`: resuming with another vocabulary, where every id would mean
    another token, is refused (a checkpoint saved before the stamp is not checked)."""

    spec: str | None  # data.tokenizer
    fingerprint: str  # Tokenizer.fingerprint(): the vocabulary's hash

    def state_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("fingerprint") == self.fingerprint:
            return
        saved = state.get("spec") or "builtin:char"
        raise CheckpointError(
            f"the checkpoint was trained with the tokenizer {saved} and this run's "
            f"data.tokenizer ({self.spec or 'builtin:char'}) has another vocabulary: every token "
            "id would mean something else. Resume with the checkpoint's data.tokenizer; to "
            "move to this tokenizer deliberately, start a new run (another logging.run_dir) "
            "with checkpoint.init pointing at the checkpoint"
        )


# The run's state saved beside the weights (a checkpoint's "extra"): every checkpoint holds these
# parts; the others (the stability diagnostics, the outlier sampler) start afresh when a
# checkpoint from before them, or from a run without them, lacks them.
_ALWAYS_SAVED = ("sampler", "scheduler")


def run_state(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The extra state to save: each part's ``state_dict()`` (a part None is not in this run)."""
    return {name: part.state_dict() for name, part in parts.items() if part is not None}


def restore_run_state(
    parts: Mapping[str, Any], extra: Mapping[str, Any], directory: Path | None = None
) -> None:
    """Load each part of :func:`run_state` back from a resumed checkpoint's ``extra``, in the
    order of ``parts``; a part that refuses (another tokenizer, changed data) is an error that
    names the checkpoint ``directory``."""
    for name, part in parts.items():
        if part is not None and (name in extra or name in _ALWAYS_SAVED):
            try:
                part.load_state_dict(extra[name])
            except UserError as err:
                if directory is None:
                    raise
                raise type(err)(f"cannot resume from {directory}: {err}") from None
