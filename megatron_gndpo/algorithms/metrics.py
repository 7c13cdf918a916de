"""Global per-step statistics for logging: plain floats, the same on every rank of ``group``.

Shape legend: ``B`` = sequences on this rank, ``T`` = response length (right-padded),
``response_mask_BT`` = m. ``group`` is the DP × CP group (disjoint tokens per rank; never the
TP group). Each family of statistics costs one float64 ``all_reduce(SUM)``, plus one
``all_reduce(MAX)`` where it reports extremes (min is reduced as the max of the negation).
Every rank of the group must call each function, even one whose shard has no token; with no
valid token in the whole batch every statistic is 0.0, never NaN.
Sources: ALGORITHMS.md §6; GNDPO (arXiv 2606.09091).

The stability diagnostics at the end (docs/methods/gndpo.md, "Reading the stability
diagnostics") work on the run's per-step floats, not on tensors: whether the gradient clip
rescaled a step, the median of the previous steps' pre-clip norms and the steps far above it,
and the slope of log pre-clip norm on log score RMS. :class:`StabilityMonitor` keeps them as a
run goes (its state is checkpointed); the functions compute the same from a finished run.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gndpo.algorithms.scores import check_kl_clip, raw_scores
from megatron_gndpo.algorithms.stats import check_same_shape, global_sum, masked_values

# The keys every loss in ``losses.py`` puts in its info dict.
_POLICY_INFO_KEYS = ("ratio", "clipped", "dual_clipped")


def score_metrics(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_clip: float,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Mean/std/RMS of the clamped score c (before whitening) and the clamp fraction.

    score/mean, score/std (unbiased, the whitening's σ): over valid tokens of c = clamp(d, ±C);
    score/rms: sqrt(mean c²), the scale OPD's advantages (A = c) have; score/clamp_frac:
    fraction of valid tokens with |d| > C, d = lt − lo. Inputs ``[B, T]``.
    """
    check_kl_clip(kl_clip)
    with torch.no_grad():
        d_BT = raw_scores(teacher_logprobs, old_logprobs, response_mask).double()
        c_BT = d_BT.clamp(-kl_clip, kl_clip)
        mask_BT = response_mask.bool()
        local = torch.stack(
            [
                mask_BT.double().sum(),
                c_BT.sum(),
                (c_BT * c_BT).sum(),
                (mask_BT & (d_BT.abs() > kl_clip)).double().sum(),
            ]
        )
        n, sum_c, sum_c2, n_clamped = global_sum(local, group).tolist()
    mean, std = _mean_std(n, sum_c, sum_c2)
    return {
        "score/mean": mean,
        "score/std": std,
        "score/rms": _ratio(sum_c2, n) ** 0.5,
        "score/clamp_frac": _ratio(n_clamped, n),
    }


