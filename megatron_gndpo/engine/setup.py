"""Build everything a training run needs from a validated :class:`Config`, once.

Order matters for collectives: every rank builds the student's groups, then the teacher's, then
the models, in the same order. Start-up refuses a teacher whose tokenizer differs from the
student's, and a vocabulary that one of the models cannot score.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.checks import layout_of
from megatron_gndpo.config import Config, ConfigError, TeacherConfig, save_dir, to_dict
from megatron_gndpo.config.schema import teacher_sections
from megatron_gndpo.data import PromptSampler, encode_prompts, load_prompts, load_tokenizer
from megatron_gndpo.data.datasets import (
    EncodedPrompt,
    PromptExample,
    PromptImages,
    prompt_fingerprint,
)
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.engine.cross_tokenizer import CrossTokenizer, TeacherTokenizer
from megatron_gndpo.engine.optimizer import build_optimizer, build_scheduler, wrap_ddp
from megatron_gndpo.engine.served_teacher import ServedTeacher
from megatron_gndpo.engine.teacher import TeacherScorer
from megatron_gndpo.engine.teachers import Routing, TeacherSet
from megatron_gndpo.logging import MetricsLogger, StageTimer, build_logger
from megatron_gndpo.methods import build_method
from megatron_gndpo.models.build import build_model, build_teacher
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups, build_groups, build_student_groups
from megatron_gndpo.rollout.base import Generator
from megatron_gndpo.rollout.builtin import MegatronGenerator


@dataclasses.dataclass
class Components:
    """What :class:`~megatron_gndpo.trainer.Trainer` works with."""

    cfg: Config
    student_groups: ParallelGroups
    teacher_groups: ParallelGroups  # the first teacher's (the only one's, usually)
    tokenizer: Tokenizer
    vocab_size: int
    student: Any  # the GPTModel shard
    ddp: Any  # megatron DDP around it
    optimizer: Any
    scheduler: Any
    head: TokenLogProbs
    teacher: TeacherSet  # one teacher, or several with routing
    generator: Generator  # MegatronGenerator, or VLLMGenerator (also a weight receiver)
    prompts: list[EncodedPrompt]
    eval_prompts: list[EncodedPrompt]
    skipped_prompts: int
    sampler: PromptSampler
    logger: MetricsLogger
    timer: StageTimer
    save_dir: Path
    # data.outlier_train: the prompts of the outlier steps and their own sampler (else None)
    outlier_prompts: list[EncodedPrompt] = dataclasses.field(default_factory=list)
    outlier_sampler: PromptSampler | None = None
    routing: Routing | None = None  # several teachers: which one scores each prompt
    # a teacher scores in its own tokenizer (teacher.cross_tokenizer): the stage between the
    # rollout and its pass; None: every teacher scores the student's ids
    cross: CrossTokenizer | None = None

    def routes(self, prompts: list[EncodedPrompt], prompt_index: torch.Tensor) -> torch.Tensor:
        """Teacher index ``[n]`` of each rollout row (row ``i``: ``prompts[prompt_index[i]]``)."""
        if self.routing is None:
            return torch.zeros(prompt_index.shape, dtype=torch.long)
        of = [self.routing.of(p.example.source, p.example.where) for p in prompts]
        return torch.tensor([of[int(i)] for i in prompt_index], dtype=torch.long)


def scoring_vocab(cfg: Config, tokenizer: Tokenizer) -> int:
    """The ids both models' distributions are restricted to; checked against both models."""
    vocab = cfg.data.vocab_size if cfg.data.vocab_size is not None else tokenizer.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer produces {tokenizer.vocab_size} ids but data.vocab_size is {vocab}; "
            "raise data.vocab_size or leave it null"
        )
    models = [("model", cfg.model)]
    # a teacher with its own tokenizer is checked against it (teacher_tokenizers)
    sections = [(key, t) for key, t in teacher_sections(cfg) if not t.cross_tokenizer]
    models += [(f"{key}.model", t.model) for key, t in sections]
    for name, model in models:
        if model.vocab_size < vocab:
            raise ConfigError(
                f"{name}.vocab_size ({model.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({vocab}): it cannot score every token id; use a model built for "
                "this tokenizer"
            )
    return vocab


