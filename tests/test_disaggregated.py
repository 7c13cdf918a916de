"""Rollout ranks apart from the trainer (``rollout.disaggregate``, issue 19 parts 1-2).

The placement arithmetic and the config rules, then real runs of the tiny example on gloo: the
last ranks of the job are rollout ranks in a torch world of their own (parallel/bridge.py),
the others train. At staleness 0 a run equals the colocated run exactly; at staleness 1 each
batch is sampled with the weights of the step before the previous one (checked against
snapshots of the weights) and the importance weights equal a reference computed here; a run
resumed from a checkpoint taken while two batches were in flight continues exactly; a corrupted
rollout copy stops the run through the post-sync probe check.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.parallel.bridge import Placement
from tests.harness import run_distributed
from tests.trainers import TINY, snapshot

# Metrics that differ between placements by design (clocks, the pipeline's own numbers).
_TIMING = ("time/", "tokens/s", "async/", "weight_sync/", "mfu")


# ---------------------------------------------------------------------------------------------
# Placement and rules


def test_placement_splits_the_job_and_pairs_the_replicas() -> None:
    p = Placement(world_size=6, rollout_ranks=4, rollout_tp=2)
    assert p.trainer_ranks == 2 and p.rollout_replicas == 2
    assert [p.is_rollout(r) for r in range(6)] == [False, False, True, True, True, True]
    assert [p.role_rank(r) for r in range(6)] == [0, 1, 0, 1, 2, 3]
    assert p.replica_ranks(0) == [2, 3] and p.replica_ranks(1) == [4, 5]
    assert [p.serving(d) for d in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="trainer needs a rank"):
        Placement(world_size=2, rollout_ranks=2)
    with pytest.raises(ValueError, match="must divide"):
        Placement(world_size=4, rollout_ranks=3, rollout_tp=2)


def _problems(world: int, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(TINY, list(overrides)), world)
    return str(err.value)


def test_rules_name_the_problem_and_the_fix() -> None:
    base = "rollout.disaggregate.ranks"
    assert "leaves no rank" in _problems(2, f"{base}=2")
    assert "must divide" in _problems(4, f"{base}=3", "rollout.disaggregate.tensor_parallel=2")
    assert "needs rollout ranks apart" in _problems(2, "rollout.disaggregate.staleness=1")
    assert "mixture-of-experts" in _problems(
        3, f"{base}=1", "model.num_experts=4", "model.moe_router_topk=2"
    )
    assert "teacher-written prefixes" in _problems(
        3,
        f"{base}=1",
        "algorithm.estimator=tropd",
        "algorithm.tropd.prefix_share_start=0.5",
    )
    # the trainer's layouts cover the other ranks: TP=2 fits 2 trainers of 3 ranks ...
    validate(load_config(TINY, [f"{base}=1", "parallel.tensor_parallel=2"]), 3)
    # ... and the rollout copy's own TP must fit the model (4 heads)
    assert "rollout.disaggregate" in _problems(
        9, f"{base}=8", "rollout.disaggregate.tensor_parallel=8"
    )


# ---------------------------------------------------------------------------------------------
# Runs on gloo


def _config(run_dir: str, overrides: list[str], world: int) -> Any:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    return validate(load_config(TINY, [f"logging.run_dir={run_dir}", *overrides]), world)


def _train(rank: int, world: int, run_dir: str, overrides: list[str], rollout: int) -> Any:
    """A whole run: the history and the final weights on trainer ranks, None on rollout ranks."""
    cfg = _config(run_dir, overrides, world)
    if rank >= world - rollout:
        from megatron_gndpo.engine.probe import model_probe
        from megatron_gndpo.rollout.remote import RolloutWorker

        RolloutWorker(cfg, probe=model_probe).run()
        return None
    from megatron_gndpo.trainer import Trainer

    trainer = Trainer(cfg)
    history = trainer.train()
    return history, snapshot(trainer.c.student)


def _same_run(a: Any, b: Any, steps: range | None = None) -> None:
    history_a, weights_a = a
    history_b, weights_b = b
    steps = steps or range(len(history_a))
    for i in steps:
        for key, value in history_a[i].items():
            if key.startswith(_TIMING):
                continue
            theirs = history_b[i - steps.start if len(history_b) < len(history_a) else i][key]
            assert value == theirs or (math.isnan(value) and math.isnan(theirs)), (i, key)
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name


def test_staleness_0_equals_the_colocated_run(tmp_path: Path) -> None:
    steps = ["trainer.steps=3"]
    colocated = run_distributed(_train, 2, (str(tmp_path / "c"), steps, 0), timeout_s=300)
    apart = ["rollout.disaggregate.ranks=1", *steps]
    one = run_distributed(
        _train, 3, (str(tmp_path / "a"), apart, 1), timeout_s=300, rollout_ranks=1
    )
    for r in range(2):  # 1 rollout rank sampling for both trainer replicas
        _same_run(colocated[r], one[r])
    assert one[2] is None
    assert [h["async/staleness"] for h in one[0][0]] == [0.0, 0.0, 0.0]
    assert all(h["weight_sync/check_logprob_diff"] == 0.0 for h in one[0][0][:2])
    two = ["rollout.disaggregate.ranks=2", *steps]
    both = run_distributed(_train, 4, (str(tmp_path / "b"), two, 2), timeout_s=300, rollout_ranks=2)
    for r in range(2):  # 2 rollout replicas, one per trainer replica
        _same_run(colocated[r], both[r])


def _stepwise(rank: int, world: int, run_dir: str, overrides: list[str]) -> Any:
    """One-step-off, step by step: each batch's rollout, the trainer's old log-probs and
    importance weights, and the weights after every step; then each batch's sampler log-probs
    and old log-probs are recomputed here from those snapshots."""
    cfg = _config(run_dir, overrides, world)
    if rank == world - 1:
        from megatron_gndpo.engine.probe import model_probe
        from megatron_gndpo.rollout.remote import RolloutWorker

        RolloutWorker(cfg, probe=model_probe).run()
        return None
    from megatron_gndpo.engine.scoring import ScoreRequest
    from megatron_gndpo.trainer import Trainer

    trainer = Trainer(cfg)
    seen: dict[int, dict[str, Any]] = {}
    assert trainer.pipeline is not None
    pipeline = trainer.pipeline
    take, correction = pipeline.take, trainer._correction

    # Recorders around the real methods (no stand-in): each calls through and keeps what it saw.
    def recording_take(batch: int) -> Any:
        prompts, rollout, metrics = take(batch)
        seen[batch] = {"rollout": rollout, "staleness": metrics["async/staleness"]}
        return prompts, rollout, metrics

    def recording_correction(rollout: Any, old_lp: torch.Tensor) -> Any:
        weights, metrics = correction(rollout, old_lp)
        seen[trainer.step_count + 1] |= {"old": old_lp.clone(), "weights": weights.clone()}
        return weights, metrics

    pipeline.take = recording_take  # type: ignore[method-assign]
    trainer._correction = recording_correction  # type: ignore[method-assign]
    weights = [snapshot(trainer.c.student)]
    history = []
    for _ in range(cfg.trainer.steps):
        history.append(trainer.step())
        weights.append(snapshot(trainer.c.student))
    pipeline.stop()
    params = dict(trainer.c.student.named_parameters())

    def logprobs(version: int, rollout: Any) -> torch.Tensor:
        with torch.no_grad():
            for name, tensor in weights[version].items():
                params[name].copy_(tensor)
        return trainer.c.scorer.student(rollout, ScoreRequest())[0].logprobs

    out = {}
    for batch, record in seen.items():
        rollout = record["rollout"]
        out[batch] = record | {
            "sampled_with": logprobs(max(0, batch - 2), rollout),
            "trained_from": logprobs(batch - 1, rollout),
        }
    return history, out


# Bounds inside the spread of a one-step-old sampler's ratios here (about 0.93 to 1.07): some
# tokens are cut or rejected, others kept with a ratio far from 1.
_LOW, _HIGH = 0.97, 1.03
_CORRECTIONS = {
    "tis": [f"algorithm.offpolicy.tis_cap={_HIGH}"],
    "mask": [f"algorithm.offpolicy.mask_low={_LOW}", f"algorithm.offpolicy.mask_high={_HIGH}"],
}


def _reference_weights(correction: str, ratio: torch.Tensor) -> torch.Tensor:
    """The single-process reference, token level: TIS min(r, cap); the mask r inside
    [low, high] and 0 outside."""
    if correction == "tis":
        return ratio.clamp(max=_HIGH)
    inside = (ratio >= _LOW) & (ratio <= _HIGH)
    return torch.where(inside, ratio, torch.zeros_like(ratio))


@pytest.mark.parametrize("correction", sorted(_CORRECTIONS))
def test_one_step_off_samples_with_the_weights_before_and_corrects_for_them(
    tmp_path: Path, correction: str
) -> None:
    overrides = [
        "trainer.steps=3", "rollout.disaggregate.ranks=1", "rollout.disaggregate.staleness=1",
        f"algorithm.offpolicy.correction={correction}", *_CORRECTIONS[correction],
    ]  # fmt: skip
    results = run_distributed(
        _stepwise, 3, (str(tmp_path / "s"), overrides), timeout_s=300, rollout_ranks=1
    )
    touched = {b: [0, 0] for b in (1, 2, 3)}  # batch -> [tokens changed, sampled], both replicas
    for history, seen in results[:2]:
        assert [h["async/staleness"] for h in history] == [0.0, 1.0, 1.0]
        for batch, r in seen.items():
            rollout = r["rollout"]
            mask = rollout.sampled_mask
            # the sampler's log-probs are those of the weights after step max(0, batch - 2) ...
            sampled = rollout.sampler_logprobs[mask]
            assert torch.allclose(sampled, r["sampled_with"][mask], atol=2e-5), batch
            # ... the trainer's old log-probs those after step batch - 1
            assert torch.allclose(r["old"][mask], r["trained_from"][mask], atol=2e-5), batch
            gap = (r["old"][mask] - sampled).abs().max().item()
            if batch >= 3:  # sampled one step behind: a real gap the correction sees
                assert gap > 1e-3, (batch, gap)
            # the ratio in float64, as importance_weights decides the bounds on it
            ratio = torch.exp(r["old"][mask].double() - sampled.double())
            reference = torch.ones_like(r["old"], dtype=torch.float64)
            reference[mask] = _reference_weights(correction, ratio)
            assert torch.allclose(r["weights"].double(), reference, atol=1e-6), batch
            changed = reference[mask] != ratio
            touched[batch][0] += int(changed.sum())
            touched[batch][1] += int(mask.sum())
            if batch >= 3:  # tokens kept with a ratio far from 1: r itself is their weight
                assert ((~changed) & ((ratio - 1).abs() > 1e-4)).any(), batch
    # the logged share of the step's tokens the cap cut or the mask rejected is the reference's
    key = "offpolicy/clip_frac" if correction == "tis" else "offpolicy/mask_frac"
    for batch, (changed, total) in touched.items():
        for history, _ in results[:2]:
            assert history[batch - 1][key] == pytest.approx(changed / total, abs=1e-12), batch
    assert 0 < touched[3][0] < touched[3][1]  # the cap or the mask took effect, not everywhere


def test_resume_with_batches_in_flight_continues_exactly(tmp_path: Path) -> None:
    overrides = [
        "trainer.steps=4", "checkpoint.save_interval=2", "rollout.disaggregate.ranks=1",
        "rollout.disaggregate.staleness=1",
    ]  # fmt: skip
    whole = run_distributed(
        _train, 3, (str(tmp_path / "w"), overrides, 1), timeout_s=300, rollout_ranks=1
    )
    step2 = tmp_path / "w" / "checkpoints" / "iter_0000002"
    assert sorted(p.name for p in (step2 / "inflight").iterdir()) == ["dp0.pt", "dp1.pt"]
    resumed = run_distributed(
        _train, 3, (str(tmp_path / "r"), [*overrides, f"checkpoint.load={step2}"], 1),
        timeout_s=300, rollout_ranks=1,
    )  # fmt: skip
    for r in range(2):
        assert len(resumed[r][0]) == 2  # steps 3 and 4
        _same_run(whole[r], resumed[r], steps=range(2, 4))


def _corrupted(rank: int, world: int, run_dir: str, overrides: list[str]) -> Any:
    """The rollout copy's weights are off after each load: the probe check must stop the run."""
    from megatron_gndpo.weight_sync.check import WeightSyncError

    cfg = _config(run_dir, overrides, world)
    if rank == world - 1:
        from megatron_gndpo.engine.probe import model_probe
        from megatron_gndpo.rollout.remote import RolloutWorker

        worker = RolloutWorker(cfg, probe=model_probe)
        load = worker._load

        def bad_load(*args: Any) -> None:
            load(*args)
            with torch.no_grad():
                next(worker.model.parameters()).mul_(3.0)
            if worker.probe is not None:  # the probe of what it now computes
                worker.probe = model_probe(worker.model, worker.groups, vocab_size=128)

        worker._load = bad_load  # type: ignore[method-assign]
        worker.run()
        return None
    from megatron_gndpo.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
    except WeightSyncError as err:
        assert trainer.pipeline is not None
        trainer.pipeline.stop()
        return str(err)
    return "no error"


