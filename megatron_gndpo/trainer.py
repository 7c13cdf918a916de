"""The GNDPO training loop: ``Trainer.step()`` is the data flow of docs/DESIGN.md, a call a stage.

    prompts -> rollout -> rewards (-> filter) -> teacher log-probs -> student old log-probs
            -> advantages (+ off-policy correction) -> clipped update -> weight sync -> checkpoint

(A teacher with its own tokenizer scores its own tokens of the responses: the rows are built
before its pass and its span scores put on the student's tokens after the student's,
engine/cross_tokenizer.py.)

Every rank runs the same step; collectives inside each stage use the groups of the model that
stage runs on. All randomness of a step derives from (seed, step, data-parallel rank), so a run
resumed from a checkpoint continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from megatron_gndpo import evaluation, seeding
from megatron_gndpo.algorithms.metrics import (
    StabilityMonitor,
    advantage_metrics,
    score_metrics,
    teacher_metrics,
)
from megatron_gndpo.algorithms.offpolicy import importance_weights, offpolicy_metrics
from megatron_gndpo.checkpoint.convert import describe_checkpoints
from megatron_gndpo.checkpoint.dist import load_checkpoint, save_checkpoint
from megatron_gndpo.checkpoint.resume import (
    TokenizerStamp,
    plan_start,
    restore_run_state,
    resume_from,
    run_state,
    set_aside,
    warn,
)
from megatron_gndpo.config import Config, save_dir
from megatron_gndpo.data.datasets import tiles_of
from megatron_gndpo.engine.cross_tokenizer import teacher_input
from megatron_gndpo.engine.routing import RoutingPass, mismatch_metrics
from megatron_gndpo.engine.scoring import (
    ScoreRequest,
    Scores,
    broadcast_scores,
    required,
    score_batch,
)
from megatron_gndpo.engine.setup import Components, build_components, never_sampled
from megatron_gndpo.engine.update import UpdateBatch, run_update
from megatron_gndpo.logging import progress
from megatron_gndpo.logging.sinks import METRICS_FILE
from megatron_gndpo.logging.throughput import update_mfu
from megatron_gndpo.methods import StepBatch, Targets, build_method
from megatron_gndpo.rewards.verifiable import reward
from megatron_gndpo.rollout.base import Rollout, SamplingParams
from megatron_gndpo.rollout.filters import (
    MIN_STEP_TOKENS,
    drop_reasons,
    emptied_reasons,
    filter_metrics,
    hollow,
    keep_rows,
)
from megatron_gndpo.rollout.metrics import EndingWatch, rollout_metrics
from megatron_gndpo.rollout.pipeline import Drawn, RolloutPipeline
from megatron_gndpo.rollout.prefixes import continue_teacher_prefixes
from megatron_gndpo.rollout.remote import RemoteRollouts, load_inflight
from megatron_gndpo.rollout.schedule import is_outlier_step, temperature_at

# Keys computed on the student's last pipeline stage and shared with the logging rank.
_LAST_STAGE_KEYS = ("loss", "ratio/mean", "clip/frac", "guidance/kl_mean")
_OPTIONAL_KEYS = ("guidance/kl_mean",)


class _StopRequest:
    """SIGTERM/SIGUSR1 set a flag; every rank stops at the same step (one all-reduce)."""

    _SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self.previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Trainer:
    """On-policy distillation of the student towards the frozen teacher."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # Where to start is decided before any model is built; nothing is written into the
        # checkpoint directory until the resume has succeeded.
        self._start = plan_start(cfg.checkpoint, save_dir(cfg))
        self.c: Components = build_components(cfg)
        self.method = build_method(cfg.algorithm)  # what differs between estimators
        self.params = SamplingParams.from_config(cfg.rollout, eos_id=self.c.tokenizer.eos_id)
        self.step_count = 0
        self._syncs = 0  # weight syncs into an external engine so far
        self._routing: RoutingPass | None = None  # the step's old-log-prob pass (MoE)
        self.stability = StabilityMonitor(clip=cfg.optimizer.clip_grad)  # checkpointed
        self.ending = EndingWatch(cfg.rollout.max_response_length, self.method.never_stops_advice)
        self.tokenizer = TokenizerStamp(cfg.data.tokenizer, self.c.tokenizer.fingerprint())
        self.run_id = ""
        # rollout.disaggregate: the rollout ranks sample, batches ahead with staleness > 0
        self.pipeline: RolloutPipeline | None = None
        if cfg.rollout.disaggregate.enabled:
            self.pipeline = RolloutPipeline(
                RemoteRollouts(cfg, self.c.student, self.c.student_groups),
                staleness=cfg.rollout.disaggregate.staleness, steps=cfg.trainer.steps,
                draw=self._draw, resolve=self._resolve, seeds=self._seeds,
                sampling=self._sampling,
            )  # fmt: skip
        if self.c.skipped_prompts:
            total = self.c.skipped_prompts + len(self.c.prompts)
            self._warn(
                f"{self.c.skipped_prompts} of {total} training prompts are longer than "
                f"rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens and are left "
                "out (logged as prompts/skipped_too_long); raise rollout.max_prompt_length to "
                "train on them"
            )
        inflight = self._resume()
        self._describe_checkpoints()
        if self.pipeline is not None:  # the rollout ranks start without the student's weights
            self.pipeline.start(self.step_count, inflight)
        else:
            self._sync_engine()  # so does an external engine

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
        if interval and self.c.eval_prompts and self.step_count % interval == 0:
            metrics |= self.evaluate()
        self.c.logger.log(self.step_count, metrics)
        with self.c.timer.time("checkpoint"):  # popped with the next step's stages
            self._maybe_save()
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
            if hasattr(c.generator, "sleep"):
                c.generator.sleep()  # give the GPU memory to scoring and training
        with timer.time("rewards"):  # a verifiable reward needs no teacher: it can filter rows
            rewards = self._rewards(sampled, prompts)
            rollout, kept, filtered = self._filter(sampled, rewards)  # dropped rows: stubs
            metrics |= filtered
        student, self._routing = None, None  # this step's, once the student scores it
        if metrics.get("filter/tokens_kept", math.inf) < MIN_STEP_TOKENS:  # global: all skip
            metrics |= {"skipped": 1.0, "skipped/filtered_all": 1.0}  # and nothing is scored
            self._skipped(f"algorithm.filter dropped every row ({emptied_reasons(metrics)})")
        else:
            routes = c.routes(prompts, rollout.prompt_index)  # [n]: each row's teacher
            # timed inside, in the method's order; scored: the tokens the teacher scored
            teacher, student, scored, metrics_x = self._score(rollout, routes, prompts)
            metrics |= metrics_x
            bad = c.teacher.nonfinite(teacher.logprobs, scored, routes)
            if bad:  # before any use
                metrics |= {"skipped": 1.0, "skipped/nonfinite_teacher": 1.0}  # all ranks
                self._skipped(
                    f"the log-probs of {' and '.join(bad)} are not finite (NaN or inf) on a "
                    "response token"
                )
            else:
                with timer.time("advantages"):
                    targets, found = self._targets(
                        rollout, teacher, student, rewards, routes, scored
                    )
                    weights, corrected = self._correction(rollout, student.logprobs)
                with timer.time("update"):
                    updated = self._update(rollout, student.logprobs, targets, weights)
                metrics |= found | corrected | updated
        # before the checkpoint, whose state must include this step
        metrics |= self.stability.observe(
            metrics.get("grad_norm", math.nan), metrics.get("score/rms", math.nan)
        )
        with timer.time("weight_sync"):
            metrics |= self._sync_engine()
        self.step_count += 1
        metrics |= self._rollout_metrics(sampled, student, rewards, kept)
        if (never_stops := self.ending.observe(metrics["finished/frac"])) is not None:
            self._warn(never_stops)
        metrics |= self._routing_metrics()
        metrics |= timer.pop()
        metrics["time/step"] = time.perf_counter() - started
        metrics["tokens/s"] = metrics["tokens/step"] / metrics["time/step"]
        metrics |= self._mfu(rollout, metrics)  # the rows trained on, stubs included
        return metrics

    def train(self) -> list[dict[str, float]]:
        """Steps until ``trainer.steps``, with logging, evaluation and a final checkpoint.

        SIGTERM or SIGUSR1 (Slurm's warning before preemption or the time limit) ends the run
        after the current step, with a checkpoint the requeued job resumes from.
        """
        history = []
        stop = _StopRequest()
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
                self._say(f"stop requested: saving at step {self.step_count} and exiting")
                break
        stop.restore()
        bar.close()
        interval = self.cfg.checkpoint.save_interval
        if not (interval and self.step_count % interval == 0):  # not saved by the last step
            self._save()
        if self.pipeline is not None:
            self.pipeline.stop()  # the rollout ranks end their loop
        self.c.logger.close()
        return history

    # ----------------------------------------------------------------------------------------
    def _next_prompts(self) -> list[Any]:
        return self._resolve(self._draw(self.step_count + 1))

    def _draw(self, batch: int) -> Drawn:
        """This replica's prompts of ``batch`` (1-based: the step that trains on it), as the
        prompt set they come from and their indices (what a checkpoint stores)."""
        outliers = self.c.outlier_sampler
        if outliers is not None and is_outlier_step(self.cfg.rollout, batch):
            return "outlier", outliers.next_step()  # data.outlier_train
        return "train", self.c.sampler.next_step()

    def _resolve(self, drawn: Drawn) -> list[Any]:
        source, indices = drawn
        prompts = self.c.outlier_prompts if source == "outlier" else self.c.prompts
        return [prompts[i] for i in indices]

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

    def _generate(
        self, prompts: list[Any], ids: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Rollout:
        """The student's generator on ``ids`` (the prompts' ids, maybe extended), with the
        prompts' images for a vision-language student; the rows carry their tiles."""
        if self.cfg.model.vision is None:
            return self.c.generator.generate(ids, params, seeds=seeds)
        images = [p.images for p in prompts]
        rollout = self.c.generator.generate(ids, params, seeds=seeds, images=images)
        rollout.images = [tiles_of(images[int(i)]) for i in rollout.prompt_index]
        return rollout

    def _rollout(self, prompts: list[Any], params: SamplingParams | None = None) -> Rollout:
        ids = [list(p.ids) for p in prompts]
        return self._generate(prompts, ids, params or self.params, self._seeds(prompts))

    def _sample(self, prompts: list[Any]) -> Rollout:
        """The step's rollout: on-policy, or continued from teacher-written prefixes when the
        method says so (TrOPD's off-policy guidance, rollout/prefixes.py)."""
        share = self.method.prefix_share(self.step_count + 1)
        params = self._sampling(self.step_count + 1)
        if share == 0.0:
            return self._rollout(prompts, params)
        images = [p.images for p in prompts] if self.cfg.model.vision is not None else None
        return continue_teacher_prefixes(
            [list(p.ids) for p in prompts], share, teacher=self.c.teacher,
            generate=lambda ids, sampling, seeds: self._generate(prompts, ids, sampling, seeds),
            params=params, configured=self.params, seeds=self._seeds(prompts), images=images,
        )  # fmt: skip

    def _sync_engine(self) -> dict[str, float]:
        """Push the student's weights into an external engine (vLLM); nothing for the built-in
        generator, which samples from the trained weights themselves."""
        if self.pipeline is not None:  # the rollout ranks: the weights of the step now ending
            return self.pipeline.advance(self.step_count + 1)
        engine = self.c.generator
        if not hasattr(engine, "load_weights"):
            return {}
        from megatron_gndpo.weight_sync import WeightReceiver, sync_weights

        if hasattr(engine, "wake_up"):
            engine.wake_up()
        parts = engine.weight_parts() if hasattr(engine, "weight_parts") else None
        metrics = sync_weights(
            cast(WeightReceiver, engine), self.c.student, self.c.student_groups, self.cfg.model,
            family=self.cfg.model.hf_family, vision=self.cfg.model.vision, parts=parts,
        )  # fmt: skip
        self._syncs += 1
        return metrics | self._check_engine(engine)

    def _check_engine(self, engine: Any) -> dict[str, float]:
        """The engine's log-probs of a probe sequence against the student's, after a sync
        (``rollout.weight_sync_check``): a silently corrupted engine stops the run."""
        from megatron_gndpo.weight_sync.check import check_due, check_engine, tolerance_of

        r, model = self.cfg.rollout, self.cfg.model
        if not check_due(r.weight_sync_check, self._syncs):
            return {}
        tolerance = tolerance_of(r, model.params_dtype)
        return check_engine(
            engine, self.c.student, self.c.student_groups, vocab_size=model.vocab_size,
            tolerance=tolerance, excluded_ids=never_sampled(self.cfg),
            vision_language=model.vision is not None,
        )  # fmt: skip

    def _score(
        self, rollout: Rollout, routes: torch.Tensor, prompts: list[Any]
    ) -> tuple[Scores, Scores, torch.Tensor, dict[str, float]]:
        """Teacher and student (rollout-weight) scores of the rollout, row ``i`` by teacher
        ``routes[i]``; the method says what each scores besides the sampled tokens, and which
        goes first (vOPD: the student). Also the ``[n, S]`` tokens the teacher scored and, for
        a teacher with its own tokenizer (engine/cross_tokenizer.py: its rows before its pass,
        its span scores on the student's tokens after the student's), the alignment's
        metrics."""
        c, method, timer = self.c, self.method, self.c.timer
        student = None
        with timer.time("cross_tokenizer"):  # the teacher's own rows (or the student's)
            rows, tokens, lengths = teacher_input(c.cross, rollout, prompts, routes)
        if method.student_first:
            with timer.time("old_logprobs"):
                student = self._student_scores(rollout, method.student_request(None))
        with timer.time("teacher_logprobs"):
            step_seed = seeding.step_seed(self.cfg.trainer.seed, self.step_count)
            request = method.teacher_request(student, step_seed)
            if request is not None and request.full_kl:  # the student's output shard meets it
                request = dataclasses.replace(request, kl_weight=self._student_output_weight())
            teacher = c.teacher.score_batch(
                tokens, lengths, request, images=rollout.images, routes=routes
            )
        if student is None:
            with timer.time("old_logprobs"):
                student = self._student_scores(rollout, method.student_request(teacher))
        student.hidden = None  # [n, S, H]: used by the teacher's pass only
        if c.cross is None or rows is None:
            return teacher, student, rollout.response_mask, {}
        with timer.time("cross_tokenizer"):
            teacher, scored, metrics = c.cross.on_student(
                teacher, rows, student.logprobs, rollout.response_mask, c.student_groups.dp_cp
            )
        return teacher, student, scored, metrics

    def _skipped(self, why: str) -> None:
        """Say on the console that the step now ending trains nothing, and why."""
        self._warn(f"step {self.step_count + 1} skipped: {why}; the weights were not updated")

    def _student_output_weight(self) -> torch.Tensor | None:
        """This rank's shard of the student's output layer (last stage), else None."""
        if not self.c.student_groups.is_last_stage:
            return None
        model = self.c.student
        model = getattr(model, "language_model", model)  # a VLM's output layer is its LM's
        if model.share_embeddings_and_output_weights:  # tied: the (last stage's) embedding
            return cast(torch.Tensor, model.shared_embedding_or_output_weight()).detach()
        return cast(torch.Tensor, model.output_layer.weight).detach()

    def _student_scores(self, rollout: Rollout, request: ScoreRequest) -> Scores:
        c = self.c
        self._routing = None  # an MoE student: compare with (or replay) the sampler's experts
        if rollout.routing is not None:
            replay = self.cfg.algorithm.routing_replay == "rollout"
            self._routing = RoutingPass(
                c.student, rollout.lengths.tolist(), rollout.routing, replay=replay
            )
        scores = score_batch(
            c.student, c.student_groups, rollout.tokens, rollout.lengths, head=c.head,
            token_budget=self.cfg.trainer.scoring_token_budget,
            pack=self.cfg.trainer.pack_sequences, request=request, images=rollout.images,
            routing=self._routing,
        )  # fmt: skip
        device = next(c.student.parameters()).device  # the broadcast goes over NCCL on GPUs
        template = request.template(*rollout.tokens.shape)
        scores = broadcast_scores(scores, template, c.student_groups, device)
        return scores.to(rollout.tokens.device)

    def _rewards(self, rollout: Rollout, prompts: list[Any]) -> torch.Tensor | None:
        answers = [prompts[int(i)].example.answer for i in rollout.prompt_index]
        if any(a is None for a in answers):
            return None
        texts = [
            self.c.tokenizer.decode(rollout.tokens[i, rollout.prompt_lengths[i] : n].tolist())
            for i, n in enumerate(rollout.lengths.tolist())
        ]
        return torch.tensor([reward(t, a) for t, a in zip(texts, answers, strict=True)])

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

    def _targets(
        self,
        rollout: Rollout,
        teacher: Scores,
        student: Scores,
        rewards: torch.Tensor | None,
        routes: torch.Tensor,
        scored: torch.Tensor | None = None,
    ) -> tuple[Targets, dict[str, float]]:
        """The method's targets and metrics; ``scored [n, S]``: the response tokens the teacher
        scored (None: all of them, as unless it has its own tokenizer)."""
        mask = rollout.response_mask
        scored = mask if scored is None else scored
        group = self.c.student_groups.dp_cp
        metrics = score_metrics(
            teacher.logprobs, student.logprobs, scored.float(),
            kl_clip=self.cfg.algorithm.kl_clip, group=group,
        )  # fmt: skip
        teachers = self.c.teacher
        several = len(teachers) > 1
        per_teacher = several and self.cfg.algorithm.teacher_stats == "teacher"
        targets, extra = self.method.targets(
            StepBatch(
                teacher, student, mask, rewards, group_size=self.params.samples_per_prompt,
                group=group, step=self.step_count + 1, tokens=rollout.tokens,
                teacher_written=rollout.teacher_written,
                stat_groups=routes if per_teacher else None,
                num_stat_groups=len(teachers) if per_teacher else 1,
                scored_mask=None if self.c.cross is None else scored,
            )
        )  # fmt: skip
        if several:
            metrics |= teacher_metrics(
                teacher.logprobs, student.logprobs, scored, routes, teachers.names,
                kl_clip=self.cfg.algorithm.kl_clip, group=group,
            )  # fmt: skip
            weights = torch.tensor(teachers.weights, dtype=targets.advantages.dtype)
            if bool((weights != 1.0).any()):  # each teacher's share of the policy gradient
                row_weight = weights[routes].to(targets.advantages.device)
                targets.advantages = targets.advantages * row_weight[:, None]
        metrics |= extra | advantage_metrics(targets.advantages, mask.float(), group=group)
        return targets, metrics

    def _correction(
        self, rollout: Rollout, old_lp: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Importance weights ``[n, S]`` of the policy-gradient term for the gap between the
        sampler's log-probs and the trainer's ``old_lp`` (``algorithm.offpolicy``,
        docs/methods/offpolicy.md), with their metrics; None and no metrics without a
        correction."""
        o = self.cfg.algorithm.offpolicy
        if o.correction == "none":
            return None, {}
        sampled = rollout.sampled_mask  # the tokens with a sampler log-prob
        weights, info = importance_weights(
            old_lp, rollout.sampler_logprobs, sampled, correction=o.correction, level=o.level,
            tis_cap=o.tis_cap, mask_low=o.mask_low, mask_high=o.mask_high,
        )  # fmt: skip
        metrics = offpolicy_metrics(
            weights, info, sampled, correction=o.correction, group=self.c.student_groups.dp_cp
        )
        return weights, metrics

    def _update(
        self,
        rollout: Rollout,
        old_lp: torch.Tensor,
        targets: Targets,
        is_weights: torch.Tensor | None = None,
    ) -> dict[str, float]:
        c, t = self.c, self.cfg.trainer
        mask = rollout.response_mask
        steps = run_update(
            c.ddp, c.optimizer, c.scheduler,
            UpdateBatch(
                rollout.tokens, old_lp, targets.advantages, mask, pg_mask=targets.pg_mask,
                is_weights=is_weights, aux_ids=targets.aux_ids, aux_logq=targets.aux_logq,
                aux_mask=targets.aux_mask, aux_coef=targets.aux_coef,
                entropy_coef=targets.entropy_coef, images=rollout.images,
                routing=self._replayed(rollout),
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

    def _replayed(self, rollout: Rollout) -> torch.Tensor | None:
        """The experts the update replays (algorithm.routing_replay=rollout), else None."""
        if self.cfg.algorithm.routing_replay == "rollout":
            return rollout.routing
        return None

    def _routing_metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch`` of this step's old-log-prob pass (an MoE student on the
        built-in engine without replay; collective, every rank alike)."""
        if self._routing is None or self._routing.replay:
            return {}
        return mismatch_metrics([self._routing])

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
        out["prompts/skipped_too_long"] = float(self.c.skipped_prompts)
        out["rollout/temperature"] = temperature_at(self.cfg.rollout, self.step_count)
        return out | self.method.rollout_metrics(self.step_count, written_frac)

    def _mfu(self, rollout: Rollout, metrics: dict[str, float]) -> dict[str, float]:
        """Model FLOPs utilisation of the update stage (GPUs with a known peak only); every
        data-parallel replica processes its own rows, model-parallel ranks share them."""
        return update_mfu(
            self.cfg.model, rollout.lengths.tolist(), metrics.get("time/update", 0.0),
            replicas=self.c.student_groups.layout.dp, world_size=dist.get_world_size(),
        )  # fmt: skip

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation (megatron_gndpo/evaluation.py): greedy accuracy, and with
        ``trainer.eval_samples`` the sampled accuracy and the reverse KL to the teacher."""
        return evaluation.evaluate(self)

    # ----------------------------------------------------------------------------------------
    def _run_state(self) -> dict[str, Any]:
        """What a checkpoint saves besides the weights and the optimizer (checkpoint/resume.py)."""
        return {  # the tokenizer first: another vocabulary is the cause to name
            "tokenizer": self.tokenizer, "sampler": self.c.sampler, "scheduler": self.c.scheduler,
            "stability": self.stability, "outlier_sampler": self.c.outlier_sampler,
        }  # fmt: skip

    def _maybe_save(self) -> None:
        interval = self.cfg.checkpoint.save_interval
        if interval and self.step_count % interval == 0:
            self._save()

    def _save(self) -> None:
        extra, files = run_state(self._run_state()), None  # files: the in-flight batches
        if self.pipeline is not None:  # the batches sampled ahead go into the checkpoint
            replicas = self.c.student_groups.layout.dp
            extra["inflight"], files = self.pipeline.checkpoint(replicas)
        save_checkpoint(
            self.c.save_dir, self.step_count, self.c.ddp, optimizer=self.c.optimizer,
            extra=extra, keep_last=self.cfg.checkpoint.keep_last, run_id=self.run_id,
            model_config=self.cfg.model, tokenizer=self.cfg.data.tokenizer, extra_files=files,
        )  # fmt: skip

    def _say(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(message, flush=True)

    def _describe_checkpoints(self) -> None:
        """The architecture beside the checkpoints; written only once the run has started (a
        failed resume leaves the old one)."""
        if dist.get_rank() == 0:
            describe_checkpoints(self.c.save_dir, self.cfg.model, self.cfg.model.vision)

    def _resume(self) -> dict[int, Any]:
        """Continue from the newest intact checkpoint of the plan (checkpoint.load, or the save
        directory's latest), or start at step 0; then move aside what the run will not continue
        (see checkpoint/resume.py). Returns the batches the checkpoint's run had sampled ahead
        (rollout.disaggregate), by batch: (result, drawn prompts); empty when none."""
        verify = self.cfg.checkpoint.verify
        resumed = resume_from(
            self._start,
            lambda d: load_checkpoint(d, self.c.ddp, optimizer=self.c.optimizer, verify=verify),
            say=self._warn,
            verify=verify,
        )
        self.run_id, self.step_count = resumed.run_id, resumed.step
        if resumed.directory is not None:
            restore_run_state(self._run_state(), resumed.meta["extra"], resumed.directory)
        if dist.get_rank() == 0:
            metrics = Path(self.cfg.logging.run_dir) / METRICS_FILE
            moved = set_aside(self._start, resumed, metrics)
            if moved is not None:
                self._warn(f"moved what this run does not continue into {moved}; nothing deleted")
        if resumed.directory is None:
            return {}
        self._say(f"resumed from {resumed.directory} at step {self.step_count}")
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

    def _warn(self, message: str) -> None:
        if dist.get_rank() == 0:
            warn(message)