def check_top_k(cfg: Config, vocab: int) -> None:
    """Every configured top-k fits in the ids the models score (the tokenizer's)."""
    used = build_method(cfg.algorithm).top_ks()
    too_big = [f"algorithm.{key}={k}" for key, k in used.items() if k > vocab]
    if too_big:
        raise ConfigError(
            f"{', '.join(too_big)} exceeds the {vocab} token ids the models score (the "
            "tokenizer's vocabulary); lower it"
        )


def check_same_tokenizer(
    student: Tokenizer, teacher: Tokenizer, cfg: Config, key: str = "teacher"
) -> None:
    if student.fingerprint() != teacher.fingerprint():
        section = dict(teacher_sections(cfg)).get(key, cfg.teacher)
        raise ConfigError(
            f"{key}.tokenizer ({section.tokenizer}) differs from the student's "
            f"({cfg.data.tokenizer or 'builtin:char'}): the teacher scores the student's token "
            f"ids, so both must share one vocabulary; set {key}.cross_tokenizer=true to score "
            "the student's text in the teacher's own tokens (gndpo, opd, mix; "
            "docs/methods/cross_tokenizer.md), or pick a teacher of the student's family"
        )


def teacher_tokenizers(
    cfg: Config, student: Tokenizer
) -> tuple[list[Tokenizer], CrossTokenizer | None]:
    """Each teacher's tokenizer, in the teachers' order, and the cross-tokenizer stage when a
    teacher scores in its own (``cross_tokenizer``; None when none does).

    A teacher without ``cross_tokenizer`` must use the student's tokenizer; one with it must
    have a vocabulary its tokenizer's ids fit in.
    """
    tokenizers, stages, cross = [], [], False
    for key, section in teacher_sections(cfg):
        own = student if section.tokenizer is None else load_tokenizer(section.tokenizer)
        if not section.cross_tokenizer:
            check_same_tokenizer(student, own, cfg, key)
        elif section.model.vocab_size < own.vocab_size:
            raise ConfigError(
                f"{key}.model.vocab_size ({section.model.vocab_size}) is smaller than its "
                f"tokenizer's vocabulary ({own.vocab_size}, {key}.tokenizer): it cannot score "
                "every token id; use a model built for this tokenizer"
            )
        cross = cross or section.cross_tokenizer
        tokenizers.append(own)
        same = own.fingerprint() == student.fingerprint()
        limit = section.model.max_position_embeddings
        stages.append(TeacherTokenizer(own, same=same, max_length=limit))
    return tokenizers, CrossTokenizer(student, stages) if cross else None


def _scheduler(optimizer: Any, cfg: Config) -> Any:
    per_rollout = cfg.trainer.optimizer_steps_per_rollout
    return build_scheduler(
        optimizer, cfg.optimizer, total_steps=cfg.trainer.steps * per_rollout,
        warmup_steps=cfg.optimizer.warmup_steps * per_rollout,
    )  # fmt: skip


def _build_student(cfg: Config, groups: ParallelGroups) -> Any:
    """The student's GPTModel, or its vision-language model (LLaVA around the GPT)."""
    if cfg.model.vision is None:
        return build_model(cfg.model, cfg.parallel, groups)
    from megatron_gndpo.models.vlm import build_vlm

    return build_vlm(cfg.model, cfg.model.vision, cfg.parallel, groups)


def _build_teacher(t: TeacherConfig, groups: ParallelGroups) -> Any:
    if t.model.vision is None:
        return build_teacher(t.model, t.parallel, groups)
    from megatron_gndpo.models.vlm import build_vlm_teacher

    return build_vlm_teacher(t.model, t.model.vision, t.parallel, groups)


