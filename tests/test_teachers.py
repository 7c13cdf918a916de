"""Several teachers routed by a prompt field (docs/TEACHERS.md).

One 2-rank launch (gloo) of the two-teacher example on a JSONL file routed by its ``domain``
field: teacher ``math`` on TP=1, teacher ``code`` on TP=2 (another data-parallel size, so the
rows travel to it), rows without the field to the default. Each row's scores (log-probs and a
top-k) must equal its own teacher's when that teacher scores the whole batch alone; the step's
per-teacher metrics must count the tokens actually routed; with ``teacher_stats: teacher`` each
teacher's advantages are whitened over its own tokens. The rules, the routing errors, GNDPO's
per-group statistics and the plan are checked in one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_gndpo.algorithms.advantages import gndpo_advantages, gndpo_advantages_by_group
from megatron_gndpo.algorithms.metrics import teacher_metrics
from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.data.datasets import load_prompts
from megatron_gndpo.errors import DataError
from tests.harness import run_distributed

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny_cpu_two_teachers.yaml"


def _teachers(second_tp: int = 2, **extra: object) -> str:
    """A ``teachers=`` override: math (4 layers, TP=1) and code (2 layers, TP=second_tp)."""
    model = (
        "hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4, num_query_groups: 2, "
        "vocab_size: 128, make_vocab_size_divisible_by: 64, max_position_embeddings: 96, "
        "params_dtype: fp32"
    )
    code = ", ".join(f"{k}: {json.dumps(v)}" for k, v in {"sources": ["coding"], **extra}.items())
    return (
        f"teachers=[{{name: math, model: {{num_layers: 4, {model}}}}}, "
        f"{{name: code, {code}, model: {{num_layers: 2, {model}}}, "
        f"parallel: {{tensor_parallel: {second_tp}}}}}]"
    )


def _prompt_file(path: Path) -> Path:
    """Arithmetic prompts: a third math, a third code (by a source), a third without domain."""
    from megatron_gndpo.data.datasets import BUILTIN_DATASETS

    pairs = BUILTIN_DATASETS["arithmetic"]()[:24]
    with path.open("w") as f:
        for i, (prompt, answer) in enumerate(pairs):
            record: dict[str, object] = {"prompt": prompt, "answer": answer}
            if i % 3 == 0:
                record["domain"] = "math"
            elif i % 3 == 1:
                record["domain"] = "coding"
            f.write(json.dumps(record) + "\n")
    return path


def _routed_run(rank: int, world: int, run_dir: str, prompts: str) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.config import load_config
    from megatron_gndpo.engine.scoring import ScoreRequest
    from megatron_gndpo.scorer import ScoredRollout
    from megatron_gndpo.trainer import Trainer

    out: dict[str, object] = {}
    for stats in ("batch", "teacher"):
        cfg = load_config(
            EXAMPLE,
            [
                f"logging.run_dir={run_dir}/{stats}", f"data.train={prompts}",
                _teachers(), "data.teacher_key=domain", "data.default_teacher=code",
                f"algorithm.teacher_stats={stats}", "rollout.prompts_per_step=8",
                "rollout.samples_per_prompt=2", "trainer.micro_batch_size=2",
            ],
        )  # fmt: skip
        validate(cfg, world)
        trainer = Trainer(cfg)
        teachers = trainer.c.teacher
        prompts_now = trainer._next_prompts()
        rollout = trainer._sample(prompts_now)
        routes = teachers.routes(prompts_now, rollout.prompt_index)
        request = ScoreRequest(top_k=3)
        mixed = teachers.score_batch(rollout.tokens, rollout.lengths, request, routes=routes)
        alone = [s.score_batch(rollout.tokens, rollout.lengths, request) for s in teachers.scorers]
        sources = [prompts_now[int(i)].example.source for i in rollout.prompt_index]
        student, _ = trainer.c.scorer.student(rollout, trainer.method.student_request(mixed))
        scored = ScoredRollout(mixed, student, rollout.response_mask, {})
        targets, metrics = trainer._targets(rollout, scored, None, routes)
        out[stats] = {
            "routes": routes, "sources": sources, "mixed": mixed, "alone": alone,
            "mask": rollout.response_mask, "advantages": targets.advantages, "metrics": metrics,
            "steps": [trainer.step() for _ in range(2)],
        }  # fmt: skip
        from tests.trainers import reset_megatron

        reset_megatron()
    return out


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    root = tmp_path_factory.mktemp("teachers")
    prompts = _prompt_file(root / "prompts.jsonl")
    return run_distributed(_routed_run, 2, (str(root), str(prompts)), timeout_s=300)


def test_each_row_is_scored_by_its_own_teacher_alone(routed: list[dict]) -> None:
    seen = set()
    for rank in routed:
        r = rank["batch"]
        want = {"math": 0, "coding": 1, None: 1}  # the default is code
        assert r["routes"].tolist() == [want[s] for s in r["sources"]]
        seen |= set(r["routes"].tolist())
        for i, j in enumerate(r["routes"].tolist()):
            alone = r["alone"][j]
            torch.testing.assert_close(r["mixed"].logprobs[i], alone.logprobs[i], atol=1e-6, rtol=0)
            torch.testing.assert_close(
                r["mixed"].topk_logprobs[i], alone.topk_logprobs[i], atol=1e-6, rtol=0
            )
            assert torch.equal(r["mixed"].topk_ids[i], alone.topk_ids[i])
        # the two teachers are different models: the routing matters
        other = r["alone"][1 - r["routes"][0]]
        assert not torch.allclose(r["mixed"].logprobs[0], other.logprobs[0], atol=1e-3)
    assert seen == {0, 1}, "the step's batch should hold rows of both teachers"


def test_per_teacher_metrics_count_the_routed_tokens(routed: list[dict]) -> None:
    counts = [0.0, 0.0]
    for rank in routed:
        r = rank["batch"]
        for i, j in enumerate(r["routes"].tolist()):
            counts[j] += float(r["mask"][i].sum())
    metrics = routed[0]["batch"]["metrics"]
    total = sum(counts)
    assert metrics["teacher/math/token_frac"] == pytest.approx(counts[0] / total)
    assert metrics["teacher/code/token_frac"] == pytest.approx(counts[1] / total)
    for name in ("math", "code"):
        assert {f"teacher/{name}/{k}" for k in ("score_mean", "score_std", "clamp_frac")} <= set(
            metrics
        )
    for step in routed[0]["batch"]["steps"]:  # the training steps log them too
        assert step["teacher/math/token_frac"] + step["teacher/code/token_frac"] == (
            pytest.approx(1.0)
        )


def _moments(routed: list[dict], stats: str, teacher: int | None) -> tuple[float, float]:
    values = []
    for rank in routed:
        r = rank[stats]
        for i, j in enumerate(r["routes"].tolist()):
            if teacher is None or j == teacher:
                values.append(r["advantages"][i][r["mask"][i]])
    v = torch.cat(values).double()
    return float(v.mean()), float(v.std())


def test_teacher_stats_whiten_each_teachers_rows_on_their_own(routed: list[dict]) -> None:
    mean, std = _moments(routed, "batch", None)  # the paper's: over the whole batch
    assert abs(mean) < 1e-5 and std == pytest.approx(1.0, abs=1e-4)
    for j in (0, 1):
        mean, std = _moments(routed, "teacher", j)
        assert abs(mean) < 1e-5 and std == pytest.approx(1.0, abs=1e-4)


# ------------------------------------------------------------------------- single process


def test_gndpo_by_group_equals_gndpo_on_each_group() -> None:
    torch.manual_seed(0)
    lt, lo = torch.randn(6, 5), torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.2).float()
    groups = torch.tensor([0, 1, 0, 2, 1, 0])  # group 2: one row
    mask[3] = 0.0
    mask[3, 0] = 1.0  # group 2 has one token: nothing to whiten by, advantages 0
    got = gndpo_advantages_by_group(lt, lo, mask, groups, 3, kl_clip=1.0)
    for j in (0, 1):
        rows = groups == j
        alone = gndpo_advantages(lt[rows], lo[rows], mask[rows], kl_clip=1.0)
        torch.testing.assert_close(got[rows], alone)
    assert torch.equal(got[3], torch.zeros(5))


def test_teacher_metrics_by_hand() -> None:
    lt = torch.tensor([[0.0, -1.0, -3.0], [0.0, -0.5, 0.0]])
    lo = torch.tensor([[0.0, -2.0, 0.0], [0.0, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    m = teacher_metrics(lt, lo, mask, torch.tensor([0, 1]), ["a", "b"], kl_clip=2.0)
    # teacher a: scores 1 and -3 (clamped to -2); teacher b: 0.5
    assert m["teacher/a/token_frac"] == pytest.approx(2 / 3)
    assert m["teacher/a/score_mean"] == pytest.approx(-0.5)
    assert m["teacher/a/score_std"] == pytest.approx(math.sqrt(4.5))
    assert m["teacher/a/clamp_frac"] == pytest.approx(0.5)
    assert m["teacher/b/token_frac"] == pytest.approx(1 / 3)
    assert m["teacher/b/score_mean"] == pytest.approx(0.5)
    assert m["teacher/b/clamp_frac"] == 0.0


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(EXAMPLE, list(overrides)), 2)
    return str(err.value)


def test_the_example_validates_and_one_teacher_keeps_todays_shape() -> None:
    cfg = validate(load_config(EXAMPLE), 2)
    assert [t.name for t in cfg.teachers] == ["arithmetic", "chains"]
    from megatron_gndpo.config.schema import teacher_sections

    tiny = load_config(Path(__file__).parents[1] / "examples" / "tiny_cpu.yaml")
    assert teacher_sections(tiny) == [("teacher", tiny.teacher)] and tiny.teachers == ()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("teacher.temperature=2.0",), "both teacher and teachers are set"),
        ((_teachers().replace("name: code", "name: math"),), "used more than once"),
        ((_teachers().replace('["coding"]', '["math"]'),), "'math', which already routes to math"),
        (("data.default_teacher=physics",), "data.default_teacher='physics' names no teacher"),
        ((_teachers(weight=0.0),), "teachers[1].weight must be > 0"),
        ((_teachers().replace("name: code", 'name: ""'),), "teachers[1].name is empty"),
        ((_teachers(second_tp=3),), "teachers[1].parallel"),
        (
            ("algorithm.estimator=tropd", "algorithm.tropd.prefix_share_start=0.5"),
            "needs one teacher",
        ),
    ],
)
def test_rules_of_several_teachers(overrides: tuple[str, ...], message: str) -> None:
    if overrides[0].startswith("teachers="):
        overrides = (*overrides, "data.default_teacher=null")
    assert message in _problems(*overrides)


def test_a_prompt_naming_no_teacher_is_an_error_with_its_line(tmp_path: Path) -> None:
    from megatron_gndpo.data.datasets import EncodedPrompt
    from megatron_gndpo.teacher.build import check_routes, routing_of

    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "1+1?", "data_source": "math"}\n{"prompt": "2+2?", "data_source": 7}\n'
    )
    with pytest.raises(DataError, match=r"p.jsonl:2: field 'data_source' is a int \(7\)"):
        load_prompts(str(path), source_key="data_source")
    path.write_text('{"prompt": "1+1?"}\n{"prompt": "2+2?", "data_source": "physics"}\n')
    cfg = load_config(EXAMPLE)
    examples = load_prompts(str(path), source_key="data_source")
    encoded = [EncodedPrompt(e, [1]) for e in examples]
    routing = routing_of(cfg)
    assert routing is not None and routing.of(examples[0].source, "") == 0  # the default
    names_none = r"p.jsonl:2: data.teacher_key \(data_source\)='physics' names no teacher"
    with pytest.raises(DataError, match=names_none + r"; the teachers take \['arithmetic', "):
        check_routes(routing, encoded)


def test_builtin_mixed_prompts_carry_their_set_as_routing_value() -> None:
    routed = load_prompts("builtin:mixed", source_key="data_source")
    assert {p.source for p in routed} == {"arithmetic", "chains"}
    assert all(p.source is None for p in load_prompts("builtin:mixed"))


def test_plan_accounts_for_every_teacher() -> None:
    from megatron_gndpo.plan import estimate_memory, teacher_plans

    cfg = load_config(EXAMPLE)
    plans = teacher_plans(cfg, 2)
    assert [p.name for p in plans] == ["teacher arithmetic", "teacher chains"]
    (row,) = estimate_memory(cfg, 2)
    one = estimate_memory(dataclasses.replace(cfg, teachers=cfg.teachers[:1]), 2)[0]
    chains = plans[1].stages[0].params_per_rank * 4  # fp32, TP=2: half per rank
    assert row.teacher_weights == pytest.approx(one.teacher_weights + chains)
    assert row.teacher_stages == (0, 0)
