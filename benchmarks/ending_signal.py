"""Where each distillation signal pushes the student's stop token, on its own samples.

    python benchmarks/ending_signal.py --teacher runs/smollm2/teacher \\
        --student runs/smollm2/student_10l --max-new-tokens 48

The student answers the held-out questions of ``benchmarks/real_distill.py`` (2 samples each at
temperature 1, the same seeds as its evaluation); the teacher and the student score every
position of those answers over the full vocabulary. Measured, over the response positions:

- where the teacher would end: the share of answers with a position where the teacher's
  ``p_T(<|im_end|>)`` is above 0.5, and the student's ``p_S(<|im_end|>)`` at those positions;
- the stop tokens the student sampled, the teacher's ``p_T`` and the score ``lt - lo`` there;
- the push of each signal on the stop token's logit ``z``, summed over the positions (positive:
  training raises the student's chance to end), by :func:`pushes`.

The teacher's own samples are measured the same way for contrast (``--who teacher``). One CPU
process, TP=1: the full-vocabulary log-probs of both models are held for one answer batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

THRESHOLD = 0.5  # "the teacher would end here": p_T(stop) above this
# benchmarks/real_distill.py's held-out questions, samples per question and seed
EVAL_DATA = ROOT / "examples" / "data" / "short_answers_eval.jsonl"
EVAL_SAMPLES = 2
SEED = 1234


def sampled_score(lt: torch.Tensor, ls: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: the score ``lt - ls`` of each sampled token (unclamped)."""
    picked = tokens[..., None]
    return lt.gather(-1, picked)[..., 0] - ls.gather(-1, picked)[..., 0]


def pushes(lt: torch.Tensor, ls: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
           stop: int, *, clip: float = 5.0, top_k: int = 20) -> dict[str, float]:  # fmt: skip
    """The push of each signal on the stop token's logit, summed over the ``mask`` positions.

    ``lt``, ``ls`` ``[B, S, V]``: the teacher's and the student's log-probs of the token at
    ``t`` given ``tokens[:, :t]`` (row ``t`` predicts ``tokens[:, t]``); ``mask`` ``[B, S]``: the
    positions that count. A push is minus the gradient of the signal's loss with respect to the
    stop token's logit ``z`` of the student (one step of descent raises ``z`` when positive):

    - ``reverse_kl_exact``: the full-vocabulary ``KL(p_S || p_T)`` at each position, its
      expectation over the student's samples: ``-p_S(stop) (log p_S(stop) - log p_T(stop) - KL)``;
    - ``sampled_score``: the sampled-token policy gradient ``A · log p_S(y)`` with the score
      ``lt - ls`` of the sampled token ``y``, clamped to ``±clip`` around the batch mean (GNDPO's
      baseline, before its division by the std): ``A (1[y = stop] - p_S(stop))``, split into the
      part the sampled stop tokens give and the part every other token gives;
    - ``sampled_score_to_go``: the same with each token's score-to-go (its own score and every
      later token's in the answer, less the batch mean): the sequence-level reverse KL's
      estimate, which charges the decision not to stop with what the continuation costs;
    - ``forward_kl_topk``: ``Σ_{v ∈ top-k of p_T} p_T(v) (log p_T(v) - log p_S(v))`` at every
      position (a dense forward KL on the student's samples, TrOPD's outlier term):
      ``p_T(stop) 1[stop in top-k] - p_S(stop) Σ_{top-k} p_T``.

    The exact reverse KL's and the forward KL's pushes are also given at the positions where
    the teacher would end (``p_T(stop) > THRESHOLD``) and, for the reverse KL, elsewhere, and
    with ``seq-mean-token-mean``'s weights (each answer alike, not each token).
    """
    p_s = ls[..., stop].exp()
    kl = (ls.exp() * (ls - lt)).sum(-1)
    reverse = -p_s * (ls[..., stop] - lt[..., stop] - kl)
    score = sampled_score(lt, ls, tokens)
    advantage = (score - score[mask].mean()).clamp(-clip, clip)
    sampled_stop = (tokens == stop).float()
    top_p, top_ids = lt.exp().topk(top_k, dim=-1)
    stop_in_top = (top_ids == stop).any(-1).float()
    forward = lt[..., stop].exp() * stop_in_top - p_s * top_p.sum(-1)
    m = mask.float()
    ends = m * (lt[..., stop].exp() > THRESHOLD).float()  # where the teacher would end
    # the sequence-level reverse KL's sampled estimate: each token's score-to-go (its own and
    # every later token's), so continuing is charged what the continuation costs
    to_go = (score * m).flip(-1).cumsum(-1).flip(-1)
    to_go_advantage = to_go - to_go[mask].mean()
    # seq-mean-token-mean's weights: each answer alike, scaled to the token-mean's total weight
    answers = m.sum(-1, keepdim=True)
    per_answer = m / answers.clamp(min=1) * (m.sum() / answers.gt(0).sum())
    return {
        "reverse_kl_exact": float((reverse * m).sum()),
        "reverse_kl_exact_where_teacher_ends": float((reverse * ends).sum()),
        "reverse_kl_exact_elsewhere": float((reverse * (m - ends)).sum()),
        "reverse_kl_exact_seq_mean": float((reverse * per_answer).sum()),
        "sampled_score": float((advantage * (sampled_stop - p_s) * m).sum()),
        "sampled_score_from_stop_tokens": float((advantage * (1 - p_s) * sampled_stop * m).sum()),
        "sampled_score_from_other_tokens": float((-advantage * p_s * (1 - sampled_stop) * m).sum()),
        "sampled_score_to_go": float((to_go_advantage * (sampled_stop - p_s) * m).sum()),
        "forward_kl_topk": float((forward * m).sum()),
        "forward_kl_topk_where_teacher_ends": float((forward * ends).sum()),
    }


