"""What a step's rollout looked like, as global metrics over the student's DP x CP group.

Legend: N = this rank's rows, S = padded sequence length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.rollout.base import Rollout


def rollout_metrics(
    rollout: Rollout,
    student_logprobs_NS: torch.Tensor,
    student_entropy_NS: torch.Tensor,
    rewards_N: torch.Tensor | None,
    group: Any,
    scored_N: torch.Tensor | None = None,
) -> tuple[dict[str, float], float]:
    """Response lengths, the sampler-vs-trainer log-prob gap on the student's own tokens, the
    student's entropy at the rollout weights, the finished share, the step's generated tokens
    and the mean reward; and the share of response tokens the teacher wrote (TrOPD's prefixes),
    for the method's own metrics. Two all-reduces over ``group``, every rank calls it.

    The gap, with lo the trainer's and ls the sampler's log-prob of a sampled token and
    log r = lo − ls: sampler_gap/mean_abs = mean |log r|; sampler_gap/kl = mean(ls − lo) and
    sampler_gap/k3 = mean(r − 1 − log r), the k1 and k3 estimates of KL(sampler ‖ trainer) from
    the sampler's own samples (k3 is never negative).

    ``scored_N [N]`` bool: the rows the student scored (the rows ``algorithm.filter`` kept;
    None: all). Everything but the gap and the entropy describes the whole ``rollout``; those
    two are over the scored rows' tokens, and left out when no rank scored a token."""
    lengths = rollout.response_lengths.double()
    mask = rollout.response_mask
    written = rollout.teacher_written
    scored = torch.ones_like(rollout.finished, dtype=torch.bool) if scored_N is None else scored_N
    scored = scored.bool().to(mask.device)[:, None]
    log_ratio = (student_logprobs_NS.double() - rollout.sampler_logprobs.double())[
        rollout.sampled_mask & scored
    ]  # log r = lo − ls on the student's own tokens
    k3 = log_ratio.exp() - 1.0 - log_ratio
    entropy = student_entropy_NS[mask & scored].double()
    teacher_tokens = 0.0 if written is None else float((written & mask).sum())
    reward_sum = rewards_N.double().sum() if rewards_N is not None else torch.tensor(0.0)
    stats = torch.tensor(
        [len(lengths), float(lengths.sum()), float(log_ratio.abs().sum()), log_ratio.numel(),
         float(reward_sum), float(rollout.finished.sum()), float(entropy.sum()),
         float(mask.sum()), teacher_tokens, float(-log_ratio.sum()), float(k3.sum()),
         entropy.numel()],
        dtype=torch.float64,
    )  # fmt: skip
    dist.all_reduce(stats, group=group)
    longest = lengths.max().reshape(1)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    (rows, total, gap_sum, tokens, reward_sum, finished, entropy_sum, response, written_sum,
     k1_sum, k3_sum, entropy_tokens) = stats.tolist()  # fmt: skip
    out = {
        "response_length/mean": total / rows,
        "response_length/max": float(longest),
        "finished/frac": finished / rows,
        "tokens/step": total,  # generated tokens of the whole step (all DP ranks)
    }
    if entropy_tokens > 0:  # some rank scored a token (a filter may have dropped every row)
        out |= {
            "sampler_gap/mean_abs": gap_sum / max(tokens, 1.0),
            "sampler_gap/kl": k1_sum / max(tokens, 1.0),
            "sampler_gap/k3": k3_sum / max(tokens, 1.0),
            # the student's entropy on its own samples, at the rollout weights
            "entropy/mean": entropy_sum / entropy_tokens,
        }
    if rewards_N is not None:
        out["reward/mean"] = reward_sum / rows
    return out, written_sum / max(response, 1.0)


class EndingWatch:
    """Says once when no sampled response has ended with a stop token for ``window`` steps in
    a row (``finished/frac`` 0: every one ran to the length limit), with ``advice``: why the
    run's method does not teach such a student to stop and what to do
    (``Method.never_stops_advice``).

    A sampled-token score (gndpo, opd, vopd) learns to stop only from the stop tokens the
    student samples; a student that never samples one is not taught to stop, however low its
    per-token KL goes (docs/methods/README.md, "A student that never stops"). A reward (grpo,
    reinforce_pp) cannot tell answers apart when none of them ends."""

    def __init__(self, limit: int, advice: str, window: int = 5) -> None:
        self.limit, self.advice, self.window = limit, advice, window
        self.unfinished = 0  # steps in a row with finished/frac 0
        self.said = False

    def observe(self, finished_frac: float) -> str | None:
        """The step's global ``finished/frac``; the warning, the first time it is due."""
        self.unfinished = self.unfinished + 1 if finished_frac == 0.0 else 0
        if self.said or self.unfinished < self.window:
            return None
        self.said = True
        return (
            f"no response of the last {self.window} steps ended with a stop token: every one "
            f"ran to rollout.max_response_length={self.limit}. {self.advice}, or check the "
            "stop token (data.tokenizer, rollout.stop_token_ids)"
        )
