"""vOPD, TGPO and TrOPD in the trainer on CPU (gloo): the same numbers at TP=1, TP=2 and PP=2,
with the teacher on another layout, and every variant trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_trainer import _reset, _snapshot, _trainer

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

METHODS = {
    "vopd": ["algorithm.estimator=vopd", "algorithm.vopd_top_k=8"],
    "tgpo-topk": [
        "algorithm.estimator=tgpo", "algorithm.tgpo.teacher_token=topk", "algorithm.tgpo.top_k=4",
        "algorithm.tgpo.coef_start=0.5",
    ],
    "tropd": [
        "algorithm.estimator=tropd", "algorithm.tropd.top_k=4", "algorithm.entropy_coef=0.01",
    ],
    # off-policy guidance: half the teacher's answer as the prefix at step 1, a quarter at 2
    "tropd-prefix": [
        "algorithm.estimator=tropd", "algorithm.tropd.top_k=4",
        "algorithm.tropd.prefix_share_start=0.5", "algorithm.tropd.prefix_decay_steps=2",
    ],
}  # fmt: skip
# vOPD over the full vocabulary needs the teacher on the student's layout.
FULL_KL = ["algorithm.estimator=vopd", "algorithm.vopd_top_k=0"]
SAME_LAYOUTS = {
    "tp2": ["parallel.tensor_parallel=2", "teacher.parallel.tensor_parallel=2"],
    "pp2": ["parallel.pipeline_parallel=2", "teacher.parallel.pipeline_parallel=2"],
}
# Variants checked for training only (at TP=2 / PP=2).
VARIANTS = {
    "tgpo-greedy": ["algorithm.estimator=tgpo", "algorithm.tgpo.coef_start=0.5"],
    "tgpo-advantage": ["algorithm.estimator=tgpo", "algorithm.tgpo.guidance=advantage"],
    "tgpo-sampled": [
        "algorithm.estimator=tgpo", "algorithm.tgpo.teacher_token=sampled",
        "algorithm.tgpo.coef_start=0.5",
    ],
    "tropd-clip": ["algorithm.estimator=tropd", "algorithm.tropd.outlier=clip"],
    "mix-vopd": [
        "algorithm.estimator=mix", "algorithm.distill_estimator=vopd",
        "algorithm.outcome_weight=0.5", "algorithm.vopd_top_k=4",
    ],
}  # fmt: skip
# The metric each method adds, beside the common ones.
OWN_METRIC = {"vopd": "vopd/kl_mean", "tgpo": "guidance/coef", "tropd": "tropd/trusted_frac"}
COMPARED = ("grad_norm", "loss", "advantage/mean", "entropy/mean")


def _runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> dict[str, object]:
    """Two steps of each run, and whether every student weight moved and the teacher did not."""
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    out: dict[str, object] = {}
    for name, overrides in runs.items():
        trainer = _trainer(f"{root}/{name}", *overrides)
        if world == 1 and not out:  # megatron initialises other PP layouts differently
            save_checkpoint(f"{root}/../init", 0, trainer.c.student)
            save_checkpoint(f"{root}/../teacher", 0, trainer.c.teacher.model)
        student, teacher = _snapshot(trainer.c.student), _snapshot(trainer.c.teacher.model)
        steps = [trainer.step() for _ in range(2)]
        out[name] = {
            "steps": steps,
            "unchanged": [
                n for n, p in trainer.c.student.named_parameters() if (p == student[n]).all()
            ],
            "teacher_moved": [
                n for n, p in trainer.c.teacher.model.named_parameters()
                if not (p == teacher[n]).all()
            ],
        }  # fmt: skip
        trainer.c.logger.close()
        _reset()
    return out


def _check_prefix(name: str, result: dict) -> None:  # type: ignore[type-arg]
    first, second = result["steps"]
    assert (first["tropd/prefix_share"], second["tropd/prefix_share"]) == (0.5, 0.25), name
    assert 0 < second["tropd/teacher_written_frac"] < first["tropd/teacher_written_frac"] < 1


def _check_trained(name: str, result: dict) -> None:  # type: ignore[type-arg]
    assert result["unchanged"] == [], f"{name}: not updated: {result['unchanged']}"
    assert result["teacher_moved"] == [], f"{name}: teacher changed"
    for m in result["steps"]:
        assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, name
        assert math.isfinite(m["loss"]) and math.isfinite(m["entropy/mean"]), name
        method = name.split("-")[0]
        if method in OWN_METRIC:
            assert math.isfinite(m[OWN_METRIC[method]]), (name, OWN_METRIC[method])


def test_methods_agree_across_layouts_and_all_variants_train(tmp_path: Path) -> None:
    init = [f"checkpoint.init={tmp_path / 'init'}", f"teacher.load={tmp_path / 'teacher'}"]
    # k = the whole vocabulary renormalised is the full KL: the two vOPD paths must agree
    every_id = ["algorithm.estimator=vopd", "algorithm.vopd_top_k=100"]  # the 100 ids of tiny_cpu
    w1_runs = METHODS | {"vopd-full": FULL_KL, "vopd-all": every_id}
    one = run_distributed(_runs, 1, args=(str(tmp_path / "w1"), w1_runs), timeout_s=400)[0]
    for ref, got in zip(one["vopd-all"]["steps"], one["vopd-full"]["steps"], strict=True):
        for key in (*COMPARED, "vopd/kl_mean"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    layouts = {
        "tp2": ["parallel.tensor_parallel=2", "teacher.parallel.pipeline_parallel=2"],
        "pp2": ["parallel.pipeline_parallel=2", "teacher.parallel.tensor_parallel=2"],
    }
    runs = {
        f"{name}@{layout}": [*overrides, *extra, *init, "trainer.micro_batch_size=4"]
        for name, overrides in METHODS.items()
        for layout, extra in layouts.items()
    }
    runs |= {f"{name}@tp2": [*o, *layouts["tp2"]] for name, o in VARIANTS.items()}
    runs |= {
        f"vopd-full@{layout}": [*FULL_KL, *extra, *init, "trainer.micro_batch_size=4"]
        for layout, extra in SAME_LAYOUTS.items()
    }
    two = run_distributed(_runs, 2, args=(str(tmp_path / "w2"), runs), timeout_s=600)[0]
    for name, result in (one | two).items():
        _check_trained(name, result)  # type: ignore[arg-type]
        if name.startswith("tropd-prefix"):
            _check_prefix(name, result)  # type: ignore[arg-type]
    for name, result in two.items():
        method = name.split("@")[0]
        if method not in w1_runs:
            continue
        reference = one[method]["steps"]  # type: ignore[index]
        for step, (ref, got) in enumerate(zip(reference, result["steps"], strict=True)):
            assert got["tokens/step"] == ref["tokens/step"], (name, step)
            keys = (*COMPARED, OWN_METRIC[method.split("-")[0]], "tokens/step")
            for key in keys:
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, step, key)
