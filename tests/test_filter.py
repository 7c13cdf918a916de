"""Dynamic sampling (algorithm.filter, rollout/filters.py): which rows each filter drops, the
one-token stubs they become, what the estimators and the loss make of a stub, and the trainer:
a filtered step equals a step on a batch that never had those rows (DP=2), and a step filtered
away on every rank is skipped on every rank without the teacher."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_gndpo.algorithms.advantages import grpo_advantages
from megatron_gndpo.algorithms.aggregation import aggregate_loss
from megatron_gndpo.algorithms.stats import masked_whiten
from megatron_gndpo.rollout.base import Rollout
from megatron_gndpo.rollout.filters import drop_reasons, filter_metrics, hollow, keep_rows
from tests.harness import run_distributed

PAD = 0


def _rollout(*, routing: bool = False, images: bool = False) -> Rollout:
    """Six rows, two prompts of three samples; prompt lengths 2 or 3, width 8:

    row  response (after the prompt)   finished   content tokens
    0    5 6 7 EOS                      yes        3
    1    EOS                            yes        0 (empty)
    2    5 6 7 8 9 (cut)                no         5
    3    5 EOS                          yes        1
    4    5 6 7 8 9 (cut)                no         5
    5    5 6 EOS                        yes        2
    """
    eos = 1
    rows = [
        ([3, 4], [5, 6, 7, eos], True),
        ([3, 4], [eos], True),
        ([3, 4, 4], [5, 6, 7, 8, 9], False),
        ([9, 8], [5, eos], True),
        ([9, 8], [5, 6, 7, 8, 9], False),
        ([9, 8, 8], [5, 6, eos], True),
    ]
    width = max(len(p) + len(r) for p, r, _ in rows)
    tokens = torch.full((6, width), PAD, dtype=torch.long)
    logprobs = torch.zeros(6, width)
    for i, (prompt, response, _) in enumerate(rows):
        ids = prompt + response
        tokens[i, : len(ids)] = torch.tensor(ids)
        logprobs[i, len(prompt) : len(ids)] = -0.5 - 0.1 * i
    prompt_lengths = torch.tensor([len(p) for p, _, _ in rows])
    lengths = torch.tensor([len(p) + len(r) for p, r, _ in rows])
    written = torch.zeros(6, width, dtype=torch.bool)
    written[0, 2] = written[4, 2] = True  # a teacher-written first response token (TrOPD)
    return Rollout(
        tokens=tokens,
        prompt_lengths=prompt_lengths,
        lengths=lengths,
        sampler_logprobs=logprobs,
        prompt_index=torch.tensor([0, 0, 0, 1, 1, 1]),
        finished=torch.tensor([f for _, _, f in rows]),
        teacher_written=written,
        images=[torch.full((1, 3, 2, 2), float(i)) for i in range(6)] if images else None,
        routing=torch.full((6, width, 2, 2), 7, dtype=torch.int16) if routing else None,
    )


def _reasons(rewards: torch.Tensor | None = None, **on: Any) -> dict[str, torch.Tensor]:
    settings = {"drop_truncated": False, "min_response_tokens": 0,
                "drop_zero_variance_groups": False} | on  # fmt: skip
    return drop_reasons(_rollout(), rewards, 3, **settings)


def test_each_filter_drops_its_rows() -> None:
    assert _reasons() == {}
    assert _reasons(drop_truncated=True)["truncated"].tolist() == [0, 0, 1, 0, 1, 0]
    # the stop token is not content: min 1 drops the empty response, min 3 every shorter one
    assert _reasons(min_response_tokens=1)["short"].tolist() == [0, 1, 0, 0, 0, 0]
    assert _reasons(min_response_tokens=3)["short"].tolist() == [0, 1, 0, 1, 0, 1]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    dropped = _reasons(rewards, drop_zero_variance_groups=True)["zero_variance"]
    assert dropped.tolist() == [1, 1, 1, 0, 0, 0]  # the first group is uniform, the second not
    every = _reasons(rewards, drop_truncated=True, min_response_tokens=1,
                     drop_zero_variance_groups=True)  # fmt: skip
    assert list(every) == ["truncated", "short", "zero_variance"]
    assert keep_rows(every, 6).tolist() == [0, 0, 0, 1, 0, 1]
    assert keep_rows({}, 6).all()


def test_zero_variance_needs_rewards_and_groups() -> None:
    with pytest.raises(ValueError, match=r"data\.answer_key"):
        _reasons(None, drop_zero_variance_groups=True)
    with pytest.raises(ValueError, match=r"rollout\.samples_per_prompt >= 2"):
        drop_reasons(_rollout(), torch.zeros(6), 1, drop_truncated=False, min_response_tokens=0,
                     drop_zero_variance_groups=True)  # fmt: skip


def test_hollow_makes_dropped_rows_one_token_stubs_in_place() -> None:
    rollout = _rollout(routing=True, images=True)
    before = {k: v.clone() for k, v in vars(rollout).items() if isinstance(v, torch.Tensor)}
    keep = torch.tensor([True, False, True, False, False, True])
    out = hollow(rollout, keep, pad_id=PAD)
    drop, width = ~keep, rollout.tokens.shape[1]
    for name, value in before.items():  # the input is not modified
        assert torch.equal(getattr(rollout, name), value), name
    # kept rows: unchanged, rows in place, the width too
    for name in ("tokens", "prompt_lengths", "lengths", "sampler_logprobs", "prompt_index",
                 "finished", "teacher_written", "routing"):  # fmt: skip
        assert torch.equal(getattr(out, name)[keep], before[name][keep]), name
    assert out.tokens.shape == (6, width) and torch.equal(out.prompt_index, rollout.prompt_index)
    # stubs: one pad token, no response, nothing sampled, written, finished, imaged or routed
    assert (out.tokens[drop] == PAD).all()
    assert (out.prompt_lengths[drop] == 1).all() and (out.lengths[drop] == 1).all()
    assert (out.response_lengths[drop] == 0).all()
    assert not out.response_mask[drop].any() and not out.sampled_mask[drop].any()
    assert (out.sampler_logprobs[drop] == 0).all() and not out.finished[drop].any()
    assert out.teacher_written is not None and not out.teacher_written[drop].any()
    assert out.routing is not None and out.routing.dtype == torch.int16
    assert (out.routing[drop] == torch.tensor([0, 1], dtype=torch.int16)).all()
    assert out.images is not None and rollout.images is not None
    assert [x is None for x in out.images] == drop.tolist()
    assert all(out.images[i] is rollout.images[i] for i in range(6) if keep[i])
    assert torch.equal(out.response_mask[keep], rollout.response_mask[keep])
    assert hollow(rollout, torch.ones(6, dtype=torch.bool), pad_id=PAD) is rollout


def test_a_stub_adds_nothing_to_the_loss_or_its_counts() -> None:
    rollout = _rollout()
    keep = torch.tensor([True, False, True, False, False, True])
    mask = hollow(rollout, keep, pad_id=PAD).response_mask
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    deleted = rollout.response_mask[keep]
    for mode in ("token-mean", "seq-mean-token-mean"):
        total, count = aggregate_loss(loss, mask, mode)
        want_total, want_count = aggregate_loss(loss[keep], deleted, mode)
        assert int(count) == int(want_count) and float(total) == pytest.approx(float(want_total))
    # GNDPO's whitening over the kept rows' tokens: as if the dropped rows never existed
    score = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(
        masked_whiten(score, mask)[keep], masked_whiten(score[keep], deleted)
    )
    assert (masked_whiten(score, mask)[~keep] == 0).all()


def test_grpo_keeps_the_whole_groups_statistics() -> None:
    """Row filters: a kept row's GRPO advantage is the unfiltered one (group statistics from all
    sampled rows, dropped ones included); a dropped row's is 0. A zero-variance group's
    advantages are 0 anyway: dropping it changes only what the step spends and divides by."""
    rollout = _rollout()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    keep = keep_rows(drop_reasons(rollout, rewards, 3, drop_truncated=True, min_response_tokens=1,
                                  drop_zero_variance_groups=False), 6)  # fmt: skip
    assert keep.tolist() == [1, 0, 0, 1, 0, 1]
    full = grpo_advantages(rewards, rollout.response_mask, group_size=3)
    filtered = grpo_advantages(rewards, hollow(rollout, keep, pad_id=PAD).response_mask,
                               group_size=3)  # fmt: skip
    torch.testing.assert_close(filtered[keep], full[keep])
    assert (filtered[~keep] == 0).all() and (filtered[keep] != 0).any()
    uniform = grpo_advantages(torch.tensor([1.0] * 3 + [0.0] * 3), rollout.response_mask,
                              group_size=3)  # fmt: skip
    assert (uniform == 0).all()


def test_filter_metrics_count_rows_reasons_and_saved_tokens() -> None:
    rollout = _rollout()
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    reasons = drop_reasons(rollout, rewards, 3, drop_truncated=True, min_response_tokens=0,
                           drop_zero_variance_groups=True)  # fmt: skip
    keep = keep_rows(reasons, 6)  # rows 3 and 5
    m = filter_metrics(rollout, reasons, keep, None)
    assert m["filter/rows_dropped_frac"] == pytest.approx(4 / 6)
    assert m["filter/rows_dropped_frac/truncated"] == pytest.approx(2 / 6)
    assert m["filter/rows_dropped_frac/zero_variance"] == pytest.approx(3 / 6)
    assert "filter/rows_dropped_frac/short" not in m
    lengths = rollout.lengths.tolist()
    assert m["filter/teacher_tokens_saved"] == sum(lengths[i] - 1 for i in (0, 1, 2, 4))
    assert m["filter/tokens_kept"] == 2 + 3  # rows 3 and 5: "5 EOS", "5 6 EOS"


# ------------------------------------------------------------------------------ the trainer
# 16 of the 128 ids end a response: the tiny random student then stops after a few tokens or
# runs to max_response_length (12), so the length filters drop some rows and keep others.
STOPS = f"rollout.stop_token_ids=[{','.join(str(i) for i in range(40, 56))}]"
LENGTHS = ("algorithm.filter.drop_truncated=true", "algorithm.filter.min_response_tokens=3")
GROUPS = ("algorithm.estimator=grpo", "algorithm.filter.drop_zero_variance_groups=true")


def _watched(trainer: Any, rewards: list[list[float]] | None = None) -> dict[str, Any]:
    """Record what the trainer's stages see; ``rewards``: this rank's rewards, step by step."""
    seen: dict[str, Any] = {"teacher": [], "student": 0, "rollouts": [], "kept": [], "adv": []}
    teacher, student = trainer.c.teacher.score_batch, trainer.c.scorer.student
    sample, filtered, targets = trainer._sample, trainer._filter, trainer._targets

    def teacher_scores(tokens, lengths, request=None, **kw):  # type: ignore[no-untyped-def]
        seen["teacher"].append(lengths.clone())
        return teacher(tokens, lengths, request, **kw)

    def student_scores(*args):  # type: ignore[no-untyped-def]
        seen["student"] += 1
        return student(*args)

    def sampled(prompts):  # type: ignore[no-untyped-def]
        seen["rollouts"].append(sample(prompts))
        return seen["rollouts"][-1]

    def filtering(rollout, rewards):  # type: ignore[no-untyped-def]
        out = filtered(rollout, rewards)
        seen["kept"].append(out[1])
        return out

    def targeted(rollout, *args):  # type: ignore[no-untyped-def]
        out = targets(rollout, *args)
        seen["adv"].append((out[0].advantages, rollout.response_mask, args[1]))
        return out

    trainer.c.teacher.score_batch = teacher_scores
    trainer.c.scorer.student, trainer._sample = student_scores, sampled
    trainer._filter, trainer._targets = filtering, targeted
    if rewards is not None:
        given = iter(rewards)
        trainer._rewards = lambda rollout, prompts: torch.tensor(next(given))
    return seen


def _deleted(rollout: Rollout, keep: torch.Tensor) -> Rollout:
    """``rollout`` without the rows outside ``keep``."""
    return Rollout(
        tokens=rollout.tokens[keep], prompt_lengths=rollout.prompt_lengths[keep],
        lengths=rollout.lengths[keep], sampler_logprobs=rollout.sampler_logprobs[keep],
        prompt_index=rollout.prompt_index[keep], finished=rollout.finished[keep],
    )  # fmt: skip


def _filtered_steps(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.trainers import reset_megatron, snapshot, tiny_trainer

    out: dict[str, Any] = {}

    def run(name: str, *overrides: str, rewards: Any = None, steps: int = 1, sample: Any = None):  # type: ignore[no-untyped-def]
        trainer = tiny_trainer(f"{root}/{name}", STOPS, *overrides)
        seen = _watched(trainer, rewards)
        if sample is not None:
            trainer._sample = lambda prompts: sample
        weights, metrics = [snapshot(trainer.c.student)], []
        for _ in range(steps):
            metrics.append(trainer.step())
            weights.append(snapshot(trainer.c.student))
        out[name] = seen | {"metrics": metrics, "weights": weights}
        trainer.c.logger.close()
        reset_megatron()
        return out[name]

    # gndpo: the length filters, then a batch that never had the rows they dropped
    filtered = run("lengths", *LENGTHS)
    keep = filtered["kept"][0]
    run("deleted", sample=_deleted(filtered["rollouts"][0], keep))
    # grpo: rank 0's groups all uniform, rank 1 one of two; then every group on every rank
    uniform, mixed = [0.0] * 4, [1.0, 0.0, 1.0, 1.0]
    run("groups", *GROUPS, rewards=[uniform if rank == 0 else mixed])
    run("all", *GROUPS, rewards=[uniform, mixed], steps=2)
    # two optimizer steps, the second's rows all dropped: one step, as on the first half alone
    halves = [1.0, 0.0, 1.0, 1.0]
    run("halves", *GROUPS, "trainer.optimizer_steps_per_rollout=2", rewards=[halves])
    first = torch.tensor([True, True, False, False])
    run("first half", "algorithm.estimator=grpo", rewards=[halves[:2]],
        sample=_deleted(filtered["rollouts"][0], first))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("filter")
    return run_distributed(_filtered_steps, 2, args=(str(root),), timeout_s=500)


# Weights after one Adam step from two batches that differ only in shape (stub rows vs rows
# deleted): Adam moves a weight by lr * g / (|g| + eps), so where g is near eps (1e-8) the step
# is proportional to g, and g's float rounding (another summation order) shows. Measured with
# torch 2.14.1 on CPU: 1.5e-7 on an fc1 weight whose step was 7.6e-4 (|g| ~ 3 eps), and 0.7% of
# a 1.2e-5 step. The bound: 1/1000 of the largest step, lr = 1e-3.
ADAM_ATOL = 1e-6


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], p) for n, p in b.items())


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_filtered_step_is_a_step_without_those_rows(steps: list[dict[str, Any]]) -> None:
    """DP=2: the length filters drop rows on both ranks; the teacher scores them as one-token
    stubs; the loss, gradient, token count, statistics and updated weights are those of the
    same batch with the rows deleted."""
    kept = [r["lengths"]["kept"][0] for r in steps]
    sampled = [r["lengths"]["rollouts"][0] for r in steps]
    tokens = sum(int(x.response_lengths[k].sum()) for x, k in zip(sampled, kept, strict=True))
    saved = sum(int((x.lengths[~k] - 1).sum()) for x, k in zip(sampled, kept, strict=True))
    rows = sum(len(k) for k in kept)
    assert 0 < sum(int(k.sum()) for k in kept) < rows, "the filters must drop some rows, not all"
    for r, keep, rollout in zip(steps, kept, sampled, strict=True):
        f, d = r["lengths"], r["deleted"]
        (lengths,) = f["teacher"]  # one call: the dropped rows as stubs, the others whole
        assert (lengths[~keep] == 1).all() and torch.equal(lengths[keep], rollout.lengths[keep])
        advantages, mask, _ = f["adv"][0]
        assert not mask[~keep].any() and (advantages[~keep] == 0).all()
        assert _same(f["weights"][0], d["weights"][0])
        for name, p in d["weights"][1].items():
            torch.testing.assert_close(f["weights"][1][name], p, rtol=1e-5, atol=ADAM_ATOL)
        m, want = f["metrics"][0], d["metrics"][0]
        assert m["tokens/global"] == want["tokens/global"] == m["filter/tokens_kept"] == tokens
        for key in ("loss", "grad_norm", "score/mean", "score/std", "advantage/mean",
                    "advantage/std", "entropy/mean", "sampler_gap/mean_abs"):  # fmt: skip
            assert m[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert m["filter/rows_dropped_frac"] == pytest.approx(
            1 - int(sum(k.sum() for k in kept)) / rows
        )
        assert m["filter/teacher_tokens_saved"] == saved
        assert (
            m["filter/rows_dropped_frac/truncated"] > 0 and m["filter/rows_dropped_frac/short"] > 0
        )
        # the rollout's metrics describe what was sampled, before the filter
        assert m["tokens/step"] == sum(int(x.response_lengths.sum()) for x in sampled)
        assert m["skipped"] == 0.0


@pytest.mark.distributed
@pytest.mark.megatron
def test_zero_variance_groups_are_dropped_and_the_others_keep_their_advantages(
    steps: list[dict[str, Any]],
) -> None:
    """grpo, DP=2: every group of rank 0 and one of rank 1 have uniform rewards. Rank 0 keeps no
    row and still takes part; rank 1's other group keeps its GRPO advantages."""
    from megatron_gndpo.algorithms.advantages import grpo_advantages

    zero, one = (r["groups"] for r in steps)
    assert zero["kept"][0].tolist() == [False] * 4 and one["kept"][0].tolist() == [1, 1, 0, 0]
    assert (zero["teacher"][0] == 1).all()  # rank 0 scores four stubs
    for r in (zero, one):
        advantages, mask, rewards = r["adv"][0]
        keep = r["kept"][0]
        sampled_mask = r["rollouts"][0].response_mask
        want = grpo_advantages(rewards, sampled_mask, group_size=2)
        torch.testing.assert_close(advantages[keep], want[keep])
        assert (advantages[~keep] == 0).all() and not mask[~keep].any()
        m = r["metrics"][0]
        assert m["skipped"] == 0.0 and m["grad_norm"] > 0
        assert m["filter/rows_dropped_frac"] == m["filter/rows_dropped_frac/zero_variance"] == 0.75
        assert m["tokens/global"] == int(one["rollouts"][0].response_lengths[:2].sum())
        assert not _same(r["weights"][0], r["weights"][1])


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_step_filtered_away_everywhere_is_skipped_on_every_rank(
    steps: list[dict[str, Any]],
) -> None:
    """Every group uniform on both ranks: neither model scores the step, the weights stay, the
    rollout is still described; the next step trains as usual."""
    for r in steps:
        a = r["all"]
        skipped, after = a["metrics"]
        assert skipped["skipped"] == 1.0 and skipped["skipped/filtered_all"] == 1.0
        assert skipped["filter/rows_dropped_frac"] == 1.0 and skipped["filter/tokens_kept"] == 0
        assert not any(k.startswith(("score/", "advantage/", "entropy/", "sampler_gap/"))
                       for k in skipped)  # fmt: skip
        assert skipped["tokens/step"] > 0 and "grad_norm" not in skipped
        assert len(a["teacher"]) == 1 and a["student"] == 1  # the second step's passes only
        assert _same(a["weights"][0], a["weights"][1])
        assert after["skipped"] == 0.0 and after["grad_norm"] > 0
        assert not _same(a["weights"][1], a["weights"][2])


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_mini_batch_filtered_away_takes_no_optimizer_step(steps: list[dict[str, Any]]) -> None:
    """Two optimizer steps a rollout, the second mini-batch's rows dropped on both ranks: no
    second step (Adam would move the weights on zero gradients); the result is the one step on
    the first half alone."""
    for r in steps:
        halves, first = r["halves"], r["first half"]
        m, want = halves["metrics"][0], first["metrics"][0]
        assert m["skipped/empty_minibatches"] == 1.0 and m["skipped"] == 0.0
        assert m["tokens/global"] == want["tokens/global"]
        for key in ("loss", "grad_norm"):
            assert m[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        for name, p in first["weights"][1].items():
            torch.testing.assert_close(halves["weights"][1][name], p, rtol=1e-5, atol=ADAM_ATOL)
