"""The methods package: the registry, each method's requests, targets and config problems on
CPU tensors; and vOPD, TGPO and TrOPD in the trainer on CPU (gloo): the same numbers at TP=1,
TP=2 and PP=2, with the teacher on another layout, and every variant trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_gndpo.checks import validate
from megatron_gndpo.config import load_config
from megatron_gndpo.config.docs import iter_fields
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import AlgorithmConfig, TGPOConfig, TrOPDConfig
from megatron_gndpo.engine.scoring import ScoreRequest, Scores
from megatron_gndpo.methods import METHODS as REGISTRY
from megatron_gndpo.methods import BaseMethod, StepBatch, Targets, build_method, config_names
from tests.harness import run_distributed

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
    from tests.trainers import two_steps

    return two_steps(world, root, runs, saved=f"{root}/..")


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


@pytest.mark.distributed
@pytest.mark.megatron
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


# ---------------------------------------------------------------- the package, on CPU tensors
def _batch(method_scores: dict[str, torch.Tensor] | None = None, **fields: object) -> StepBatch:
    """A two-prompt, two-sample step with random scores (group=None: the batch is all local)."""
    g = torch.Generator().manual_seed(0)
    n, width = 4, 6
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (start, end) in enumerate([(2, 6), (2, 5), (3, 6), (1, 4)]):
        mask[i, start:end] = True
    teacher = Scores(logprobs=-torch.rand(n, width, generator=g) * 3)
    student = Scores(
        logprobs=-torch.rand(n, width, generator=g) * 3, entropy=torch.rand(n, width, generator=g)
    )
    base = dict(
        teacher=teacher, student=student, response_mask=mask,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, group=None, step=1,
        tokens=torch.randint(0, 10, (n, width), generator=g),
    )  # fmt: skip
    return StepBatch(**(base | fields))  # type: ignore[arg-type]


def test_registry_names_every_method_once_and_the_config_reference_lists_them() -> None:
    assert list(REGISTRY) == [
        "gndpo",
        "opd",
        "grpo",
        "reinforce_pp",
        "vopd",
        "mix",
        "tgpo",
        "tropd",
        "topk_kd",
    ]
    for name, kind in REGISTRY.items():
        assert kind.name == name
        assert build_method(AlgorithmConfig(estimator=name)).name == name
    docs = {f.key: f.doc for f in iter_fields(names=config_names())}
    assert "megatron_gndpo.methods.METHODS" in docs["algorithm.estimator"]
    assert docs["algorithm.estimator"].endswith(f"One of: {', '.join(REGISTRY)}."), (
        "the config reference lists the registry's names"
    )
    with pytest.raises(ValueError, match="unknown estimator 'nope'"):
        build_method(AlgorithmConfig(estimator="nope"))


def test_every_scores_field_is_a_score_request_output() -> None:
    import dataclasses

    request = ScoreRequest(
        top_k=2, extra_ids=torch.zeros(1, 3, 2, dtype=torch.long), entropy=True, full_kl=True,
        sample_seed=1,
    )  # fmt: skip
    fields = {f.name for f in dataclasses.fields(Scores)}
    assert set(request.specs(1, 3)) == fields - {"hidden"}  # hidden: last stage, never broadcast


def test_leftover_distill_estimator_does_not_apply_outside_mix() -> None:
    """A gndpo run with a leftover ``distill_estimator: vopd`` got vOPD's checks (issue 16)."""
    from megatron_gndpo.checks.vocab import check_top_k

    full_kl = ["algorithm.vopd_top_k=0", "teacher.parallel.tensor_parallel=2"]
    validate(load_config(None, ["algorithm.distill_estimator=vopd", *full_kl]))
    with pytest.raises(ConfigError, match="needs the teacher on the student's layout"):
        validate(load_config(None, ["algorithm.estimator=vopd", *full_kl]))
    with pytest.raises(ConfigError, match="needs the teacher on the student's layout"):
        mix = ["algorithm.estimator=mix", "algorithm.distill_estimator=vopd"]
        validate(load_config(None, [*mix, *full_kl]))
    leftover = load_config(None, ["algorithm.distill_estimator=vopd", "algorithm.vopd_top_k=60"])
    check_top_k(leftover, 50)  # gndpo asks for no top-k
    used = load_config(None, ["algorithm.estimator=vopd", "algorithm.vopd_top_k=60"])
    with pytest.raises(ConfigError, match=r"algorithm\.vopd_top_k=60 exceeds the 50 token ids"):
        check_top_k(used, 50)