def test_a_corrupted_rollout_copy_stops_the_run(tmp_path: Path) -> None:
    overrides = ["trainer.steps=2", "rollout.disaggregate.ranks=1"]
    results = run_distributed(
        _corrupted, 2, (str(tmp_path / "x"), overrides), timeout_s=300, rollout_ranks=1
    )
    assert "rollout engine's log-probs of a probe sequence" in results[0]


@pytest.mark.parametrize(
    ("world", "rollout", "layout"),
    [
        (3, 1, ["parallel.tensor_parallel=2"]),  # the trainer's TP shards are gathered
        (4, 2, ["parallel.pipeline_parallel=2", "rollout.disaggregate.tensor_parallel=2"]),
        (4, 2, []),  # 2 + 2: each trainer replica served by a rollout replica of its own
    ],
    ids=["trainer-tp2", "trainer-pp2-rollout-tp2", "two-replicas"],
)
def test_weights_reach_other_layouts(
    tmp_path: Path, world: int, rollout: int, layout: list[str]
) -> None:
    overrides = [
        "trainer.steps=3", f"rollout.disaggregate.ranks={rollout}",
        "rollout.disaggregate.staleness=1", *layout,
    ]  # fmt: skip
    results = run_distributed(
        _train, world, (str(tmp_path / "l"), overrides, rollout), timeout_s=300,
        rollout_ranks=rollout,
    )  # fmt: skip
    history, _ = results[0]
    key = "weight_sync/check_logprob_diff"  # on the first batch of each version: 1 and 3
    checks = [h[key] for h in history if key in h]
    assert [key in h for h in history] == [True, False, True]
    assert all(c < 1e-5 for c in checks), checks
    assert [h["async/staleness"] for h in history] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(h["loss"]) for h in history)


