"""Every random stream's seed, derived from ``trainer.seed`` in one place.

A step's randomness depends only on (seed, step, position in the global batch), never on the
data-parallel size, the rank that draws it or the micro-batch it falls in, so a run at another
layout, or resumed from a checkpoint, samples the same tokens (docs/DESIGN.md, invariant 7).

    step_seed(seed, step)                 the step's stream (TGPO's sampled teacher tokens)
    prompt_seeds(seed, step, first, n)    one per prompt, by its position in the global batch
    sample_seed(seed, k)                  sample k of a prompt; also micro-batch ``k`` of a pass
    replica_seed(seed, replica)           one per teacher data-parallel replica
    teacher_answer_seed(seed)             the teacher's own answer to a prompt (TrOPD prefixes)
    eval_seeds(seed, first, n)            held-out samples: the same at every evaluation
"""

from __future__ import annotations

# Two primes to combine a parent seed with a child index: distinct children of one parent never
# collide while the index stays below the prime, and neighbouring parents' children interleave
# rather than overlap. _ROWS bounds sample / micro-batch / step indices, _LANES rank and prompt
# positions.
_ROWS = 1_000_003
_LANES = 10_007
# Keeps the teacher's answer streams away from the student's samples of the same prompt.
_TEACHER_OFFSET = 1_000_000_007
# torch.Generator.manual_seed takes at most 64 bits; the streams stay non-negative below 2**63.
_SEED_MOD = 2**63


def step_seed(seed: int, step: int) -> int:
    """The stream of ``step`` (0-based, the steps taken so far), the same on every rank."""
    return seed * _ROWS + step


def prompt_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """One seed per prompt of this rank: ``first`` is the position of its first prompt in the
    step's global batch, so the seeds do not depend on the data-parallel size."""
    base = step_seed(seed, step) * _LANES + first
    return [base + j for j in range(count)]


def eval_seeds(seed: int, first: int, count: int) -> list[int]:
    """One seed per held-out prompt, the same at every evaluation of a run (so two evaluations
    differ by the weights only); a step index no run reaches keeps them apart from training."""
    return prompt_seeds(seed, _ROWS - 1, first, count)


def sample_seed(seed: int, k: int) -> int:
    """The stream of sample ``k`` of a prompt seeded ``seed`` (or of the micro-batch whose first
    row is ``k``, in a scoring pass that draws tokens)."""
    return (seed * _ROWS + k) % _SEED_MOD


def replica_seed(seed: int, replica: int) -> int:
    """One stream per model replica: the ranks of a replica draw alike, replicas differ."""
    return seed * _LANES + replica


def teacher_answer_seed(seed: int) -> int:
    """The stream of the teacher's own answer to a prompt seeded ``seed``."""
    return seed + _TEACHER_OFFSET