def test_requests_and_order_of_each_method() -> None:
    def method(**kw: object):  # type: ignore[no-untyped-def]
        return build_method(AlgorithmConfig(**kw))  # type: ignore[arg-type]

    for name in ("gndpo", "opd", "grpo", "reinforce_pp", "mix", "tropd"):
        m = method(estimator=name, tropd=TrOPDConfig(outlier="mask"))
        assert not m.student_first
        assert m.student_request(None) == ScoreRequest(entropy=True)
        assert m.teacher_request(None, 7) is None, name
    vopd = method(estimator="vopd", vopd_top_k=3)
    assert vopd.student_first and vopd.student_request(None) == ScoreRequest(top_k=3, entropy=True)
    ids = torch.ones(2, 4, 3, dtype=torch.long)
    request = vopd.teacher_request(Scores(torch.zeros(2, 4), topk_ids=ids), 0)
    assert request is not None and request.extra_ids is ids
    assert method(estimator="mix", distill_estimator="vopd").student_first
    full = method(estimator="vopd", vopd_top_k=0)
    assert full.student_request(None) == ScoreRequest(hidden=True, entropy=True)
    hidden = torch.zeros(2, 4, 8)
    request = full.teacher_request(Scores(torch.zeros(2, 4), hidden=hidden), 0)
    assert request is not None and request.full_kl and request.kl_hidden is hidden
    tgpo = method(estimator="tgpo")
    assert tgpo.teacher_request(None, 7) == ScoreRequest(top_k=1)
    sampled = method(estimator="tgpo", tgpo=TGPOConfig(teacher_token="sampled"))
    assert sampled.teacher_request(None, 7) == ScoreRequest(sample_seed=7)
    assert method(estimator="tropd").teacher_request(None, 0) == ScoreRequest(top_k=20)
    prefix = method(estimator="tropd", tropd=TrOPDConfig(
        prefix_share_start=0.5, prefix_decay_steps=2))  # fmt: skip
    assert prefix.teacher_samples and not method(estimator="tropd").teacher_samples
    assert [prefix.prefix_share(s) for s in (1, 2, 3)] == [0.5, 0.25, 0.0]
    assert method(estimator="gndpo").prefix_share(1) == 0.0
    assert prefix.rollout_metrics(1, 0.3) == {
        "tropd/prefix_share": 0.5, "tropd/teacher_written_frac": 0.3
    }  # fmt: skip


def test_targets_are_the_algorithms_math() -> None:
    from megatron_gndpo.algorithms import advantages as adv

    batch = _batch()
    lt, lo, m = batch.teacher.logprobs, batch.student.logprobs, batch.response_mask.float()
    gndpo, _ = build_method(AlgorithmConfig()).targets(batch)
    assert torch.equal(gndpo.advantages, adv.gndpo_advantages(lt, lo, m, kl_clip=5.0))
    opd, _ = build_method(AlgorithmConfig(estimator="opd")).targets(batch)
    assert torch.equal(opd.advantages, adv.opd_advantages(lt, lo, m, kl_clip=5.0))
    rewards = batch.rewards
    assert rewards is not None
    grpo, _ = build_method(AlgorithmConfig(estimator="grpo")).targets(batch)
    assert torch.equal(grpo.advantages, adv.grpo_advantages(rewards, m, group_size=2))
    mix, _ = build_method(AlgorithmConfig(estimator="mix", outcome_weight=0.5)).targets(batch)
    expected = adv.mix_advantages(gndpo.advantages, grpo.advantages, outcome_weight=0.5)
    assert torch.equal(mix.advantages, expected)
    with pytest.raises(ValueError, match="estimator mix needs a verifiable reward"):
        build_method(AlgorithmConfig(estimator="mix")).targets(_batch(rewards=None))


