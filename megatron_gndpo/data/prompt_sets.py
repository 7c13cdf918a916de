"""A run's prompts, encoded once at start-up: training (with its data-parallel sampler),
held-out and outlier prompts (``data.train``, ``data.eval``, ``data.outlier_train``).

A batch's prompts are *drawn* as the prompt set they come from and their indices (what a
checkpoint stores, and what the rollout ranks are asked for ahead of their step), and
*resolved* into the encoded prompts when they are sampled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_gndpo.config import Config, ConfigError
from megatron_gndpo.config.schema import teacher_sections
from megatron_gndpo.data.datasets import (
    EncodedPrompt,
    PromptExample,
    PromptImages,
    encode_prompts,
    load_prompts,
    prompt_fingerprint,
)
from megatron_gndpo.data.sampler import PromptSampler
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.errors import DataError

# A batch's prompts: their prompt set ("train" or "outlier") and indices (checkpointed).
Drawn = tuple[str, list[int]]


@dataclasses.dataclass
class PromptSets:
    """The run's encoded prompts and the samplers that draw this data-parallel rank's."""

    train: list[EncodedPrompt]
    sampler: PromptSampler
    eval: list[EncodedPrompt]
    skipped: int  # training prompts longer than rollout.max_prompt_length, left out
    outlier: list[EncodedPrompt] = dataclasses.field(default_factory=list)
    outlier_sampler: PromptSampler | None = None  # data.outlier_train's own sampler

    def draw(self, outlier: bool) -> Drawn:
        """The next batch's prompts of this rank: from the outlier set when ``outlier`` (and
        there is one), else from the training set (advances that set's sampler)."""
        if outlier and self.outlier_sampler is not None:
            return "outlier", self.outlier_sampler.next_step()
        return "train", self.sampler.next_step()

    def notices(self, cfg: Config) -> list[str]:
        """What to say once at the start: training prompts left out for length, and a training
        set smaller than a step's prompts (each step then draws some of them more than once)."""
        out, train, skipped = [], len(self.train), self.skipped
        if skipped:
            out.append(
                f"{skipped} of {skipped + train} training prompts are longer than "
                f"rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens and are left "
                "out (logged as prompts/skipped_too_long); raise rollout.max_prompt_length to "
                "train on them"
            )
        per_step = cfg.rollout.prompts_per_step
        if train < per_step:
            prompts = f"{train} usable prompt{'s' if train > 1 else ''}"
            out.append(
                f"data.train ({cfg.data.train}) has {prompts}, fewer than "
                f"rollout.prompts_per_step={per_step}: each step repeats them ({per_step} draws "
                f"from {prompts}); add prompts, or lower rollout.prompts_per_step"
            )
        return out

    def resolve(self, drawn: Drawn) -> list[EncodedPrompt]:
        source, indices = drawn
        prompts = self.outlier if source == "outlier" else self.train
        return [prompts[i] for i in indices]


def encoded_prompts(
    cfg: Config, spec: str, tokenizer: Tokenizer
) -> tuple[list[EncodedPrompt], int]:
    """Encoded prompts of ``spec`` and how many were too long; with images for a vision model."""
    d, limit = cfg.data, cfg.rollout.max_prompt_length
    key = d.teacher_key if cfg.teachers else None  # routing values matter with several only
    if cfg.model.vision is None:
        examples = load_prompts(
            spec, prompt_key=d.prompt_key, answer_key=d.answer_key, source_key=key,
            fields=context_fields(cfg),
        )  # fmt: skip
        return encode_prompts(examples, tokenizer, max_prompt_length=limit)
    from megatron_gndpo.data.images import (
        ImageLayout,
        encode_multimodal,
        load_multimodal_prompts,
    )

    layout = ImageLayout.of(cfg.model.vision)
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


def context_fields(cfg: Config) -> tuple[str, ...]:
    """The row fields the teachers' own prompts name (teacher.context), besides the prompt and
    its answer: kept with each prompt for the teacher, never shown to the student."""
    names: list[str] = []
    for _, t in teacher_sections(cfg):
        if t.context is not None:
            names += [n for n in t.context.fields() if n not in ("prompt", "answer", *names)]
    return tuple(names)


def _prompt_images(row: Any) -> PromptImages | None:
    """A multimodal row's tiles, their split into images and the original images."""
    if row.pixels is None:
        return None
    return PromptImages(row.pixels, row.tiles_per_image, tuple(row.example.images))


def _text_example(example: Any) -> PromptExample:
    """The prompt text and answer of a multimodal example (its images travel with the ids)."""
    return PromptExample(example.prompt, example.answer, example.index, source=example.source)


def _sampler(
    cfg: Config, prompts: list[EncodedPrompt], dp_rank: int, dp_size: int, source: str
) -> PromptSampler:
    return PromptSampler(
        len(prompts), prompts_per_step=cfg.rollout.prompts_per_step, dp_rank=dp_rank,
        dp_size=dp_size, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle,
        fingerprint=prompt_fingerprint(prompts), source=source,
    )  # fmt: skip


def load_prompt_sets(cfg: Config, tokenizer: Tokenizer, dp_rank: int, dp_size: int) -> PromptSets:
    """``data.train``, ``data.eval`` and ``data.outlier_train`` encoded, with the training and
    outlier samplers of data-parallel rank ``dp_rank`` of ``dp_size``."""
    d = cfg.data
    train, skipped = encoded_prompts(cfg, d.train, tokenizer)
    held_out = encoded_prompts(cfg, d.eval, tokenizer)[0] if d.eval is not None else []
    sets = PromptSets(
        train, _sampler(cfg, train, dp_rank, dp_size, f"data.train ({d.train})"), held_out,
        skipped,
    )  # fmt: skip
    if d.outlier_train is not None:
        sets.outlier = encoded_prompts(cfg, d.outlier_train, tokenizer)[0]
        source = f"data.outlier_train ({d.outlier_train})"
        sets.outlier_sampler = _sampler(cfg, sets.outlier, dp_rank, dp_size, source)
    return sets


def require_answers(cfg: Config, sets: PromptSets) -> None:
    """For an estimator that trains on the verifiable reward: every training (and outlier)
    prompt has its reference answer, else a DataError naming the first without one and the fix.
    Checked once the prompts are read, before any model is built."""
    d = cfg.data
    named = [
        ("data.train", d.train, sets.train),
        ("data.outlier_train", d.outlier_train, sets.outlier),
    ]
    for key, spec, prompts in named:
        missing = [p.example for p in prompts if p.example.answer is None]
        if not missing:
            continue
        first = f" (the first: {missing[0].where})" if missing[0].where else ""
        raise DataError(
            f"algorithm.estimator={cfg.algorithm.estimator} trains on the verifiable reward, but "
            f"{len(missing)} of the {len(prompts)} prompts of {key} ({spec}) have no answer"
            f"{first} under data.answer_key={d.answer_key!r}: add the answers, set "
            "data.answer_key to the field that holds them, or choose a distillation estimator "
            "(gndpo, opd)"
        )
