"""The GNDPO training loop: ``Trainer.step()`` is the data flow of docs/DESIGN.md, a call a stage.

    prompts -> rollout -> rewards (-> filter) -> teacher log-probs -> student old log-probs
            -> advantages (+ off-policy correction) -> clipped update -> weight sync -> checkpoint

Each stage lives in the module named after it: the rollout in ``rollout/``, the rewards in
``rewards/``, both models' passes in ``scorer.py`` (a teacher with its own tokenizer: its rows
before its pass and its span scores on the student's tokens after the student's), the
advantages in ``methods/``, the update in ``engine/update.py``, the weight sync in
``weight_sync/``, the checkpoints in ``checkpoint/run.py``. What a run is built from comes from
``components.py``.

Every rank runs the same step; collectives inside each stage use the groups of the model that
stage runs on. All randomness of a step derives from (seed, step, data-parallel rank), so a run
resumed from a checkpoint continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo import evaluation, seeding
from megatron_gndpo.algorithms.metrics import StabilityMonitor
from megatron_gndpo.checkpoint.resume import TokenizerStamp, warn
from megatron_gndpo.checkpoint.run import RunCheckpoints
from megatron_gndpo.components import Components, build_components
from megatron_gndpo.config import Config, save_dir
from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.data.prompt_sets import Drawn
from megatron_gndpo.engine.probe import check_engine, model_probe
from megatron_gndpo.engine.scoring import Scores, required
from megatron_gndpo.engine.update import Targets, UpdateBatch, run_update
from megatron_gndpo.job.stop import StopRequest
from megatron_gndpo.logging import progress
from megatron_gndpo.logging.sinks import METRICS_FILE
from megatron_gndpo.logging.throughput import update_mfu
from megatron_gndpo.methods import StepBatch, build_method
from megatron_gndpo.methods.step import offpolicy_correction, step_targets
from megatron_gndpo.models.routing import RoutingPass, mismatch_metrics
from megatron_gndpo.rewards.rollout import rollout_rewards
from megatron_gndpo.rollout.base import Rollout, SamplingParams, generate_for
from megatron_gndpo.rollout.build import never_sampled
from megatron_gndpo.rollout.filters import (
    MIN_STEP_TOKENS,
    drop_reasons,
    emptied_reasons,
    filter_metrics,
    hollow,
    keep_rows,
)
from megatron_gndpo.rollout.metrics import EndingWatch, rollout_metrics
from megatron_gndpo.rollout.pipeline import RolloutPipeline
from megatron_gndpo.rollout.prefixes import continue_teacher_prefixes
from megatron_gndpo.rollout.remote import RemoteRollouts, load_inflight
from megatron_gndpo.rollout.schedule import is_outlier_step, temperature_at
from megatron_gndpo.scorer import ScoredRollout
from megatron_gndpo.weight_sync import sync_weights
from megatron_gndpo.weight_sync.check import check_due, tolerance_of

# Keys computed on the student's last pipeline stage and shared with the logging rank.
_LAST_STAGE_KEYS = ("loss", "ratio/mean", "clip/frac", "guidance/kl_mean")
_OPTIONAL_KEYS = ("guidance/kl_mean",)


class Trainer:
    """On-policy distillation of the student towards the frozen teacher."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # Where to start is decided before any model is built; nothing is written into the
        # checkpoint directory until the resume has succeeded.
        self.checkpoints = RunCheckpoints(cfg, save_dir(cfg))
        self.c: Components = build_components(cfg)
        self.method = build_method(cfg.algorithm)  # what differs between estimators
        self.params = SamplingParams.from_config(cfg.rollout, eos_id=self.c.tokenizer.eos_id)
        self.step_count = 0
        self.interrupted = False  # train() ended on a Ctrl-C (after saving)
        self._syncs = 0  # weight syncs into an external engine so far
        self.stability = StabilityMonitor(clip=cfg.optimizer.clip_grad)  # checkpointed
        self.ending = EndingWatch(cfg.rollout.max_response_length, self.method.never_stops_advice)
        self.tokenizer = TokenizerStamp(cfg.data.tokenizer, self.c.tokenizer.fingerprint())
        # rollout.disaggregate: the rollout ranks sample, batches ahead with staleness > 0
        self.pipeline: RolloutPipeline | None = None
        if cfg.rollout.disaggregate.enabled:
            remote = RemoteRollouts(cfg, self.c.student, self.c.student_groups, probe=model_probe)
            self.pipeline = RolloutPipeline(
                remote, staleness=cfg.rollout.disaggregate.staleness, steps=cfg.trainer.steps,
                draw=self._draw, resolve=self.c.data.resolve, seeds=self._seeds,
                sampling=self._sampling,
            )  # fmt: skip
        for notice in self.c.data.notices(cfg):  # once: what the training set leaves out
            self._warn(notice)
        inflight = self._resume()
        self.checkpoints.describe()
        if self.pipeline is not None:  # the rollout ranks start without the student's weights
            self.pipeline.start(self.step_count, inflight)
        else:
            self._sync_engine()  # so does an external engine

    @property
    def run_id(self) -> str:
        return self.checkpoints.run_id

    # ----------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One rollout batch: sample, reward and filter, score, estimate advantages, update,
        sync; then evaluate (every ``trainer.eval_interval`` steps), log the step's row and
        checkpoint (every ``checkpoint.save_interval``).

        The row is written before the checkpoint: a job killed between the two resumes from the
        checkpoint before, whose resume drops the row and trains the step again, so no
        checkpointed step is ever missing from metrics.jsonl. ``time/checkpoint`` is therefore
        the save that followed the previous step.
        """
        metrics = self._train_step()
        interval = self.cfg.trainer.eval_interval
        if interval and self.c.data.eval and self.step_count % interval == 0:
            metrics |= self.evaluate()
        self.c.logger.log(self.step_count, metrics)
        with self.c.timer.time("checkpoint"):  # popped with the next step's stages
            if self.checkpoints.due(self.step_count):
                self._save()
        return metrics

    def _train_step(self) -> dict[str, float]:
        c, timer = self.c, self.c.timer
        started = time.perf_counter()
        with timer.time("rollout"):
            if self.pipeline is not None:  # sampled on the rollout ranks (maybe ahead)
                prompts, sampled, metrics = self.pipeline.take(self.step_count + 1)
            else:
                prompts, metrics = self._next_prompts(), {}
                sampled = self._sample(prompts)
            c.generator.sleep()  # an engine with its own weights: memory to scoring, training
        with timer.time("rewards"):  # a verifiable reward needs no teacher: it can filter rows
            rewards = self._rewards(sampled, prompts)
            rollout, kept, filtered = self._filter(sampled, rewards)  # dropped rows: stubs
            metrics |= filtered
        scored: ScoredRollout | None = None  # this step's scores, once there are any
        if metrics.get("filter/tokens_kept", math.inf) < MIN_STEP_TOKENS:  # global: all skip
            metrics |= {"skipped": 1.0, "skipped/filtered_all": 1.0}  # and nothing is scored
            self._skipped(f"algorithm.filter dropped every row ({emptied_reasons(metrics)})")
        else:
            routes = c.teacher.routes(prompts, rollout.prompt_index)  # [n]: each row's teacher
            # timed inside, in the method's order; scored.scored: the tokens the teacher scored
            seed = seeding.step_seed(self.cfg.trainer.seed, self.step_count)
            scored = c.scorer.score(
                rollout, prompts, routes, self.method, seed=seed, replay=self._replays(),
                timer=timer,
            )  # fmt: skip
            metrics |= scored.metrics
            bad = c.teacher.nonfinite(scored.teacher.logprobs, scored.scored, routes)
            if bad:  # before any use
                metrics |= {"skipped": 1.0, "skipped/nonfinite_teacher": 1.0}  # all ranks
                self._skipped(
                    f"the log-probs of {' and '.join(bad)} are not finite (NaN or inf) on a "
                    "response token"
                )
            elif metrics.get("xtok/aligned_tokens", math.inf) < MIN_STEP_TOKENS:  # global
                metrics |= {"skipped": 1.0, "skipped/unaligned": 1.0}
                self._skipped(
                    f"only {metrics['xtok/aligned_tokens']:.0f} response tokens of the batch "
                    "align with the teacher's tokens (teacher.cross_tokenizer scores spans that "
                    "both tokenizers end, which responses this short seldom hold); raise "
                    "rollout.max_response_length"
                )
            else:
                with timer.time("advantages"):
                    targets, found = self._targets(rollout, scored, rewards, routes)
                    weights, corrected = self._correction(rollout, scored.student.logprobs)
                with timer.time("update"):
                    updated = self._update(rollout, scored.student.logprobs, targets, weights)
                    c.teacher.after_update()  # a teacher that follows the student (EMA)
                metrics |= found | corrected | updated
        # before the checkpoint, whose state must include this step
        metrics |= self.stability.observe(
            metrics.get("grad_norm", math.nan), metrics.get("score/rms", math.nan)
        )
        with timer.time("weight_sync"):
            metrics |= self._sync_engine()
        self.step_count += 1
        student = None if scored is None else scored.student
        metrics |= self._rollout_metrics(sampled, student, rewards, kept)
        if (never_stops := self.ending.observe(metrics["finished/frac"])) is not None:
            self._warn(never_stops)
        metrics |= _routing_metrics(None if scored is None else scored.routing)
        metrics |= timer.pop()
        metrics["time/step"] = time.perf_counter() - started
        metrics["tokens/s"] = metrics["tokens/step"] / metrics["time/step"]
        metrics |= self._mfu(rollout, metrics)  # the rows trained on, stubs included
        return metrics

    def train(self) -> list[dict[str, float]]:
        """Steps until ``trainer.steps``, with logging, evaluation and a final checkpoint.

        SIGTERM or SIGUSR1 (Slurm's warning before preemption or the time limit) ends the run
        after the current step, with a checkpoint the requeued job resumes from; so does a
        first Ctrl-C (``interrupted`` is then True), a second one stops at once.
        """
        history = []
        stop = StopRequest()
        self.interrupted = False
        if self.step_count >= self.cfg.trainer.steps:
            self._say(
                f"{self.c.save_dir} is already at step {self.step_count} of "
                f"trainer.steps={self.cfg.trainer.steps}: nothing to do (raise trainer.steps to "
                "continue, or use another logging.run_dir to start afresh)"
            )
        bar = progress(
            self.cfg.trainer.steps, "train", dist.get_rank() == 0, initial=self.step_count
        )
        while self.step_count < self.cfg.trainer.steps:
            metrics = self.step()
            bar.update(1)
            history.append(metrics)
            if stop.agreed():
                if not stop.interrupted:  # Ctrl-C said it already, and says the rest at the end
                    self._say(f"stop requested: saving at step {self.step_count} and exiting")
                break
        stop.restore()
        bar.close()
        if not self.checkpoints.due(self.step_count):  # not saved by the last step
            self._save()
        self.interrupted = stop.interrupted
        if self.pipeline is not None:
            self.pipeline.stop()  # the rollout ranks end their loop
        self.c.logger.close()
        return history

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation (megatron_gndpo/evaluation.py): greedy accuracy, and with
        ``trainer.eval_samples`` the sampled accuracy and the reverse KL to the teacher, with
        the run's own generator and scorer."""
        c, t = self.c, self.cfg.trainer
        return evaluation.evaluate(
            c.generator, c.tokenizer, c.data.eval, c.student_groups, self.params,
            scorer=c.scorer, samples=t.eval_samples, seed=t.seed, replay=self._replays(),
            vision=self.cfg.model.vision is not None, answer_match=self.cfg.data.answer_match,
        )  # fmt: skip

    def _replays(self) -> bool:
        """An MoE student's passes replay the sampler's experts (algorithm.routing_replay)."""
        return self.cfg.algorithm.routing_replay == "rollout"

    # -- rollout -----------------------------------------------------------------------------
    def _next_prompts(self) -> list[EncodedPrompt]:
        return self.c.data.resolve(self._draw(self.step_count + 1))

    def _draw(self, batch: int) -> Drawn:
        """This replica's prompts of ``batch`` (1-based: the step that trains on it), as the
        prompt set they come from and their indices (what a checkpoint stores)."""
        return self.c.data.draw(outlier=is_outlier_step(self.cfg.rollout, batch))

    def _sampling(self, batch: int) -> SamplingParams:
        """The sampling parameters of ``batch`` (1-based): the configured ones at the
        temperature the schedule gives its step (rollout/schedule.py)."""
        temperature = temperature_at(self.cfg.rollout, batch)
        return dataclasses.replace(self.params, temperature=temperature)

    def _seeds(self, prompts: list[Any], batch: int | None = None) -> list[int]:
        # One seed per prompt from (seed, step, position in the global step batch): the samples
        # do not depend on the data-parallel size or on which rank draws them.
        step = self.step_count if batch is None else batch - 1
        first = self.c.student_groups.coords["dp"] * len(prompts)
        return seeding.prompt_seeds(self.cfg.trainer.seed, step, first, len(prompts))

    def _sample(self, prompts: list[EncodedPrompt]) -> Rollout:
        """The step's rollout: on-policy, or continued from teacher-written prefixes when the
        method says so (TrOPD's off-policy guidance, rollout/prefixes.py)."""
        share = self.method.prefix_share(self.step_count + 1)
        params, seeds = self._sampling(self.step_count + 1), self._seeds(prompts)
        vision = self.cfg.model.vision is not None
        if share == 0.0:
            return generate_for(self.c.generator, prompts, params, seeds, vision=vision)
        return continue_teacher_prefixes(
            [list(p.ids) for p in prompts], share, teacher=self.c.teacher.only.generate,
            generate=lambda ids, sampling, seeds: generate_for(
                self.c.generator, prompts, sampling, seeds, vision=vision, ids=ids
            ),
            params=params, configured=self.params, seeds=seeds,
            images=[p.images for p in prompts] if vision else None,
        )  # fmt: skip

    def _rewards(self, rollout: Rollout, prompts: list[EncodedPrompt]) -> torch.Tensor | None:
        """Each row's verifiable reward (None when the prompts have no answers)."""
        return rollout_rewards(rollout, prompts, self.c.tokenizer, match=self.cfg.data.answer_match)

    def _filter(
        self, rollout: Rollout, rewards: torch.Tensor | None
    ) -> tuple[Rollout, torch.Tensor | None, dict[str, float]]:
        """The rollout with the rows ``algorithm.filter`` drops made one-token stubs
        (rollout/filters.py), the kept rows ``[n]`` bool and the filter's metrics (global; one
        all-reduce over the student's data-parallel group). Without a filter: the rollout
        itself, None and no metrics, and no collective."""
        f = self.cfg.algorithm.filter
        if not f.enabled:
            return rollout, None, {}
        reasons = drop_reasons(
            rollout, rewards, self.params.samples_per_prompt, drop_truncated=f.drop_truncated,
            min_response_tokens=f.min_response_tokens,
            drop_zero_variance_groups=f.drop_zero_variance_groups,
        )  # fmt: skip
        keep = keep_rows(reasons, rollout.tokens.shape[0])
        metrics = filter_metrics(rollout, reasons, keep, self.c.student_groups.dp)
        return hollow(rollout, keep, pad_id=self.c.tokenizer.pad_id), keep, metrics

    # -- advantages and update ---------------------------------------------------------------
    def _targets(
        self,
        rollout: Rollout,
        scored: ScoredRollout,
        rewards: torch.Tensor | None,
        routes: torch.Tensor,
    ) -> tuple[Targets, dict[str, float]]:
        """The method's targets and the step's metrics (methods/step.py)."""
        teachers = self.c.teacher
        batch = StepBatch(
            scored.teacher, scored.student, rollout.response_mask, rewards,
            group_size=self.params.samples_per_prompt, group=self.c.student_groups.dp_cp,
            step=self.step_count + 1, tokens=rollout.tokens,
            teacher_written=rollout.teacher_written,
            scored_mask=None if self.c.cross is None else scored.scored,
        )  # fmt: skip
        return step_targets(
            self.method, self.cfg.algorithm, batch, routes, teachers.names, teachers.weights
        )

    def _correction(
        self, rollout: Rollout, old_lp: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The off-policy correction's importance weights of the policy-gradient term, for the
        gap between the sampler's log-probs and the trainer's ``old_lp`` (methods/step.py)."""
        return offpolicy_correction(
            self.cfg.algorithm.offpolicy, old_lp, rollout.sampler_logprobs, rollout.sampled_mask,
            self.c.student_groups.dp_cp,
        )  # fmt: skip

    def _update(
        self,
        rollout: Rollout,
        old_lp: torch.Tensor,
        targets: Targets,
        is_weights: torch.Tensor | None = None,
    ) -> dict[str, float]:
        c, t = self.c, self.cfg.trainer
        replayed = rollout.routing if self._replays() else None
        steps = run_update(
            c.ddp, c.optimizer, c.scheduler,
            UpdateBatch(
                rollout.tokens, old_lp, targets, rollout.response_mask, is_weights=is_weights,
                images=rollout.images, routing=replayed,
            ),
            head=c.head, algorithm=self.cfg.algorithm, micro_batch_size=t.micro_batch_size,
            optimizer_steps=t.optimizer_steps_per_rollout, dp_group=c.student_groups.dp_cp,
        )  # fmt: skip
        taken = [s for s in steps if not s.get("empty")]  # >= 2 tokens: one mini-batch has some
        last = taken[-1] | self._from_last_stage(taken[-1])
        last["skipped"] = sum(s["skipped"] for s in steps)
        if len(taken) < len(steps):  # mini-batches whose rows the filter all dropped
            last["skipped/empty_minibatches"] = float(len(steps) - len(taken))
        return last

    # -- weight sync -------------------------------------------------------------------------
    def _sync_engine(self) -> dict[str, float]:
        """Push the student's weights into an engine with its own copy (vLLM), then check them
        (``rollout.weight_sync_check``): nothing for the built-in generator, which samples from
        the trained weights themselves."""
        if self.pipeline is not None:  # the rollout ranks: the weights of the step now ending
            return self.pipeline.advance(self.step_count + 1)
        engine = self.c.generator
        receiver = engine.own_weights()
        if receiver is None:
            return {}
        engine.wake_up()
        model = self.cfg.model
        metrics = sync_weights(
            receiver, self.c.student, self.c.student_groups, model, family=model.hf_family,
            vision=model.vision, parts=receiver.weight_parts(),
        )  # fmt: skip
        self._syncs += 1
        r = self.cfg.rollout
        if not check_due(r.weight_sync_check, self._syncs):
            return metrics
        return metrics | check_engine(
            receiver, self.c.student, self.c.student_groups, vocab_size=model.vocab_size,
            tolerance=tolerance_of(r, model.params_dtype), excluded_ids=never_sampled(self.cfg),
            vision_language=model.vision is not None,
        )  # fmt: skip

    # -- metrics -----------------------------------------------------------------------------
    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's loss statistics on every stage (the logging rank is on the first);
        a statistic this method does not produce stays absent."""
        groups = self.c.student_groups
        values = torch.tensor(
            [metrics.get(k, math.nan) for k in _LAST_STAGE_KEYS], dtype=torch.float64
        )
        if groups.layout.pp > 1:
            last = dist.get_process_group_ranks(groups.pp)[-1]
            dist.broadcast(values, src=last, group=groups.pp)
        out = dict(zip(_LAST_STAGE_KEYS, values.tolist(), strict=True))
        return {k: v for k, v in out.items() if k not in _OPTIONAL_KEYS or not math.isnan(v)}

    def _rollout_metrics(
        self,
        rollout: Rollout,
        student: Scores | None,
        rewards: torch.Tensor | None,
        kept: torch.Tensor | None,
    ) -> dict[str, float]:
        """What the sampled ``rollout`` looked like, before any filter; the student's
        (``student``: its scores of the ``kept`` rows; None when it scored nothing) sampler gap
        and entropy over the rows it scored."""
        if student is None:  # every row was dropped: the student scored none
            zeros = torch.zeros(rollout.tokens.shape, device=rollout.tokens.device)
            student, kept = Scores(zeros, entropy=zeros), zeros[:, 0].bool()
        entropy = required(student.entropy, "the student's entropy")
        out, written_frac = rollout_metrics(
            rollout, student.logprobs, entropy, rewards, self.c.student_groups.dp_cp, kept
        )
        out["prompts/skipped_too_long"] = float(self.c.data.skipped)
        out["rollout/temperature"] = temperature_at(self.cfg.rollout, self.step_count)
        return out | self.method.rollout_metrics(self.step_count, written_frac)

    def _mfu(self, rollout: Rollout, metrics: dict[str, float]) -> dict[str, float]:
        """Model FLOPs utilisation of the update stage (GPUs with a known peak only); every
        data-parallel replica processes its own rows, model-parallel ranks share them."""
        return update_mfu(
            self.cfg.model, rollout.lengths.tolist(), metrics.get("time/update", 0.0),
            replicas=self.c.student_groups.layout.dp, world_size=dist.get_world_size(),
        )  # fmt: skip

    # -- checkpoints -------------------------------------------------------------------------
    def _run_state(self) -> dict[str, Any]:
        """What a checkpoint saves besides the weights and the optimizer (checkpoint/resume.py)."""
        d = self.c.data
        return {  # the tokenizer first: another vocabulary is the cause to name
            "tokenizer": self.tokenizer, "sampler": d.sampler, "scheduler": self.c.scheduler,
            "stability": self.stability, "outlier_sampler": d.outlier_sampler,
        }  # fmt: skip

    def _save(self) -> None:
        extra: dict[str, Any] = {}
        writers: list[Callable[[Path], None]] = [self.c.teacher.save_state]  # an EMA teacher
        if self.pipeline is not None:  # the batches sampled ahead (rollout.disaggregate)
            replicas = self.c.student_groups.layout.dp
            extra["inflight"], inflight = self.pipeline.checkpoint(replicas)
            writers.append(inflight)

        def files(directory: Path) -> None:
            for write in writers:
                write(directory)

        self.checkpoints.save(
            self.step_count, self.c.ddp, self.c.optimizer, self._run_state(), extra=extra,
            extra_files=files,
        )  # fmt: skip

    def _resume(self) -> dict[int, Any]:
        """Continue from the newest intact checkpoint of the plan (checkpoint.load, or the save
        directory's latest), or start at step 0 (checkpoint/run.py). Returns the batches the
        checkpoint's run had sampled ahead (rollout.disaggregate), by batch: (result, drawn
        prompts); empty when none."""
        metrics_file = Path(self.cfg.logging.run_dir) / METRICS_FILE
        resumed = self.checkpoints.resume(
            self.c.ddp, self.c.optimizer, self._run_state(), metrics_file
        )
        self.step_count = resumed.step
        if resumed.directory is None:
            return {}
        self._say(f"resumed from {resumed.directory} at step {self.step_count}")
        if not self.c.teacher.load_state(resumed.directory):
            self._warn(
                f"{resumed.directory} holds no EMA teacher (saved without teacher.weights=ema): "
                "the EMA starts again from the student's initial weights"
            )
        self.c.logger.truncate_after(self.step_count)
        return self._inflight_of(resumed.directory, resumed.meta["extra"].get("inflight"))

    def _inflight_of(self, directory: Path, saved: dict[str, Any] | None) -> dict[int, Any]:
        """The batches a resumed checkpoint sampled ahead, when this run can take them."""
        if not saved or not saved["batches"]:
            return {}
        d, layout = self.cfg.rollout.disaggregate, self.c.student_groups.layout
        if d.enabled and (saved["replicas"], saved["staleness"]) == (layout.dp, d.staleness):
            return load_inflight(Path(directory), self.c.student_groups.coords["dp"])
        self._warn(
            f"{directory} holds {len(saved['batches'])} batch(es) sampled ahead by rollout ranks "
            f"({saved['replicas']} data-parallel replica(s), staleness {saved['staleness']}); "
            "this run is laid out otherwise and does not train on them: their prompts are "
            "skipped, and the run continues, though not exactly as the saved one would have"
        )
        return {}

    # -- console -----------------------------------------------------------------------------
    def _skipped(self, why: str) -> None:
        """Say on the console that the step now ending trains nothing, and why."""
        self._warn(f"step {self.step_count + 1} skipped: {why}; the weights were not updated")

    def _say(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(message, flush=True)

    def _warn(self, message: str) -> None:
        if dist.get_rank() == 0:
            warn(message)


def _routing_metrics(routing: RoutingPass | None) -> dict[str, float]:
    """``moe/routing_mismatch`` of the step's old-log-prob pass (an MoE student on the built-in
    engine without replay; collective, every rank alike)."""
    if routing is None or routing.replay:
        return {}
    return mismatch_metrics([routing])
