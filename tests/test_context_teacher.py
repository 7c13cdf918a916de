"""A teacher with its own prompt (``teacher.context``) and the student's own weights
(``teacher.weights``): on-policy context distillation (docs/TEACHERS.md).

In one process: the teacher's rows hold its rendered prompt and the student's response ids, the
student's never the context (token by token); the rules refuse what cannot work, naming the
fix; a record without a field the template names fails before any model. Then trainers on the
tiny example: with an empty context the live student as its own teacher scores every token 0;
the initial weights stay frozen; an EMA follows the student step by step and resumes as saved;
and, on 2 ranks, a teacher from checkpoint.init at another layout than the student's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.config.schema import TeacherContextConfig
from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample, load_prompts
from megatron_gndpo.data.tokenizer import CharTokenizer
from megatron_gndpo.errors import DataError
from megatron_gndpo.rollout.base import Rollout
from megatron_gndpo.teacher.context import check_fields, render
from megatron_gndpo.teacher.cross_tokenizer import NO_SPAN, CrossTokenizer, TeacherTokenizer
from tests.harness import run_distributed
from tests.trainers import TINY, reset_megatron, snapshot, tiny_trainer

HINTED = TeacherContextConfig(
    template="{hint} {prompt}", system="Answer with {answer}.", turns=(("1 + 1 = ?", "{answer}"),)
)


def _prompt_file(path: Path, n: int = 16) -> Path:
    """Arithmetic prompts with their answers and a ``hint`` field the student never sees."""
    from megatron_gndpo.data.datasets import BUILTIN_DATASETS

    with path.open("w") as f:
        for prompt, answer in BUILTIN_DATASETS["arithmetic"]()[:n]:
            record = {"prompt": prompt, "answer": answer, "hint": f"hint={answer}"}
            f.write(json.dumps(record) + "\n")
    return path


# ------------------------------------------------------------------------- rows, one process


def test_the_context_reaches_the_teacher_and_never_the_student(tmp_path: Path) -> None:
    tok = CharTokenizer()
    [example] = load_prompts(str(_prompt_file(tmp_path / "p.jsonl", 1)), fields=("hint",))
    student_prompt = tok.apply_chat_template(example.prompt)
    responses = [tok.encode("12"), [*tok.encode("7"), tok.eos_id], []]
    rows = [student_prompt + r for r in responses]
    width = max(map(len, rows)) + 1
    tokens = torch.full((3, width), tok.pad_id)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    n = len(student_prompt)
    rollout = Rollout(
        tokens, torch.full((3,), n), torch.tensor(list(map(len, rows))), torch.zeros(3, width),
        torch.zeros(3, dtype=torch.long), torch.tensor([False, True, False]),
    )  # fmt: skip
    rendered = render(HINTED, example)
    assert rendered.prompt == f"{example.field('hint')} {example.prompt}"
    assert rendered.system == f"Answer with {example.answer}."
    assert rendered.turns == (("1 + 1 = ?", example.answer),)
    teacher_prompt = tok.apply_chat_template(
        rendered.prompt, system=rendered.system, turns=rendered.turns
    )
    cross = CrossTokenizer(tok, [TeacherTokenizer(tok, same=True, max_length=512, context=HINTED)])
    built = cross.rows(rollout, [EncodedPrompt(example, student_prompt)], torch.zeros(3).long())
    hint_ids = tok.encode(example.field("hint") or "")
    for i in range(2):
        got = built.tokens[i, : built.lengths[i]].tolist()
        assert got == teacher_prompt + responses[i]  # the student's ids after the teacher's prompt
        # the student's row holds its prompt and response only: no context token
        assert rollout.tokens[i, : rollout.lengths[i]].tolist() == student_prompt + responses[i]
        spans_s = built.student_span[i][built.student_span[i] != NO_SPAN]
        spans_t = built.teacher_span[i][built.teacher_span[i] != NO_SPAN]
        assert spans_s.tolist() == spans_t.tolist() == list(range(len(responses[i])))
        # each response token sits at the same offset after its own side's prompt
        at_s = (built.student_span[i] >= 0).nonzero().flatten() - n
        at_t = (built.teacher_span[i] >= 0).nonzero().flatten() - len(teacher_prompt)
        assert torch.equal(at_s, at_t)
    assert _contains(teacher_prompt, hint_ids) and not _contains(student_prompt, hint_ids)
    assert built.lengths[2] == n  # an empty response (a stub): its row only, nothing scored


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_a_record_without_a_named_field_fails_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "1 + 1 = ?", "answer": "2", "hint": "two"}\n{"prompt": "2 + 2 = ?"}\n'
    )
    prompts = [EncodedPrompt(e, []) for e in load_prompts(str(path), fields=("hint",))]
    with pytest.raises(DataError, match=r"p\.jsonl:2: teacher\.context names \{hint\}"):
        check_fields("teacher", HINTED, prompts, str(path))
    answer_only = TeacherContextConfig(template="{prompt} ({answer})")
    with pytest.raises(DataError, match=r"p\.jsonl:2: .* has no reference answer"):
        check_fields("teacher", answer_only, prompts, str(path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["teacher.weights=live", "teacher.parallel.tensor_parallel=2"], "must equal parallel"),
        (["teacher.weights=initial", "teacher.parallel.tensor_parallel=2"], "checkpoint.init"),
        (["teacher.weights=live", "teacher.load=/x"], "teacher.load would replace"),
        (["teacher.context.template='{hint!r}'"], "name a field plainly"),
        (["teacher.context.template='{prompt}'", "algorithm.estimator=tgpo"], "sampled token"),
        (["teacher.weights=ema", "teacher.ema_decay=1.0"], "ema_decay must be in"),
    ],
)
def test_what_cannot_work_is_refused_with_the_fix(overrides: list[str], message: str) -> None:
    cfg = load_config(TINY, overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2)


def test_a_teacher_with_the_students_weights_has_the_students_architecture() -> None:
    from megatron_gndpo.config.schema import teacher_sections

    cfg = load_config(TINY, ["teacher.weights=initial"])
    validate(cfg, 1)
    [(_, teacher)] = teacher_sections(cfg)
    assert teacher.model == cfg.model != cfg.teacher.model


# ------------------------------------------------------------------------- trainers


def _steps(rank: int, world: int, root: str, prompts: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    context = f"data.train={prompts}"
    # the live student with the student's own prompt: the same model on the same rows
    t = tiny_trainer(f"{root}/empty", context, "teacher.weights=live", "teacher.context={}")
    assert t.c.teacher.only.model is t.c.student
    out["empty"] = [t.step() for _ in range(2)]
    t.c.logger.close()
    reset_megatron()
    # the initial weights, frozen, with a hint the student never sees
    hint = ["teacher.context.template='{hint} {prompt}'"]
    t = tiny_trainer(f"{root}/initial", context, "teacher.weights=initial", *hint)
    start, teacher_start = snapshot(t.c.student), snapshot(t.c.teacher.only.model)
    steps = [t.step() for _ in range(2)]
    out["initial"] = {
        "steps": steps, "start": start, "teacher_start": teacher_start,
        "teacher_end": snapshot(t.c.teacher.only.model), "end": snapshot(t.c.student),
    }  # fmt: skip
    t.c.logger.close()
    reset_megatron()
    # an EMA: after each optimizer step, teacher = d * teacher + (1 - d) * student
    ema = ["teacher.weights=ema", "teacher.ema_decay=0.5", "checkpoint.save_interval=1", *hint]
    t = tiny_trainer(f"{root}/ema", context, *ema)
    before = snapshot(t.c.teacher.only.model)
    t.step()
    out["ema"] = {
        "before": before, "student": snapshot(t.c.student),
        "after": snapshot(t.c.teacher.only.model),
    }  # fmt: skip
    t.step()
    out["ema"]["after_two"] = snapshot(t.c.teacher.only.model)
    t.c.logger.close()
    reset_megatron()
    # resumed at step 1 (its checkpoint): the EMA teacher as it was then, not as initialised
    import shutil

    from megatron_gndpo.checkpoint.dist import write_latest

    shutil.rmtree(f"{root}/ema/checkpoints/iter_0000002")
    write_latest(f"{root}/ema/checkpoints", 1)
    t = tiny_trainer(f"{root}/ema", context, *ema)
    out["ema"]["resumed"] = snapshot(t.c.teacher.only.model)
    t.step()
    out["ema"]["resumed_two"] = snapshot(t.c.teacher.only.model)
    t.c.logger.close()
    reset_megatron()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("context")
    prompts = _prompt_file(root / "prompts.jsonl")
    [out] = run_distributed(_steps, 1, (str(root), str(prompts)), timeout_s=400)
    return dict(out)


@pytest.mark.distributed
@pytest.mark.megatron
def test_the_live_student_as_its_own_teacher_scores_zero(runs: dict[str, Any]) -> None:
    for step in runs["empty"]:
        assert step["score/mean"] == 0.0 and step["score/std"] == 0.0, step
        assert step["advantage/std"] == 0.0 or math.isclose(step["advantage/std"], 0.0)


@pytest.mark.distributed
@pytest.mark.megatron
def test_the_initial_weights_are_the_students_and_stay_frozen(runs: dict[str, Any]) -> None:
    r = runs["initial"]
    for name, value in r["teacher_start"].items():
        assert torch.equal(value, r["start"][name]), name
        assert torch.equal(r["teacher_end"][name], value), name  # frozen
    assert any(not torch.equal(r["end"][n], v) for n, v in r["start"].items())  # it trained
    assert all(s["score/std"] > 0 for s in r["steps"])  # the hint changes the teacher's view


@pytest.mark.distributed
@pytest.mark.megatron
def test_an_ema_teacher_follows_the_student_and_resumes_as_saved(runs: dict[str, Any]) -> None:
    r = runs["ema"]
    for name, before in r["before"].items():
        want = 0.5 * before + 0.5 * r["student"][name]
        torch.testing.assert_close(r["after"][name], want, rtol=0, atol=1e-6)
        assert torch.equal(r["resumed"][name], r["after"][name]), name
        assert torch.equal(r["resumed_two"][name], r["after_two"][name]), name


def _other_layout(rank: int, world: int, root: str, prompts: str) -> dict[str, Any]:
    """The student at DP=2; its initial weights saved as checkpoint.init at TP=1; the teacher,
    those weights at TP=2, with a hint."""
    from megatron_gndpo.checkpoint.dist import save_checkpoint

    t = tiny_trainer(f"{root}/init", f"data.train={prompts}")
    save_checkpoint(f"{root}/init_ckpt", 0, t.c.student)
    initial = snapshot(t.c.student)
    t.c.logger.close()
    reset_megatron()
    t = tiny_trainer(
        f"{root}/run", f"data.train={prompts}", f"checkpoint.init={root}/init_ckpt",
        "teacher.weights=initial", "teacher.parallel.tensor_parallel=2",
        "teacher.context.template='{hint} {prompt}'",
    )  # fmt: skip
    assert snapshot(t.c.student).keys() == initial.keys()
    return {"steps": [t.step() for _ in range(2)], "tp": t.c.teacher_groups.layout.tp}


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_context_teacher_at_another_layout_trains_the_student(tmp_path: Path) -> None:
    prompts = _prompt_file(tmp_path / "prompts.jsonl")
    results = run_distributed(_other_layout, 2, (str(tmp_path), str(prompts)), timeout_s=400)
    for r in results:
        assert r["tp"] == 2
        for step in r["steps"]:
            assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]), step
            assert step["score/std"] > 0, step


@pytest.mark.real
def test_a_real_chat_template_takes_the_system_prompt_and_the_earlier_turns() -> None:
    """SmolLM2's ChatML: the teacher's conversation is the template's rendering of the
    messages (system, each example exchange, the prompt), as transformers writes it."""
    from transformers import AutoTokenizer

    from megatron_gndpo.data.tokenizer import load_tokenizer
    from tests.real import real_model_dir

    path = real_model_dir()
    ours = load_tokenizer(str(path))
    turns = (("What is the capital of Italy?", "Rome"), ("The opposite of hot?", "cold"))
    got = ours.apply_chat_template("The plural of cat?", system="Answer briefly.", turns=turns)
    messages = [{"role": "system", "content": "Answer briefly."}]
    for user, answer in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": "The plural of cat?"})
    hf = AutoTokenizer.from_pretrained(path)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got == hf(text, add_special_tokens=False)["input_ids"]
    assert got != ours.apply_chat_template("The plural of cat?")  # the default system prompt


def test_with_several_teachers_each_prompt_needs_only_its_own_teachers_fields(
    tmp_path: Path,
) -> None:
    """Two teachers routed by a field, one with a context naming {hint}: the rows routed to the
    other need no hint; a row routed to the first without one fails naming it."""
    from megatron_gndpo.data.prompt_sets import PromptSets, encoded_prompts
    from megatron_gndpo.data.sampler import PromptSampler
    from megatron_gndpo.teacher.build import check_context_fields

    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "1 + 1 = ?", "answer": "2", "domain": "math", "hint": "two"},
        {"prompt": "2 + 2 = ?", "answer": "4", "domain": "code"},  # the other teacher's: no hint
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = (
        "hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4, num_query_groups: 2, "
        "vocab_size: 128, make_vocab_size_divisible_by: 64, max_position_embeddings: 96, "
        "params_dtype: fp32, num_layers: 2"
    )
    teachers = (
        f"teachers=[{{name: math, model: {{{model}}}, context: {{template: '{{hint}} "
        f"{{prompt}}'}}}}, {{name: code, model: {{{model}}}}}]"
    )
    two = TINY.parent / "tiny_cpu_two_teachers.yaml"
    cfg = load_config(
        two,
        [teachers, f"data.train={path}", "data.teacher_key=domain", "data.default_teacher=math"],
    )
    validate(cfg, 1)
    train, _ = encoded_prompts(cfg, str(path), CharTokenizer())
    assert train[0].example.field("hint") == "two" and train[1].example.field("hint") is None

    def sets(prompts: list[EncodedPrompt]) -> PromptSets:
        sampler = PromptSampler(len(prompts), prompts_per_step=1, dp_rank=0, dp_size=1, seed=0)
        return PromptSets(prompts, sampler, [], 0)

    check_context_fields(cfg, sets(train))  # the code row needs no hint
    example = PromptExample("3 + 3 = ?", "6", 0, where="p.jsonl:3", source="math")
    missing = [EncodedPrompt(example, [])]
    with pytest.raises(DataError, match=r"p\.jsonl:3: teachers\[0\]\.context names \{hint\}"):
        check_context_fields(cfg, sets(missing))
