"""The held-out measures of a compression run, the same for the teacher and every student.

    evaluator = Evaluator(tokenizer, questions, teacher_answers, max_new_tokens=24,
                          token_budget=8192, samples=2, seed=1234)
    found = evaluator(net, groups, MegatronGenerator.for_model(net, groups, tokenizer),
                      teacher_scorer(teacher, groups, tokenizer.vocab_size, 8192))

- ``task``: the greedy answer is right (:func:`~.answers.task_score`: first sentence only);
- ``agreement``: the greedy answer equals the teacher's greedy answer (case, punctuation and
  spacing aside);
- ``greedy_eos`` / ``sampled_eos``: the share of answers that end with the stop token within
  the length limit; ``greedy_length`` / ``sampled_length``: their mean length in tokens (the
  stop token included);
- ``reverse_kl``: the per-token KL(student || teacher) on ``samples`` answers per question at
  temperature 1, the same seeds at every evaluation (the trainer's ``eval/reverse_kl``).

One stage (PP=1) of a model in this process: what ``compress`` and the benchmarks run.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_gndpo import seeding
from megatron_gndpo.compress.answers import Question, same_answer, task_score
from megatron_gndpo.rollout import greedy
from megatron_gndpo.rollout.base import SamplingParams

MEASURES = ("reverse_kl", "agreement", "task", "greedy_eos", "sampled_eos", "greedy_length",
            "sampled_length")  # fmt: skip

# Scores ``[B, S]`` teacher log-probs of rows (tokens, lengths): a loaded teacher's
# (:func:`teacher_scorer`) or the trainer's TeacherSet.
TeacherLogprobs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Answers:
    """Decoded responses (stop token left out), whether each ended with it, and lengths."""

    texts: list[str]
    finished: list[bool]
    lengths: list[int]  # response tokens, the stop token included when present


def rollout_answers(rollout: Any, tokenizer: Any) -> Answers:
    """The responses of a generator's rollout as :class:`Answers`."""
    texts, lengths = [], []
    for ids in rollout.responses():
        lengths.append(len(ids))
        texts.append(tokenizer.decode([t for t in ids if t != tokenizer.eos_id]))
    return Answers(texts, [bool(f) for f in rollout.finished.tolist()], lengths)


def sampling(max_new_tokens: int, eos_id: int, temperature: float, k: int = 1) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(eos_id,),
        samples_per_prompt=k,
    )  # fmt: skip


def greedy_answers(generator: Any, ids: Sequence[Sequence[int]], tokenizer: Any,
                   max_new_tokens: int) -> Answers:  # fmt: skip
    """The generator's model's greedy answer to each prompt (``ids``, chat-templated)."""
    answers = greedy.greedy_answers(
        generator, ids, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,),
        batch_size=max(len(ids), 1),
    )  # fmt: skip
    return Answers(
        [tokenizer.decode([t for t in a.response if t != tokenizer.eos_id]) for a in answers],
        [a.finished for a in answers], [len(a.response) for a in answers],
    )  # fmt: skip


def teacher_scorer(teacher: Any, groups: Any, vocab: int, budget: int) -> TeacherLogprobs:
    """A loaded teacher model's log-probs of given rows, ``budget`` tokens a forward."""
    from megatron_gndpo.engine.scoring import score_tokens
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    head = TokenLogProbs(vocab_size=vocab)

    def score(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = score_tokens(teacher, groups, tokens, lengths, head=head, token_budget=budget)
        assert out is not None  # one stage
        return out

    return score


def measured_teacher(c: Any, cfg: Any, checkpoint: Any) -> TeacherLogprobs:
    """What a trainer's student is measured against: the trainer's teacher (``c``, its built
    :class:`~megatron_gndpo.components.Components`), or, where that teacher scores at another
    temperature than 1 (``cfg.teacher.temperature``), the teacher itself loaded again from
    ``checkpoint``, so that every evaluation compares with the same distribution."""
    if cfg.teacher.temperature == 1.0:
        return lambda tokens, lengths: c.teacher.score_batch(tokens, lengths).logprobs
    from megatron_gndpo.checkpoint.load import load_model

    teacher = load_model(checkpoint, c.student_groups, frozen=True)
    return teacher_scorer(teacher, c.student_groups, c.tokenizer.vocab_size,
                          cfg.trainer.scoring_token_budget)  # fmt: skip


class Evaluator:
    """The held-out measures of the module docstring against the teacher's greedy ``teacher``
    answers to the same ``questions``."""

    def __init__(self, tokenizer: Any, questions: Sequence[Question], teacher: Answers, *,
                 max_new_tokens: int, token_budget: int, samples: int,
                 seed: int) -> None:  # fmt: skip
        self.tok, self.questions, self.teacher = tokenizer, list(questions), teacher
        self.max_new_tokens, self.token_budget, self.samples = max_new_tokens, token_budget, samples
        self.ids = [tokenizer.apply_chat_template(q.prompt) for q in self.questions]
        self.seeds = seeding.eval_seeds(seed, 0, len(self.ids))  # the same at every evaluation

    def __call__(self, net: Any, groups: Any, generator: Any,
                 teacher: TeacherLogprobs) -> dict[str, float]:  # fmt: skip
        found = self.greedy(generator)
        params = sampling(self.max_new_tokens, self.tok.eos_id, 1.0, self.samples)
        rollout = generator.generate(self.ids, params, seeds=self.seeds)
        sampled = rollout_answers(rollout, self.tok)
        return found | {
            "reverse_kl": self.reverse_kl(net, groups, rollout, teacher),
            "sampled_eos": statistics.fmean(map(float, sampled.finished)),
            "sampled_length": statistics.fmean(sampled.lengths),
        }

    def greedy(self, generator: Any) -> dict[str, float]:
        """The measures of the greedy answers: task, agreement, EOS rate and length."""
        answers = greedy_answers(generator, self.ids, self.tok, self.max_new_tokens)
        pairs = zip(answers.texts, self.teacher.texts, strict=True)
        return {
            "agreement": statistics.fmean(float(same_answer(a, b)) for a, b in pairs),
            "task": statistics.fmean(
                task_score(q.task, t, q.reference)
                for q, t in zip(self.questions, answers.texts, strict=True)
            ),
            "greedy_eos": statistics.fmean(map(float, answers.finished)),
            "greedy_length": statistics.fmean(answers.lengths),
        }

    def reverse_kl(self, net: Any, groups: Any, rollout: Any, teacher: TeacherLogprobs) -> float:
        """``Σ (log p_S - log p_T) / tokens`` over the sampled response tokens (the trainer's
        ``eval/reverse_kl``, algorithms/metrics.py)."""
        from megatron_gndpo.algorithms.metrics import sampled_eval_metrics
        from megatron_gndpo.engine.scoring import score_tokens
        from megatron_gndpo.models.logprob_head import TokenLogProbs

        student = score_tokens(
            net, groups, rollout.tokens, rollout.lengths,
            head=TokenLogProbs(vocab_size=self.tok.vocab_size), token_budget=self.token_budget,
        )  # fmt: skip
        assert student is not None  # one stage
        found = sampled_eval_metrics(
            teacher(rollout.tokens, rollout.lengths), student, rollout.response_mask, None
        )
        return float(found["eval/reverse_kl"])