def _prompts(cfg: Config, spec: str, tokenizer: Tokenizer) -> tuple[list[EncodedPrompt], int]:
    """Encoded prompts of ``spec`` and how many were too long; with images for a vision model."""
    d, limit = cfg.data, cfg.rollout.max_prompt_length
    vision = cfg.model.vision
    key = d.teacher_key if cfg.teachers else None  # routing values matter with several only
    if vision is None:
        examples = load_prompts(
            spec, prompt_key=d.prompt_key, answer_key=d.answer_key, source_key=key
        )
        return encode_prompts(examples, tokenizer, max_prompt_length=limit)
    from megatron_gndpo.data.images import (
        ImageLayout,
        encode_multimodal,
        load_multimodal_prompts,
    )

    layout = ImageLayout.of(vision)
    rows = [
        encode_multimodal(example, tokenizer, layout)
        for example in load_multimodal_prompts(
            spec,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            image_key=d.image_key,
            source_key=key,
        )
    ]
    encoded = [
        EncodedPrompt(_text_example(r.example), r.ids, _prompt_images(r))
        for r in rows
        if len(r.ids) <= limit
    ]
    if not encoded:
        shortest = min(len(r.ids) for r in rows)
        raise ConfigError(
            f"every prompt of {spec} is longer than rollout.max_prompt_length={limit} tokens "
            f"with its image placeholders (the shortest has {shortest}); raise it"
        )
    return encoded, len(rows) - len(encoded)


def _prompt_images(row: Any) -> PromptImages | None:
    """A multimodal row's tiles, their split into images and the original images."""
    if row.pixels is None:
        return None
    return PromptImages(row.pixels, row.tiles_per_image, tuple(row.example.images))


def _text_example(example: Any) -> PromptExample:
    """The prompt text and answer of a multimodal example (its images travel with the ids)."""
    return PromptExample(example.prompt, example.answer, example.index, source=example.source)


def _teacher_generator(
    cfg: Config,
    t: TeacherConfig,
    teacher: Any,
    groups: ParallelGroups,
    tokenizer: Tokenizer,
    vocab: int,
) -> MegatronGenerator | None:
    """The teacher's own generator, for TrOPD's off-policy guidance only."""
    if not build_method(cfg.algorithm).teacher_samples:
        return None
    kind = MegatronGenerator
    if t.model.vision is not None:
        from megatron_gndpo.rollout.multimodal import MultimodalGenerator

        kind = MultimodalGenerator
    return kind(
        teacher, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
        max_sequence_length=t.model.max_position_embeddings,
    )  # fmt: skip


def routing_of(cfg: Config) -> Routing | None:
    """Which teacher scores a prompt (several teachers), from the names and sources."""
    if not cfg.teachers:
        return None
    by_value: dict[str, int] = {}
    for j, t in enumerate(cfg.teachers):
        for value in (t.name, *t.sources):
            by_value.setdefault(value, j)  # overlaps are refused by checks/rules.py
    names = tuple(t.name for t in cfg.teachers)
    default = 0 if cfg.data.default_teacher is None else names.index(cfg.data.default_teacher)
    return Routing(names, by_value, default, key=f"data.teacher_key ({cfg.data.teacher_key})")


def _check_routes(routing: Routing | None, *prompt_sets: list[EncodedPrompt]) -> None:
    """Every prompt names a teacher (or none): a bad routing value fails before the models."""
    if routing is not None:
        for prompts in prompt_sets:
            for p in prompts:
                routing.of(p.example.source, p.example.where or f"prompt {p.example.index}")