def _fill_by_bucket(rank: int, world: int) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.checkpoint.convert import fill_from_hf
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from megatron_gndpo.rollout.remote import _Named, fill_by_bucket
    from megatron_gndpo.weight_sync import bucketed, iter_hf_weights
    from megatron_gndpo.weight_sync.check import WeightSyncError
    from tests.tiny import tiny_model

    model = tiny_model(vocab_size=100)
    groups = build_student_groups(ParallelLayout(world, tp=2), seed=3)
    tp_rank = groups.coords["tp"]
    source, copy, whole = (build_gpt(model, ParallelConfig(tensor_parallel=2), groups)
                           for _ in range(3))  # fmt: skip
    with torch.no_grad():
        for param in copy.parameters():
            param.zero_()
    weights = list(iter_hf_weights(source, groups, model, family=model.hf_family))
    buckets = list(bucketed(iter(weights), max_bytes=1))  # a layer (or a single tensor) each
    fill_by_bucket(copy, iter(buckets), model, tp=2, tp_rank=tp_rank)
    fill_from_hf(whole, _Named(dict(weights)), model, tp=2, tp_rank=tp_rank)  # all at once
    # the source's rows that pad the vocabulary (rank 1's last 28 of 64) are in no HF tensor
    real = min(64, max(0, model.vocab_size - 64 * tp_rank))
    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    names = [name for name, _ in source.named_parameters()]
    differ = {
        other: [n for n, a, b in zip(names, copy.parameters(), net.parameters(), strict=True)
                if not torch.equal(*((a[:real], b[:real]) if n in vocab and trim else (a, b)))]
        for other, net, trim in (("source", source, True), ("whole", whole, False))
    }  # fmt: skip
    try:
        fill_by_bucket(copy, iter(buckets[:-1]), model, tp=2, tp_rank=tp_rank)
        error = ""
    except WeightSyncError as err:
        error = str(err)
    return {"buckets": [[n for n, _ in b] for b in buckets], "differ": differ, "error": error}


def test_the_builtin_rollout_copy_loads_a_bucket_at_a_time() -> None:
    """The built-in rollout copy fills its TP shards bucket by bucket (one held at once, not the
    whole student): with one layer per bucket, a zeroed TP=2 copy ends equal to a copy filled
    from the whole state at once, and to the source (but for the vocabulary's padding rows),
    on every rank; a broadcast that stops short names what was left unfilled."""
    results = run_distributed(_fill_by_bucket, 2, timeout_s=120)
    for result in results:
        names = result["buckets"]
        assert len(names) == 5, names  # embedding, layer 0, layer 1, final norm, lm_head
        assert result["differ"] == {"source": [], "whole": []}, result["differ"]
        assert "left 1 parameters unfilled (first: output_layer.weight)" in result["error"]