def ending_measures(lt: torch.Tensor, ls: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                    stop: int) -> dict[str, Any]:  # fmt: skip
    """Where the teacher would end on these answers, and what the student does there."""
    p_t, p_s = lt[..., stop].exp(), ls[..., stop].exp()
    wants = mask & (p_t > THRESHOLD)
    sampled = mask & (tokens == stop)
    score = sampled_score(lt, ls, tokens)

    def mean(x: torch.Tensor, where: torch.Tensor) -> float | None:
        return float(x[where].mean()) if where.any() else None

    return {
        "positions": int(mask.sum()),
        "score_mean": mean(score, mask),
        "p_teacher_stop_mean": mean(p_t, mask),
        "p_student_stop_mean": mean(p_s, mask),
        "answers_teacher_would_end": float((wants.any(1) | ~mask.any(1)).float().mean()),
        "p_student_stop_where_teacher_would_end": mean(p_s, wants),
        "sampled_stops": int(sampled.sum()),
        "p_teacher_stop_at_sampled_stops": mean(p_t, sampled),
        "score_at_sampled_stops": mean(score, sampled),
    }


def full_logprobs(net: Any, tokens: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """``[B, S, V]`` log-probs of the token after each position (one stage, TP=1)."""
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        return torch.cat([
            net(tokens[i : i + rows], positions[i : i + rows], None).float().log_softmax(-1)
            for i in range(0, tokens.shape[0], rows)
        ])  # fmt: skip


def measure(teacher: Any, student: Any, rollout: Any, stop: int) -> dict[str, Any]:
    """:func:`ending_measures` and :func:`pushes` on ``rollout``'s response tokens."""
    lt, ls = full_logprobs(teacher, rollout.tokens), full_logprobs(student, rollout.tokens)
    mask = rollout.response_mask[:, 1:]  # position t's log-probs predict token t + 1
    tokens = rollout.tokens[:, 1:]
    lt, ls = lt[:, :-1], ls[:, :-1]
    lengths = (rollout.lengths - rollout.prompt_lengths).float()
    return {
        "finished": float(rollout.finished.float().mean()),
        "length": float(lengths.mean()),
        **ending_measures(lt, ls, tokens, mask, stop),
        "push": pushes(lt, ls, tokens, mask, stop),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: --teacher")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--who", default="student,teacher", help="whose samples: student,teacher")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    samplers = [w for w in args.who.split(",") if w]
    if not samplers or set(samplers) - {"student", "teacher"}:
        parser.error(f"--who takes student and/or teacher, got {args.who!r}")

    from megatron_gndpo import seeding
    from megatron_gndpo.checkpoint.load import load_model
    from megatron_gndpo.compat import notices
    from megatron_gndpo.data.datasets import load_prompts
    from megatron_gndpo.data.tokenizer import load_tokenizer
    from megatron_gndpo.parallel.world import one_process_world
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    notices.quiet_known_notices()
    tokenizer = load_tokenizer(str(args.tokenizer or args.teacher))
    ids = [tokenizer.apply_chat_template(q.prompt) for q in load_prompts(str(EVAL_DATA))]
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0,
        stop_token_ids=(tokenizer.eos_id,), samples_per_prompt=EVAL_SAMPLES,
    )  # fmt: skip
    found: dict[str, Any] = {"student": str(args.student), "max_new_tokens": args.max_new_tokens}
    with one_process_world(seed=SEED, alone="the benchmark") as groups:
        teacher = load_model(args.teacher, groups, frozen=True)
        student = load_model(args.student, groups, frozen=True)
        for who in samplers:
            net = student if who == "student" else teacher
            rollout = MegatronGenerator.for_model(net, groups, tokenizer).generate(
                ids, params, seeds=seeding.eval_seeds(SEED, 0, len(ids))
            )
            found[f"{who}_samples"] = measure(teacher, student, rollout, tokenizer.eos_id)
    text = json.dumps(found, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