def _teachers(
    cfg: Config,
    student_groups: ParallelGroups,
    tokenizers: list[Tokenizer],
    vocab: int,
    never: tuple[int, ...],
) -> tuple[TeacherSet, ParallelGroups]:
    """Every teacher on its own groups, with its weights loaded; the first one's groups.

    ``tokenizers[j]``: teacher j's (:func:`teacher_tokenizers`); a teacher scoring in its own
    tokenizer (``cross_tokenizer``) restricts its distribution to that tokenizer's ids, the
    others to the student's ``vocab``. Each teacher's random initialisation is seeded on its
    own (seed + 1 + its position), so the first teacher of a list is built as the one teacher
    of a ``teacher`` section is.
    """
    world, t = dist.get_world_size(), cfg.trainer
    scorers: list[Any] = []
    first_groups = None
    for j, (_, section) in enumerate(teacher_sections(cfg)):
        name, tokenizer = getattr(section, "name", "teacher"), tokenizers[j]
        own_vocab = tokenizer.vocab_size if section.cross_tokenizer else vocab
        groups = build_groups(layout_of(section.parallel, world), name=f"teacher:{name}")
        if first_groups is None:
            first_groups = groups
        if section.server is not None and section.load is None:
            served = ServedTeacher(section.server, student_groups, name=name)
            served.self_test(vocab)
            scorers.append(served)
            continue
        torch.manual_seed(cfg.trainer.seed + 1 + j)
        model = _build_teacher(section, groups)
        if section.load is not None:
            load_checkpoint(
                section.load, model, verify=cfg.checkpoint.verify,
                vocab_size=section.model.vocab_size,
            )  # fmt: skip
        head = TokenLogProbs(
            vocab_size=own_vocab, temperature=section.temperature, excluded_ids=never
        )
        scorer = TeacherScorer(
            model, groups, student_groups, head=head, token_budget=t.scoring_token_budget,
            pack=t.pack_sequences,
            generator=_teacher_generator(cfg, section, model, groups, tokenizer, vocab),
        )  # fmt: skip
        if section.server is not None:  # the local weights are the self-test's reference only
            served = ServedTeacher(section.server, student_groups, name=name)
            served.self_test(vocab, reference=scorer)
            del scorer, model  # freed: the served teacher scores from now on
            scorers.append(served)
            continue
        scorers.append(scorer)
    assert first_groups is not None
    names = [getattr(s, "name", "teacher") for _, s in teacher_sections(cfg)]
    weights = [getattr(s, "weight", 1.0) for _, s in teacher_sections(cfg)]
    pads = [t.pad_id for t in tokenizers]
    return TeacherSet(scorers, names, weights=weights, pad_ids=pads), first_groups


def _generator(
    cfg: Config, student: Any, groups: ParallelGroups, tokenizer: Tokenizer, vocab: int
) -> Generator:
    if cfg.rollout.engine == "builtin" and cfg.model.vision is not None:
        from megatron_gndpo.rollout.multimodal import MultimodalGenerator

        return MultimodalGenerator(
            student, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
            max_sequence_length=cfg.model.max_position_embeddings,
        )  # fmt: skip
    if cfg.rollout.engine == "builtin" or cfg.rollout.disaggregate.enabled:
        # with rollout ranks apart the engine runs there; the trainer's copy evaluates
        return MegatronGenerator(
            student, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
            max_sequence_length=cfg.model.max_position_embeddings,
            record_routing=cfg.model.is_moe,  # the trainer compares or replays the experts
        )  # fmt: skip
    from megatron_gndpo.rollout.vllm_engine import VLLMGenerator, write_engine_config

    # The engine starts from the architecture alone (dummy weights); the trainer loads them.
    engine_dir = Path(cfg.logging.run_dir) / "engine"
    if dist.get_rank() == 0:
        write_engine_config(
            engine_dir, cfg.model, family=cfg.model.hf_family, dtype=cfg.model.params_dtype,
            tokenizer_dir=cfg.data.tokenizer if cfg.model.vision is not None else None,
        )  # fmt: skip
    dist.barrier()
    return VLLMGenerator(
        cfg.rollout, engine_dir, pad_id=tokenizer.pad_id,
        tensor_parallel_size=cfg.parallel.tensor_parallel, dtype=cfg.model.params_dtype,
        seed=cfg.trainer.seed, max_model_len=cfg.model.max_position_embeddings,
        vision=_vision_input(cfg, student), vocab_size=vocab,
        model_vocab_size=cfg.model.vocab_size, excluded_ids=never_sampled(cfg),
        head_dim=cfg.model.head_dim,
    )  # fmt: skip


def never_sampled(cfg: Config) -> tuple[int, ...]:
    """Token ids no rollout samples: a VLM's image placeholder (the generators mask it)."""
    return () if cfg.model.vision is None else (cfg.model.vision.image_token_id,)