def test_guidance_targets_are_the_algorithms_math() -> None:
    from megatron_gndpo.algorithms import advantages as adv
    from megatron_gndpo.algorithms import guidance

    g = torch.Generator().manual_seed(1)
    base = _batch()
    m, lt, lo = base.response_mask, base.teacher.logprobs, base.student.logprobs
    rewards = base.rewards
    assert rewards is not None
    ids = torch.randint(0, 10, (*m.shape, 3), generator=g)
    topk = -torch.rand(*m.shape, 3, generator=g)
    # vOPD over the student's top-k: the teacher's log-probs of those ids give the KL
    student = Scores(lo, topk_ids=ids, topk_logprobs=topk - 1)
    vopd_batch = _batch(teacher=Scores(lt, extra_logprobs=topk), student=student)
    vopd = build_method(AlgorithmConfig(estimator="vopd", vopd_top_k=3))
    targets, metrics = vopd.targets(vopd_batch)
    kl = adv.token_kl_topk(topk - 1, topk)
    assert torch.equal(targets.advantages, adv.vopd_advantages(lt, lo, m.float(), kl))
    assert metrics["vopd/kl_mean"] == pytest.approx(float(kl[m].mean()))
    # TGPO (greedy, loss): GRPO's advantage plus the cross-entropy towards the teacher's token
    tgpo_batch = _batch(teacher=Scores(lt, topk_ids=ids[..., :1], topk_logprobs=topk[..., :1]))
    cfg = AlgorithmConfig(estimator="tgpo", tgpo=TGPOConfig(coef_start=0.5))
    targets, metrics = build_method(cfg).targets(tgpo_batch)
    assert torch.equal(targets.advantages, adv.grpo_advantages(rewards, m.float(), group_size=2))
    assert targets.aux_ids is not None and torch.equal(targets.aux_ids, ids[..., :1])
    assert targets.aux_logq is not None and not targets.aux_logq.any()
    coef = guidance.linear_decay(1, 0.5, cfg.tgpo.coef_decay)
    assert targets.aux_coef == coef == metrics["guidance/coef"]
    # TrOPD: the routing of algorithms/guidance.py, with the teacher's top-k as the KL target
    tropd_batch = _batch(teacher=Scores(lt, topk_ids=ids, topk_logprobs=topk))
    cfg = AlgorithmConfig(estimator="tropd", tropd=TrOPDConfig(top_k=3))
    targets, metrics = build_method(cfg).targets(tropd_batch)
    t = cfg.tropd
    want = guidance.tropd_routing(
        lt, lo, m.float(), kl_clip=cfg.kl_clip, threshold=t.trust_threshold, outlier=t.outlier,
        outlier_clip=t.outlier_clip,
    )  # fmt: skip
    assert torch.equal(targets.advantages, want[0]) and targets.aux_coef == t.kl_coef
    assert targets.pg_mask is not None and torch.equal(targets.pg_mask, want[1])
    assert targets.aux_mask is not None and torch.equal(targets.aux_mask, want[2])
    assert "tropd/trusted_frac" in metrics


def test_a_method_added_with_one_class_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worked example of docs/DESIGN.md ("How to add a method"), kept working."""
    from megatron_gndpo.algorithms import advantages as adv

    class SignOPD(BaseMethod):
        """OPD with the sign of the score as the advantage."""

        name = "sign_opd"

        def targets(self, batch: StepBatch) -> tuple[Targets, dict[str, float]]:
            score = adv.opd_advantages(
                batch.teacher.logprobs, batch.student.logprobs, batch.response_mask.float(),
                kl_clip=self.cfg.kl_clip,
            )  # fmt: skip
            return Targets(score.sign()), {"sign_opd/positive_frac": float((score > 0).sum())}

        def problems(self, cfg, world_size):  # type: ignore[no-untyped-def]
            return [] if cfg.rollout.samples_per_prompt else ["unreachable"]

    monkeypatch.setitem(REGISTRY, SignOPD.name, SignOPD)
    cfg = load_config(None, ["algorithm.estimator=sign_opd"])
    validate(cfg)
    assert "sign_opd" in config_names()["algorithm.estimator"]  # the reference lists it too
    targets, metrics = build_method(cfg.algorithm).targets(_batch())
    assert set(targets.advantages.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert "sign_opd/positive_frac" in metrics