def sampled_eval_metrics(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """What the policy that trains does on held-out prompts, from its samples at temperature 1.

    eval/reverse_kl: ``sum m (ls - lt) / sum m`` over every sampled token of every rank, the
    single-sample (k1) estimate of the per-token KL(p_student || p_teacher) in nats: what
    on-policy distillation minimises. eval/sampled_accuracy: the mean verifiable reward of the
    samples (absent when ``rewards`` is None). Inputs ``[B, T]``, rewards ``[B]``.
    """
    with torch.no_grad():
        mask_BT = response_mask.bool()
        d_BT = (student_logprobs.double() - teacher_logprobs.double()).masked_fill(~mask_BT, 0.0)
        right = 0.0 if rewards is None else float(rewards.double().sum())
        local = torch.tensor(
            [float(mask_BT.sum()), float(d_BT.sum()), right, float(mask_BT.shape[0])],
            dtype=torch.float64,
        )
        tokens, kl_sum, correct, rows = global_sum(local, group).tolist()
    out = {"eval/reverse_kl": _ratio(kl_sum, tokens)}
    if rewards is not None:
        out["eval/sampled_accuracy"] = _ratio(correct, rows)
    return out


def teacher_metrics(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    routes: torch.Tensor,
    names: Sequence[str],
    *,
    kl_clip: float,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Per teacher ``NAME`` of ``names``: teacher/NAME/token_frac (its share of the step's
    valid tokens: a routing skew that starves a teacher shows here), and its rows'
    teacher/NAME/score_mean, /score_std, /clamp_frac (as :func:`score_metrics`).

    ``routes [B]``: each row's teacher index. One all-reduce for every teacher together.
    """
    check_kl_clip(kl_clip)
    with torch.no_grad():
        d_BT = raw_scores(teacher_logprobs, old_logprobs, response_mask).double()
        c_BT = d_BT.clamp(-kl_clip, kl_clip)
        mask_BT = response_mask.bool()
        rows = []
        for j in range(len(names)):
            mine = mask_BT & (routes.to(mask_BT.device) == j)[:, None]
            rows.append(
                torch.stack(
                    [
                        mine.double().sum(),
                        (c_BT * mine).sum(),
                        (c_BT * c_BT * mine).sum(),
                        (mine & (d_BT.abs() > kl_clip)).double().sum(),
                    ]
                )
            )
        totals = global_sum(torch.stack(rows), group).tolist()
    everything = sum(row[0] for row in totals)
    out: dict[str, float] = {}
    for name, (n, sum_c, sum_c2, n_clamped) in zip(names, totals, strict=True):
        mean, std = _mean_std(n, sum_c, sum_c2)
        out[f"teacher/{name}/token_frac"] = _ratio(n, everything)
        out[f"teacher/{name}/score_mean"] = mean
        out[f"teacher/{name}/score_std"] = std
        out[f"teacher/{name}/clamp_frac"] = _ratio(n_clamped, n)
    return out


def advantage_metrics(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """advantage/mean, /std (unbiased), /min, /max over valid tokens, and tokens/global.

    advantages, response_mask: ``[B, T]``.
    """
    check_same_shape(advantages=advantages, response_mask=response_mask)
    with torch.no_grad():
        a_BT = masked_values(advantages.detach().double(), response_mask)
        local = torch.stack([response_mask.double().sum(), a_BT.sum(), (a_BT * a_BT).sum()])
        n, sum_a, sum_a2 = global_sum(local, group).tolist()
        a_max, neg_a_min = _global_max(
            [masked_max(a_BT, response_mask), masked_max(-a_BT, response_mask)], group
        )
    mean, std = _mean_std(n, sum_a, sum_a2)
    has_tokens = n > 0
    return {
        "advantage/mean": mean,
        "advantage/std": std,
        "advantage/min": -neg_a_min if has_tokens else 0.0,
        "advantage/max": a_max if has_tokens else 0.0,
        "tokens/global": n,
    }


def policy_metrics(
    info: dict[str, torch.Tensor],
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """ratio/mean, ratio/max, clip/frac, clip/dual_frac over valid tokens.

    info: the dict a loss in ``losses.py`` returns (``ratio``, ``clipped``, ``dual_clipped``,
    each ``[B, T]``); response_mask: ``[B, T]``.
    """
    missing = [key for key in _POLICY_INFO_KEYS if key not in info]
    if missing:
        raise ValueError(
            f"policy info lacks {missing}; pass the info dict returned by a loss in losses.py"
        )
    check_same_shape(response_mask=response_mask, **{key: info[key] for key in _POLICY_INFO_KEYS})
    with torch.no_grad():
        ratio_BT = masked_values(info["ratio"].detach().double(), response_mask)
        clipped_BT = masked_values(info["clipped"].detach().double(), response_mask)
        dual_BT = masked_values(info["dual_clipped"].detach().double(), response_mask)
        local = torch.stack(
            [response_mask.double().sum(), ratio_BT.sum(), clipped_BT.sum(), dual_BT.sum()]
        )
        n, sum_ratio, n_clipped, n_dual = global_sum(local, group).tolist()
        (ratio_max,) = _global_max([masked_max(ratio_BT, response_mask)], group)
    return {
        "ratio/mean": _ratio(sum_ratio, n),
        "ratio/max": ratio_max if n > 0 else 0.0,
        "clip/frac": _ratio(n_clipped, n),
        "clip/dual_frac": _ratio(n_dual, n),
    }


def masked_max(values_BT: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` over valid positions as a float64 0-d tensor; −inf if there are none."""
    candidates = torch.where(response_mask.bool(), values_BT.double(), -torch.inf).flatten()
    floor = torch.full((1,), -torch.inf, dtype=torch.float64, device=candidates.device)
    return torch.cat([candidates, floor]).amax()


def _global_max(local: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[float]:
    # One MAX all-reduce for all extremes of a family (min is passed as max of the negation).
    stacked = torch.stack(local)
    if group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    return stacked.tolist()


def _mean_std(n: float, total: float, total_sq: float) -> tuple[float, float]:
    """Mean and unbiased std from float64 sums; 0.0 for what a count below 1 (or 2) can't give."""
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    if n < 2:
        return mean, 0.0
    var = max(total_sq - 2.0 * mean * total + mean * mean * n, 0.0) / (n - 1)
    return mean, var**0.5


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


# ---------------------------------------------------------------- stability diagnostics

# A spike is a step whose pre-clip gradient norm exceeds SPIKE_FACTOR times the median norm of
# the previous SPIKE_WINDOW steps. 3x: well above the step-to-step noise of natural runs (their
# max/median over 300 steps is 2-3, docs/demo/RESULTS.md); 20 steps: long enough that a burst
# of a few outlier steps does not move the median, short enough to follow a trend.
SPIKE_FACTOR = 3.0
SPIKE_WINDOW = 20
# With fewer previous steps than this there is no median to compare with: no spike is flagged.
SPIKE_MIN_HISTORY = 5
# Below this spread of log score RMS over a run (its variance) the slope is not determined.
_MIN_LOG_RMS_VARIANCE = 1e-12


def clip_active(grad_norm: float, clip: float) -> bool:
    """Whether the global-norm clip rescaled the step: the pre-clip norm exceeded ``clip``.

    megatron-core scales the gradients by ``clip / (norm + 1e-6)`` when that is below 1; an
    active clip makes the update ``clip · g / ‖g‖``, whatever the scale of ``g``.
    """
    return math.isfinite(grad_norm) and grad_norm > clip


def _usable(norm: float) -> bool:
    # Steps with no gradient (every sample scored alike) or a non-finite norm (skipped) say
    # nothing about the typical norm.
    return math.isfinite(norm) and norm > 0.0


def trailing_medians(
    grad_norms: Sequence[float],
    *,
    window: int = SPIKE_WINDOW,
    min_history: int = SPIKE_MIN_HISTORY,
) -> list[float | None]:
    """For each step, the median of the ``window`` previous usable norms (finite, > 0); None
    with fewer than ``min_history`` of them. The step itself is never part of its median."""
    history: collections.deque[float] = collections.deque(maxlen=window)
    out: list[float | None] = []
    for norm in grad_norms:
        out.append(statistics.median(history) if len(history) >= min_history else None)
        if _usable(norm):
            history.append(float(norm))
    return out


def spike_flags(
    grad_norms: Sequence[float],
    *,
    factor: float = SPIKE_FACTOR,
    window: int = SPIKE_WINDOW,
    min_history: int = SPIKE_MIN_HISTORY,
) -> list[bool]:
    """Per step: whether its norm exceeds ``factor`` times its :func:`trailing_medians` value."""
    medians = trailing_medians(grad_norms, window=window, min_history=min_history)
    return [_is_spike(n, m, factor) for n, m in zip(grad_norms, medians, strict=True)]


def _is_spike(norm: float, median: float | None, factor: float) -> bool:
    return median is not None and _usable(norm) and norm > factor * median


def log_log_slope(scales: Sequence[float], grad_norms: Sequence[float]) -> dict[str, float]:
    """Least-squares slope of log ``grad_norms`` on log ``scales`` (the score RMS per step).

    A norm proportional to the score's scale has slope 1 (OPD: A = c); a norm that does not
    follow it has slope ~0 (GNDPO divides by the batch's σ). Pairs where either value is not
    finite and positive are left out. Returns ``slope``, its standard error ``slope_se``, the
    pairs used ``n`` and ``log_scale_std`` (the spread the slope was fitted over); ``slope`` and
    ``slope_se`` are NaN with fewer than 3 pairs or no spread in the scales.
    """
    if len(scales) != len(grad_norms):
        raise ValueError(
            f"log_log_slope needs one scale per norm, got {len(scales)} and {len(grad_norms)}"
        )
    sums = [0.0] * 6
    for scale, norm in zip(scales, grad_norms, strict=True):
        sums = _add_pair(sums, scale, norm)
    return _slope_from_sums(sums)


def _add_pair(sums: list[float], scale: float, norm: float) -> list[float]:
    """[n, Σx, Σy, Σx², Σxy, Σy²] with x = log scale, y = log norm, when both are usable."""
    if not (_usable(scale) and _usable(norm)):
        return sums
    x, y = math.log(scale), math.log(norm)
    n, sx, sy, sxx, sxy, syy = sums
    return [n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y, syy + y * y]


def _slope_from_sums(sums: list[float]) -> dict[str, float]:
    n, sx, sy, sxx, sxy, syy = sums
    nan = {"slope": math.nan, "slope_se": math.nan, "n": n}
    if n < 1:
        return nan | {"log_scale_std": math.nan}
    var_x = max(sxx - sx * sx / n, 0.0)  # Σ(x − x̄)²
    out = nan | {"log_scale_std": (var_x / n) ** 0.5}
    if n < 3 or var_x / n < _MIN_LOG_RMS_VARIANCE:
        return out
    cov = sxy - sx * sy / n
    var_y = max(syy - sy * sy / n, 0.0)
    slope = cov / var_x
    residual = max(var_y - slope * cov, 0.0) / (n - 2)
    return out | {"slope": slope, "slope_se": (residual / var_x) ** 0.5}


class StabilityMonitor:
    """The stability diagnostics of a run, one step at a time (the trainer's, checkpointed).

        monitor = StabilityMonitor(clip=cfg.optimizer.clip_grad)
        metrics |= monitor.observe(metrics["grad_norm"], metrics["score/rms"])

    Per step: ``grad_norm/clip_active`` (0/1), ``grad_norm/spike`` (0/1) and, once there are
    enough previous steps, ``grad_norm/trailing_median``; over the run so far:
    ``grad_norm/clip_active_frac``, ``grad_norm/spikes`` and ``grad_norm/score_rms_slope`` (with
    ``_se``), so the last step's values are the run's. The same numbers as :func:`clip_active`,
    :func:`spike_flags` and :func:`log_log_slope` on the whole series.
    """

    def __init__(self, *, clip: float, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW,
                 min_history: int = SPIKE_MIN_HISTORY) -> None:  # fmt: skip
        self.clip, self.factor, self.min_history = clip, factor, min_history
        self._history: collections.deque[float] = collections.deque(maxlen=window)
        self._steps = 0  # steps with a finite norm
        self._clipped = 0
        self._spikes = 0
        self._sums = [0.0] * 6

    def observe(self, grad_norm: float, score_rms: float) -> dict[str, float]:
        """Take one step's pre-clip norm and score RMS; return its diagnostics."""
        out: dict[str, float] = {}
        median = (
            statistics.median(self._history) if len(self._history) >= self.min_history else None
        )
        spike = _is_spike(grad_norm, median, self.factor)
        if median is not None:
            out["grad_norm/trailing_median"] = median
        if math.isfinite(grad_norm):
            self._steps += 1
            self._clipped += clip_active(grad_norm, self.clip)
        self._spikes += spike
        if _usable(grad_norm):
            self._history.append(float(grad_norm))
        self._sums = _add_pair(self._sums, score_rms, grad_norm)
        fit = _slope_from_sums(self._sums)
        out |= {
            "grad_norm/clip_active": float(clip_active(grad_norm, self.clip)),
            "grad_norm/clip_active_frac": _ratio(self._clipped, self._steps),
            "grad_norm/spike": float(spike),
            "grad_norm/spikes": float(self._spikes),
        }
        if not math.isnan(fit["slope"]):
            out["grad_norm/score_rms_slope"] = fit["slope"]
            out["grad_norm/score_rms_slope_se"] = fit["slope_se"]
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, for the checkpoint (a resumed run continues the same series)."""
        return {
            "history": list(self._history), "steps": self._steps, "clipped": self._clipped,
            "spikes": self._spikes, "sums": list(self._sums),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history.clear()
        self._history.extend(float(x) for x in state["history"])
        self._steps, self._clipped = int(state["steps"]), int(state["clipped"])
        self._spikes, self._sums = int(state["spikes"]), [float(x) for x in state["sums"]]
