"""The run's teachers from its config: each on its own groups, with its weights and tokenizer.

Order matters for collectives: every rank builds the teachers in the config's order, each one's
groups before its model. Each teacher's random initialisation is seeded on its own (seed + 1 +
its position), so the first teacher of a list is built as the one teacher of a ``teacher``
section is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.checks.vocab import check_teacher_tokenizer
from megatron_gndpo.config import Config, TeacherConfig
from megatron_gndpo.config.schema import teacher_sections
from megatron_gndpo.data import load_tokenizer
from megatron_gndpo.data.datasets import EncodedPrompt
from megatron_gndpo.data.prompt_sets import PromptSets
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.models.build import build_teacher
from megatron_gndpo.models.logprob_head import TokenLogProbs
from megatron_gndpo.parallel.groups import ParallelGroups, build_groups, layout_of
from megatron_gndpo.rollout.builtin import MegatronGenerator
from megatron_gndpo.teacher.base import Teacher
from megatron_gndpo.teacher.context import check_fields
from megatron_gndpo.teacher.cross_tokenizer import CrossTokenizer, TeacherTokenizer
from megatron_gndpo.teacher.ema import EMAWeights
from megatron_gndpo.teacher.local import LocalTeacher
from megatron_gndpo.teacher.routed import Routing, TeacherSet
from megatron_gndpo.teacher.served import ServedTeacher


def teacher_tokenizers(
    cfg: Config, student: Tokenizer
) -> tuple[list[Tokenizer], CrossTokenizer | None]:
    """Each teacher's tokenizer, in the teachers' order, and the stage that builds the teachers'
    own rows when a teacher scores in its own tokenizer (``cross_tokenizer``) or after its own
    prompt (``context``); None when none does.

    A teacher without ``cross_tokenizer`` must use the student's tokenizer; one with it must
    have a vocabulary its tokenizer's ids fit in.
    """
    tokenizers, stages, own_rows = [], [], False
    for key, section in teacher_sections(cfg):
        own = student if section.tokenizer is None else load_tokenizer(section.tokenizer)
        check_teacher_tokenizer(cfg, key, student, own, section.cross_tokenizer)
        # its own tokenizer or its own prompt: the teacher scores rows of its own
        own_rows = own_rows or section.cross_tokenizer or section.context is not None
        tokenizers.append(own)
        same = own.fingerprint() == student.fingerprint()
        limit = section.model.max_position_embeddings
        stages.append(TeacherTokenizer(own, same=same, max_length=limit, context=section.context))
    return tokenizers, CrossTokenizer(student, stages) if own_rows else None


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


def check_routes(routing: Routing | None, *prompt_sets: Sequence[EncodedPrompt]) -> None:
    """Every prompt names a teacher (or none): a bad routing value fails before the models."""
    if routing is not None:
        for prompts in prompt_sets:
            for p in prompts:
                routing.of(p.example.source, p.example.where or f"prompt {p.example.index}")


def _model(t: TeacherConfig, groups: ParallelGroups) -> Any:
    if t.model.vision is None:
        return build_teacher(t.model, t.parallel, groups)
    from megatron_gndpo.models.vlm import build_vlm_teacher

    return build_vlm_teacher(t.model, t.model.vision, t.parallel, groups)


def _generator(
    t: TeacherConfig, model: Any, groups: ParallelGroups, tokenizer: Tokenizer, vocab: int
) -> MegatronGenerator:
    """The teacher's own generator (TrOPD's teacher-written prefixes)."""
    kind = MegatronGenerator
    if t.model.vision is not None:
        from megatron_gndpo.rollout.multimodal import MultimodalGenerator

        kind = MultimodalGenerator
    return kind(
        model, groups, vocab_size=vocab, pad_id=tokenizer.pad_id,
        max_sequence_length=t.model.max_position_embeddings,
    )  # fmt: skip


def _served(
    section: TeacherConfig, student_groups: ParallelGroups, name: str, vocab: int, reference: Any
) -> ServedTeacher:
    """A teacher behind ``section.server``, self-tested at start-up (against ``reference``, the
    same weights run locally, when ``section.load`` gives them)."""
    assert section.server is not None
    served = ServedTeacher(section.server, student_groups, name=name)
    served.self_test(vocab, reference=reference)
    return served


def check_context_fields(cfg: Config, data: PromptSets) -> None:
    """Every prompt a teacher with its own prompt scores has the fields the prompt names:
    training and outlier prompts, and the held-out ones when the evaluation samples (its
    reverse KL is the teacher's); with several teachers, each prompt its own teacher's."""
    routing = routing_of(cfg)
    sets = [(data.train, cfg.data.train), (data.outlier, cfg.data.outlier_train or "")]
    if cfg.trainer.eval_samples:
        sets.append((data.eval, cfg.data.eval or ""))
    for j, (key, section) in enumerate(teacher_sections(cfg)):
        if section.context is None:
            continue
        for prompts, spec in sets:
            mine = [
                p for p in prompts
                if routing is None or routing.of(p.example.source, p.example.where) == j
            ]  # fmt: skip
            check_fields(key, section.context, mine, spec)


def _weights(
    cfg: Config, section: TeacherConfig, model: Any, student: Any, same_layout: bool
) -> EMAWeights | None:
    """Load the teacher's weights into ``model``: ``teacher.load``, or the student's
    (``teacher.weights``): its initial ones (``checkpoint.init`` at another layout, else a copy
    of the student as built, on the same shards), and for an EMA the follower that updates them
    after every optimizer step (returned; None otherwise)."""
    if section.weights == "load":
        if section.load is not None:
            load_checkpoint(
                section.load, model, verify=cfg.checkpoint.verify,
                vocab_size=section.model.vocab_size,
            )  # fmt: skip
        return None
    if not same_layout:  # another layout (checks/context.py: only with checkpoint.init)
        assert cfg.checkpoint.init is not None
        load_checkpoint(
            cfg.checkpoint.init, model, verify=cfg.checkpoint.verify,
            vocab_size=cfg.model.vocab_size,
        )  # fmt: skip
    else:
        with torch.no_grad():
            for t, s in zip(model.parameters(), student.parameters(), strict=True):
                t.copy_(s)
    return EMAWeights(model, student, section.ema_decay) if section.weights == "ema" else None


def build_teachers(
    cfg: Config,
    student_groups: ParallelGroups,
    tokenizers: Sequence[Tokenizer],
    vocab: int,
    *,
    student: Any = None,
    excluded_ids: tuple[int, ...] = (),
    generates: bool = False,
) -> tuple[TeacherSet, ParallelGroups]:
    """Every teacher on its own groups, with its weights loaded (module docstring), and the
    first one's groups (the only one's, usually).

    ``tokenizers[j]``: teacher j's (:func:`teacher_tokenizers`); a teacher scoring in its own
    tokenizer (``cross_tokenizer``) restricts its distribution to that tokenizer's ids, the
    others to the student's ``vocab``; ``excluded_ids`` take no mass (a VLM's image
    placeholder). ``student``: the student's model (this rank's shard), for a teacher with its
    weights (``weights``). ``generates``: the method has the teacher write (TrOPD's prefixes).
    """
    built: list[Teacher] = []
    emas: list[EMAWeights] = []
    first_groups = None
    for j, (_, section) in enumerate(teacher_sections(cfg)):
        name = getattr(section, "name", "teacher")
        if section.weights == "live":  # the student itself, on its own groups
            groups = student_groups
        else:
            world = dist.get_world_size()
            groups = build_groups(layout_of(section.parallel, world), name=f"teacher:{name}")
        if first_groups is None:
            first_groups = groups
        teacher, ema = _teacher(
            cfg, j, section, groups, student_groups, tokenizers[j], vocab, student=student,
            excluded_ids=excluded_ids, generates=generates,
        )  # fmt: skip
        built.append(teacher)
        emas += [ema] if ema is not None else []
    assert first_groups is not None
    weights = [getattr(s, "weight", 1.0) for _, s in teacher_sections(cfg)]
    pads = [tok.pad_id for tok in tokenizers]
    teachers = TeacherSet(built, weights=weights, pad_ids=pads, routing=routing_of(cfg), emas=emas)
    return teachers, first_groups


def _teacher(
    cfg: Config,
    j: int,
    section: TeacherConfig,
    groups: ParallelGroups,
    student_groups: ParallelGroups,
    tokenizer: Tokenizer,
    vocab: int,
    *,
    student: Any,
    excluded_ids: tuple[int, ...],
    generates: bool,
) -> tuple[Teacher, EMAWeights | None]:
    """Teacher ``j`` of the config (:func:`build_teachers`) and, for an EMA of the student, the
    follower that updates it."""
    name, t = getattr(section, "name", "teacher"), cfg.trainer
    if section.server is not None and section.load is None:
        return _served(section, student_groups, name, vocab, reference=None), None
    ema = None
    if section.weights == "live":
        model = student
    else:
        torch.manual_seed(cfg.trainer.seed + 1 + j)
        model = _model(section, groups)
        same = groups.layout == student_groups.layout
        ema = _weights(cfg, section, model, student, same)
    own_vocab = tokenizer.vocab_size if section.cross_tokenizer else vocab
    head = TokenLogProbs(
        vocab_size=own_vocab, temperature=section.temperature, excluded_ids=excluded_ids
    )
    local = LocalTeacher(
        model, groups, student_groups, head=head, token_budget=t.scoring_token_budget,
        pack=t.pack_sequences, name=name,
        generator=_generator(section, model, groups, tokenizer, vocab) if generates else None,
    )  # fmt: skip
    if section.server is not None:  # the local weights are the self-test's reference only
        served = _served(section, student_groups, name, vocab, reference=local)
        del local, model  # freed: the served teacher scores from now on
        return served, None
    return local, ema
