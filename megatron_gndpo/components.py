"""The composition root: everything a training run works with, built once from a validated
:class:`Config` (the entry points' first step, as torchtitan's and nanochat's are).

Order matters for collectives: every rank builds the student's groups, then the models, then
the teachers' groups and models, in the same order. The cheap checks come first: a teacher whose
tokenizer differs from the student's, a vocabulary one of the models cannot score, a malformed
prompt file or routing value fail in seconds, before any model is built.

Nothing below this module imports it: each component receives the parts it needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.checks.vocab import check_top_k
from megatron_gndpo.config import Config, save_dir, to_dict
from megatron_gndpo.data import load_tokenizer
from megatron_gndpo.data.prompt_sets import PromptSets, load_prompt_sets, require_answers
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.data.vocab import scoring_vocab
from megatron_gndpo.engine.optimizer import build_optimizer, build_scheduler, wrap_ddp
from megatron_gndpo.logging import MetricsLogger, StageTimer, build_logger
from megatron_gndpo.methods import build_method
from megatron_gndpo.models.build import build_model
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups, build_student_groups, layout_of
from megatron_gndpo.rollout.base import Generator
from megatron_gndpo.rollout.build import build_generator, never_sampled
from megatron_gndpo.scorer import RolloutScorer
from megatron_gndpo.teacher.build import (
    build_teachers,
    check_context_fields,
    check_routes,
    routing_of,
    teacher_tokenizers,
)
from megatron_gndpo.teacher.cross_tokenizer import CrossTokenizer
from megatron_gndpo.teacher.routed import TeacherSet


@dataclasses.dataclass
class Components:
    """What :class:`~megatron_gndpo.trainer.Trainer` works with."""

    cfg: Config
    tokenizer: Tokenizer
    vocab_size: int  # the ids both models score
    # the student: its shard, the DDP wrapper, optimizer and schedule, its log-prob head
    student_groups: ParallelGroups
    student: Any
    ddp: Any
    optimizer: Any
    scheduler: Any
    head: TokenLogProbs
    # the teachers (one, or several routed by a prompt field) and the first one's groups
    teacher: TeacherSet
    teacher_groups: ParallelGroups
    # a teacher scores in its own tokenizer (teacher.cross_tokenizer): the stage between the
    # rollout and its pass; None: every teacher scores the student's ids
    cross: CrossTokenizer | None
    scorer: RolloutScorer  # both models' passes over a rollout
    generator: Generator  # the built-in generator, or vLLM (with its own weights)
    data: PromptSets  # training, held-out and outlier prompts, with their samplers
    logger: MetricsLogger
    timer: StageTimer
    save_dir: Path


def _student(cfg: Config, groups: ParallelGroups) -> Any:
    """The student's GPTModel/HybridModel, or its vision-language model (LLaVA around it)."""
    if cfg.model.vision is None:
        return build_model(cfg.model, cfg.parallel, groups)
    from megatron_gndpo.models.vlm import build_vlm

    return build_vlm(cfg.model, cfg.model.vision, cfg.parallel, groups)


def _scheduler(optimizer: Any, cfg: Config) -> Any:
    per_rollout = cfg.trainer.optimizer_steps_per_rollout
    return build_scheduler(
        optimizer, cfg.optimizer, total_steps=cfg.trainer.steps * per_rollout,
        warmup_steps=cfg.optimizer.warmup_steps * per_rollout,
    )  # fmt: skip


def build_components(cfg: Config) -> Components:
    """Groups, tokenizers and their checks, prompts, student (+ DDP, optimizer), teachers,
    scorer, generator, logging (module docstring)."""
    world, t = dist.get_world_size(), cfg.trainer
    student_groups = build_student_groups(layout_of(cfg.parallel, world), seed=t.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    teacher_tokens, cross = teacher_tokenizers(cfg, tokenizer)
    vocab = scoring_vocab(cfg, tokenizer)
    method = build_method(cfg.algorithm)
    check_top_k(cfg, vocab)
    # The data before the models: a malformed prompt file fails in seconds, not after a build.
    data = load_prompt_sets(cfg, tokenizer, student_groups.coords["dp"], student_groups.layout.dp)
    if method.uses_reward:
        require_answers(cfg, data)
    check_routes(routing_of(cfg), data.train, data.outlier)  # evaluation needs no teacher
    check_context_fields(cfg, data)  # what a teacher's own prompt names, in every row

    # Weights are initialised on the CPU generator (use_cpu_initialization): seed each model on
    # its own so a randomly initialised teacher does not depend on the student's layout.
    torch.manual_seed(t.seed)
    student = _student(cfg, student_groups)
    if cfg.checkpoint.init is not None:
        load_checkpoint(
            cfg.checkpoint.init, student, verify=cfg.checkpoint.verify,
            vocab_size=cfg.model.vocab_size,
        )  # fmt: skip
    ddp = wrap_ddp(student, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg.optimizer)
    # A VLM's image placeholder is never sampled: neither model gives it probability mass, so
    # the student trains the distribution it samples from (and the teacher scores that support)
    never = never_sampled(cfg)
    teachers, teacher_groups = build_teachers(
        cfg, student_groups, teacher_tokens, vocab, student=student, excluded_ids=never,
        generates=method.teacher_samples,
    )  # fmt: skip
    head = TokenLogProbs(vocab_size=vocab, excluded_ids=never)
    scorer = RolloutScorer(
        student, student_groups, head=head, teachers=teachers, cross=cross,
        token_budget=t.scoring_token_budget, pack=t.pack_sequences,
    )  # fmt: skip
    return Components(
        cfg=cfg, tokenizer=tokenizer, vocab_size=vocab, student_groups=student_groups,
        student=student, ddp=ddp, optimizer=optimizer, scheduler=_scheduler(optimizer, cfg),
        head=head, teacher=teachers, teacher_groups=teacher_groups, cross=cross, scorer=scorer,
        generator=build_generator(cfg, student, student_groups, tokenizer, vocab), data=data,
        logger=build_logger(cfg.logging, enabled=dist.get_rank() == 0, config_dict=to_dict(cfg)),
        # CUDA runs asynchronously: stage times are only true after a synchronise
        timer=StageTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None),
        save_dir=save_dir(cfg),
    )  # fmt: skip