def _vision_input(cfg: Config, student: Any) -> Any:
    """How a VLM student's images reach vLLM (None for a text model)."""
    vision = cfg.model.vision
    if vision is None:
        return None
    from megatron_gndpo.data.images import ImageLayout
    from megatron_gndpo.models.vlm import rollout_image_embeddings
    from megatron_gndpo.rollout.vllm_engine import VisionInput

    return VisionInput(
        ImageLayout.of(vision),
        mode=cfg.rollout.vllm_image_input,
        embed=functools.partial(rollout_image_embeddings, student),
        freeze_encoder=vision.freeze_encoder,
        freeze_projector=vision.freeze_projector,
    )


def _sampler(
    cfg: Config, prompts: list[EncodedPrompt], groups: ParallelGroups, source: str
) -> PromptSampler:
    return PromptSampler(
        len(prompts), prompts_per_step=cfg.rollout.prompts_per_step,
        dp_rank=groups.coords["dp"], dp_size=groups.layout.dp, seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle, fingerprint=prompt_fingerprint(prompts), source=source,
    )  # fmt: skip


def build_components(cfg: Config) -> Components:
    """Groups, tokenizer, data, student (+ DDP, optimizer), teacher, generator, logging."""
    world = dist.get_world_size()
    student_groups = build_student_groups(layout_of(cfg.parallel, world), seed=cfg.trainer.seed)

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    own_tokenizers, cross = teacher_tokenizers(cfg, tokenizer)
    vocab = scoring_vocab(cfg, tokenizer)
    check_top_k(cfg, vocab)
    # The data before the models: a malformed prompt file fails in seconds, not after a build.
    prompts, skipped = _prompts(cfg, cfg.data.train, tokenizer)
    eval_prompts: list[EncodedPrompt] = []
    if cfg.data.eval is not None:
        eval_prompts, _ = _prompts(cfg, cfg.data.eval, tokenizer)
    outlier_prompts: list[EncodedPrompt] = []
    if cfg.data.outlier_train is not None:
        outlier_prompts, _ = _prompts(cfg, cfg.data.outlier_train, tokenizer)
    routing = routing_of(cfg)
    _check_routes(routing, prompts, outlier_prompts)  # evaluation needs no teacher

    # Weights are initialised on the CPU generator (use_cpu_initialization): seed each model on
    # its own so a randomly initialised teacher does not depend on the student's layout.
    torch.manual_seed(cfg.trainer.seed)
    student = _build_student(cfg, student_groups)
    verify = cfg.checkpoint.verify
    if cfg.checkpoint.init is not None:
        load_checkpoint(
            cfg.checkpoint.init, student, verify=verify, vocab_size=cfg.model.vocab_size
        )
    ddp = wrap_ddp(student, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg.optimizer)
    # A VLM's image placeholder is never sampled: neither model gives it probability mass, so
    # the student trains the distribution it samples from (and the teacher scores that support)
    never = never_sampled(cfg)
    teachers, teacher_groups = _teachers(cfg, student_groups, own_tokenizers, vocab, never)
    head = TokenLogProbs(vocab_size=vocab, excluded_ids=never)
    logs_here = dist.get_rank() == 0
    return Components(
        cfg=cfg,
        student_groups=student_groups,
        teacher_groups=teacher_groups,
        tokenizer=tokenizer,
        vocab_size=vocab,
        student=student,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=_scheduler(optimizer, cfg),
        head=head,
        teacher=teachers,
        generator=_generator(cfg, student, student_groups, tokenizer, vocab),
        prompts=prompts,
        eval_prompts=eval_prompts,
        skipped_prompts=skipped,
        sampler=_sampler(cfg, prompts, student_groups, f"data.train ({cfg.data.train})"),
        logger=build_logger(cfg.logging, enabled=logs_here, config_dict=to_dict(cfg)),
        # CUDA runs asynchronously: stage times are only true after a synchronise
        timer=StageTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None),
        save_dir=save_dir(cfg),
        outlier_prompts=outlier_prompts,
        outlier_sampler=_sampler(
            cfg, outlier_prompts, student_groups, f"data.outlier_train ({cfg.data.outlier_train})"
        )
        if cfg.data.outlier_train is not None
        else None,
        routing=routing,
        cross=cross,
    )
