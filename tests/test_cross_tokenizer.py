"""Cross-tokenizer distillation (docs/methods/cross_tokenizer.md): the span math, the alignment
on real tokenizer pairs, the teacher's rows, the config's refusals, and the trainer on 2 ranks
with teacher and student differing in tokenizer and layout.

Tokenizers: the built-in character tokenizer; the demo's SentencePiece (trained here on the
chains task, no byte fallback, its normaliser collapses whitespace); a SentencePiece with byte
fallback; the real SmolLM2 tokenizer (byte-level BPE, ChatML; ``real`` tests skip without it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.algorithms.cross_tokenizer import (
    alignment_metrics,
    span_sums,
    span_teacher_logprobs,
)
from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.config.schema import AlgorithmConfig
from megatron_gndpo.data import alignment as al
from megatron_gndpo.data.tokenizer import CharTokenizer, SentencePieceTokenizer, load_tokenizer
from megatron_gndpo.engine.scoring import Scores
from megatron_gndpo.methods import StepBatch, build_method
from megatron_gndpo.teacher.cross_tokenizer import NO_SPAN, CrossTokenizer, TeacherTokenizer
from tests.harness import run_distributed
from tests.real import real_model_dir
from tests.trainers import TINY, reset_megatron, snapshot, tiny_trainer

TEXTS = {
    "digits": "12345 + 6789 = 19134, so \\boxed{19134}",
    "whitespace": "a  b\n\n  c\td   ",
    "unicode": "héllo wörld ñ",
    "cjk_emoji": "世界 🙂 ok",
    "chain": "3 + 5 = 8, 8 + 9 = 17, 17 + 9 = 26, so \\boxed{26}",
}


# ---------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> SentencePieceTokenizer:
    """The demo's tokenizer (demo/tokenizer.py) on a small chains corpus."""
    from megatron_gndpo.data.tasks import chains
    from megatron_gndpo.demo.tokenizer import task_corpus, train_tokenizer

    problems = chains.generate(600, seed=3, difficulty=chains.DEFAULT_DIFFICULTY)
    corpus = task_corpus((p.prompt, p.solution) for p in problems)
    return train_tokenizer(tmp_path_factory.mktemp("sp"), corpus)


@pytest.fixture(scope="module")
def sp_bytes(tmp_path_factory: pytest.TempPathFactory) -> SentencePieceTokenizer:
    """A SentencePiece with byte fallback: characters it never saw become <0xNN> pieces."""
    import sentencepiece as spm

    from megatron_gndpo.data.tasks import chains

    prefix = tmp_path_factory.mktemp("spb") / "bytes"
    lines = [p.solution for p in chains.generate(400, seed=5)] + ["hello world"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=320,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, pad_id=0, bos_id=1,
        eos_id=2, unk_id=3, num_threads=1, minloglevel=2, hard_vocab_limit=False,
    )  # fmt: skip
    return SentencePieceTokenizer(prefix.with_suffix(".model"))


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer(str(real_model_dir()))


def _tokenizer(name: str, request: pytest.FixtureRequest) -> Any:
    return CharTokenizer() if name == "char" else request.getfixturevalue(name)


def _names(*names: str) -> list[Any]:
    """Parameters naming tokenizers; those with SmolLM2's are marked ``real``."""
    return [
        pytest.param(*n, marks=pytest.mark.real) if "smollm2" in n else pytest.param(*n)
        for n in (x if isinstance(x, tuple) else (x,) for x in names)
    ]


def _spans_hold_the_same_text(
    s_text: str, s_ends: list[int], t_text: str, t_ends: list[int], a: al.Alignment
) -> None:
    """Kept spans are ordered, disjoint runs of tokens whose texts are equal on both sides."""
    last_s = last_t = 0
    for (a0, b0), (c0, d0) in a.spans:
        assert last_s <= a0 < b0 and last_t <= c0 < d0
        s_from = s_ends[a0 - 1] if a0 else 0
        t_from = t_ends[c0 - 1] if c0 else 0
        assert s_text[s_from : s_ends[b0 - 1]] == t_text[t_from : t_ends[d0 - 1]]
        last_s, last_t = b0, d0
    kept = sum(b0 - a0 for (a0, b0), _ in a.spans)
    assert kept + a.dropped_tokens == len(s_ends)


# ---------------------------------------------------------------------------- the span math


def _spans(*lengths: int, width: int | None = None) -> torch.Tensor:
    """One row's span ids for spans of the given token counts (then -1 padding)."""
    ids = [j for j, n in enumerate(lengths) for _ in range(n)]
    width = width or len(ids)
    return torch.tensor([ids + [NO_SPAN] * (width - len(ids))])


def test_one_to_one_spans_give_the_teachers_own_log_probs_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    lt = -torch.rand(3, 7, generator=g) * 4
    lo = -torch.rand(3, 7, generator=g) * 4
    span = torch.arange(7).repeat(3, 1)
    span[:, :2] = NO_SPAN  # the prompt
    lt_s, scored = span_teacher_logprobs(lt, span, lo, span)
    assert torch.equal(lt_s[:, 2:], lt[:, 2:]) and torch.equal(scored, span >= 0)
    assert torch.equal(lt_s[:, :2], torch.zeros(3, 2))


def test_every_token_of_a_span_takes_the_spans_whole_score() -> None:
    # student: spans of 2, 1, 3 tokens; teacher: 1, 2, 1 tokens of the same three spans
    lo = torch.tensor([[-1.0, -0.5, -2.0, -0.1, -0.2, -0.3, 0.0]])
    lt = torch.tensor([[-1.2, -0.7, -0.4, -0.9, float("nan")]])  # NaN outside every span
    lt_s, scored = span_teacher_logprobs(lt, _spans(1, 2, 1, width=5), lo, _spans(2, 1, 3, width=7))
    score = (lt_s - lo)[scored]
    want = torch.tensor([-1.2 + 1.5] * 2 + [-1.1 + 2.0] + [-0.9 + 0.6] * 3)
    torch.testing.assert_close(score, want, atol=1e-6, rtol=0)
    assert scored.tolist() == [[True] * 6 + [False]]
    # the sequence total: every span once is log p_T(text) - log p_S(text)
    spans = span_sums(lt_s - lo, _spans(2, 1, 3, width=7), 3)
    torch.testing.assert_close(spans.sum(), torch.tensor(0.3 * 2 + 0.9 + -0.3 * 3).double())


@pytest.mark.parametrize("estimator", ["gndpo", "opd", "mix"])
def test_methods_on_one_to_one_spans_equal_the_same_tokenizer_path(estimator: str) -> None:
    g = torch.Generator().manual_seed(1)
    lt, lo = -torch.rand(4, 9, generator=g) * 6, -torch.rand(4, 9, generator=g) * 6
    mask = torch.zeros(4, 9, dtype=torch.bool)
    for i, (a, b) in enumerate([(3, 9), (3, 6), (2, 8), (4, 5)]):
        mask[i, a:b] = True
    span = torch.where(mask, torch.arange(9).repeat(4, 1), NO_SPAN)
    lt_s, scored = span_teacher_logprobs(lt, span, lo, span)
    cfg = AlgorithmConfig(estimator=estimator, outcome_weight=0.5)
    method, rewards = build_method(cfg), torch.tensor([1.0, 0.0, 1.0, 1.0])

    def advantages(teacher: torch.Tensor, scored_mask: torch.Tensor | None) -> torch.Tensor:
        batch = StepBatch(
            Scores(teacher), Scores(lo), mask, rewards, group_size=2, group=None, step=1,
            scored_mask=scored_mask,
        )  # fmt: skip
        return method.targets(batch)[0].advantages

    assert method.scores_spans
    assert torch.equal(advantages(lt_s, scored), advantages(lt, None))


def test_a_dropped_span_takes_no_part_in_the_statistics() -> None:
    lo = torch.tensor([[-1.0, -2.0, -3.0, -1.5]])
    lt = torch.tensor([[-0.5, -1.0, -9.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    span = torch.tensor([[0, 1, NO_SPAN, 2]])  # the third token: a dropped span
    lt_s, scored = span_teacher_logprobs(lt, span, lo, span)
    method = build_method(AlgorithmConfig(estimator="gndpo"))
    batch = StepBatch(Scores(lt_s), Scores(lo), mask, None, group_size=1, group=None, step=1,
                      scored_mask=scored)  # fmt: skip
    a = method.targets(batch)[0].advantages
    assert a[0, 2] == 0.0
    kept = a[scored]
    assert abs(float(kept.mean())) < 1e-6 and float(kept.std()) == pytest.approx(1.0, abs=1e-5)


def test_a_batch_without_any_aligned_span_scores_nothing() -> None:
    """Issue 48, probe 7: with rollout.max_response_length=1 a batch may hold no aligned span at
    all (span ids all -1): ``index 0 is out of bounds`` at step 2. Nothing is scored, and the
    metrics say so (the trainer skips such a step: ``xtok/aligned_tokens`` under 2)."""
    lo, lt = -torch.rand(2, 3), -torch.rand(2, 4)
    s_span, t_span = torch.full((2, 3), NO_SPAN), torch.full((2, 4), NO_SPAN)
    lt_s, scored = span_teacher_logprobs(lt, t_span, lo, s_span)
    assert torch.equal(lt_s, torch.zeros(2, 3)) and not scored.any()
    mask = torch.ones(2, 3, dtype=torch.bool)
    m = alignment_metrics(lt, t_span, lo, s_span, mask, {"teacher_tokens": 0.0})
    assert (m["xtok/aligned_frac"], m["xtok/aligned_tokens"], m["xtok/span_kl"]) == (0, 0, 0)


def test_alignment_metrics_by_hand() -> None:
    lo = torch.tensor([[0.0, -1.0, -0.5, -2.0, -0.1, 0.0]])
    s_span = torch.tensor([[NO_SPAN, 0, 0, 1, 2, NO_SPAN]])
    lt = torch.tensor([[0.0, -1.0, -1.5, -0.4, -0.3]])
    t_span = torch.tensor([[NO_SPAN, 0, 1, 2, 2]])
    mask = torch.tensor([[False, True, True, True, True, True]])  # the last: dropped
    counts = {"spans_dropped": 1.0, "teacher_tokens": 4.0, "truncated_rows": 0.0}
    m = alignment_metrics(lt, t_span, lo, s_span, mask, counts)
    kl = [(-1.5) - (-1.0), -2.0 - (-1.5), -0.1 - (-0.7)]  # L_j - T_j
    assert m["xtok/aligned_frac"] == pytest.approx(4 / 5)
    assert m["xtok/one_to_one_frac"] == pytest.approx(1 / 5)
    assert (m["xtok/span_max_student"], m["xtok/span_max_teacher"]) == (2.0, 2.0)
    assert m["xtok/span_kl"] == pytest.approx(sum(kl) / 3)
    assert m["xtok/kl_per_token"] == pytest.approx(sum(kl) / 4)
    assert m["xtok/spans_dropped"] == 1.0
    assert m["xtok/teacher_tokens_per_student"] == pytest.approx(4 / 5)


# ---------------------------------------------------------------------------- the alignment


def test_align_cuts_where_both_sides_end_a_token() -> None:
    text = "12 + 345"
    a = al.align(
        text, [1, 2, 4, 6, 8], text, [2, 4, 8]
    )  # "1" "2" " +" " 3" "45" | "12" " +" " 345"
    assert a.spans == (((0, 2), (0, 1)), ((2, 3), (1, 2)), ((3, 5), (2, 3)))
    assert (a.dropped_spans, a.dropped_tokens) == (0, 0)
    # a teacher that wrote the text otherwise (a collapsed space): that span is dropped
    b = al.align("a  b c", [1, 3, 4, 6], "a b c", [1, 3, 5])
    assert b.spans == (((0, 1), (0, 1)), ((3, 4), (2, 3)))
    assert (b.dropped_spans, b.dropped_tokens) == (1, 2)


def test_offset_ends_close_a_split_character_on_its_last_token() -> None:
    # "a世" written as "a", then 世 in two byte-level tokens sharing the offsets (1, 2)
    assert al.offset_ends([(0, 1), (1, 2), (1, 2)], 2) == [1, 1, 2]


@pytest.mark.parametrize("name", _names("char", "sp", "sp_bytes", "smollm2"))
def test_incremental_decoding_equals_the_exact_reading(
    name: str, request: pytest.FixtureRequest
) -> None:
    tok = _tokenizer(name, request)
    rng = torch.Generator().manual_seed(7)
    samples = [tok.encode(t) for t in TEXTS.values()]
    # sampled ids are not the tokenizer's own encoding: random ids, specials included
    samples += [torch.randint(0, tok.vocab_size, (40,), generator=rng).tolist() for _ in range(5)]
    for ids in samples:
        text, ends = al.decoded_ends(tok.decode, ids)
        assert ends == al._prefix_ends(tok.decode, ids, text)
        assert ends == sorted(ends) and (not ends or ends[-1] == len(text))


@pytest.mark.real
def test_offsets_agree_with_decoding(smollm2: Any) -> None:
    for text in TEXTS.values():
        ids, decoded, ends = al.encode_ends(smollm2, text)
        assert decoded == text and ids == smollm2.encode(text)
        assert ends == al.decoded_ends(smollm2.decode, ids)[1]


PAIRS = _names(
    ("smollm2", "sp"), ("smollm2", "char"), ("sp", "smollm2"), ("char", "smollm2"),
    ("sp", "char"), ("char", "sp"), ("sp_bytes", "char"), ("smollm2", "sp_bytes"),
)  # fmt: skip


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_real_pairs_align(student: str, teacher: str, request: pytest.FixtureRequest) -> None:
    s_tok, t_tok = _tokenizer(student, request), _tokenizer(teacher, request)
    for name, source in TEXTS.items():
        s_text, s_ends = al.decoded_ends(s_tok.decode, s_tok.encode(source))
        _, t_text, t_ends = al.encode_ends(t_tok, s_text)
        a = al.align(s_text, s_ends, t_text, t_ends)
        _spans_hold_the_same_text(s_text, s_ends, t_text, t_ends, a)
        if s_text == t_text:  # both reproduce the text: nothing is dropped
            assert a.dropped_tokens == 0, (name, s_text)
        if name in ("digits", "chain") and "char" not in (student, teacher):
            assert a.dropped_tokens == 0 and len(a.spans) >= 5, name


@pytest.mark.real
def test_what_each_pair_drops(sp: Any, request: pytest.FixtureRequest) -> None:
    """Whitespace runs do not survive the demo's SentencePiece (its normaliser collapses them),
    characters out of the vocabulary become unknown, and a byte-level character split over
    tokens is one span."""
    char = CharTokenizer()
    text = "a  b"
    s_text, s_ends = al.decoded_ends(char.decode, char.encode(text))
    _, t_text, t_ends = al.encode_ends(sp, s_text)
    a = al.align(s_text, s_ends, t_text, t_ends)
    assert t_text != s_text and a.dropped_tokens > 0
    smol = _tokenizer("smollm2", request)
    # "x" "Ġ" "ä¸" "ĸ" "Ġy": 世 in two byte-level tokens; the character tokenizer writes it
    # <unk>, which decodes to a replacement character that (as an incomplete character would)
    # joins the next one: the span "世 y" differs and is dropped
    s_text, s_ends = al.decoded_ends(smol.decode, smol.encode("x 世 y"))
    _, t_text, t_ends = al.encode_ends(char, s_text)
    a = al.align(s_text, s_ends, t_text, t_ends)
    assert [s for s, _ in a.spans] == [(0, 1), (1, 2)] and a.dropped_spans == 1
    assert a.dropped_tokens == 3
    a = al.align(s_text, s_ends, *al.encode_ends(smol, s_text)[1:])  # itself: 世 is 2:2
    assert [(s, t) for s, t in a.spans if s[1] - s[0] > 1] == [((2, 4), (2, 4))]


@pytest.mark.parametrize("name", _names("char", "sp", "sp_bytes", "smollm2"))
def test_the_same_tokenizer_on_its_own_encoding_is_all_one_to_one(
    name: str, request: pytest.FixtureRequest
) -> None:
    tok = _tokenizer(name, request)
    text = TEXTS["chain"]
    s_text, s_ends = al.decoded_ends(tok.decode, tok.encode(text))
    a = al.align(s_text, s_ends, *al.encode_ends(tok, s_text)[1:])
    assert all(b - a0 == 1 and d - c == 1 for (a0, b), (c, d) in a.spans)
    assert len(a.spans) == len(s_ends)


# ---------------------------------------------------------------------------- the teacher's rows


def _rollout(tok: Any, prompt: str, responses: list[list[int]], finished: list[bool]) -> Any:
    from megatron_gndpo.rollout.base import Rollout

    head = tok.apply_chat_template(prompt)
    rows = [head + r for r in responses]
    width = max(map(len, rows)) + 2
    tokens = torch.full((len(rows), width), tok.pad_id)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    n = len(rows)
    return Rollout(
        tokens, torch.full((n,), len(head)), torch.tensor(list(map(len, rows))),
        torch.zeros(n, width), torch.zeros(n, dtype=torch.long), torch.tensor(finished),
    )  # fmt: skip


def _prompt(text: str) -> Any:
    from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample

    return EncodedPrompt(PromptExample(text, None, 0), [])


@pytest.mark.real
def test_rows_pair_the_stop_tokens_and_leave_each_template_alone(
    sp: Any, request: pytest.FixtureRequest
) -> None:
    """An SP student (BOS + "Q: ... A: ") and the SmolLM2 teacher (ChatML): each side's prompt
    is its own template, only in no span; the student's EOS is paired with the teacher's
    <|im_end|>; a special token the student sampled inside its response (its BOS) adds no text
    and joins the next character's span; a truncated response has no stop-token span."""
    smol = _tokenizer("smollm2", request)
    solution = "3 + 5 = 8, so \\boxed{8}"
    ids = sp.encode(solution)
    with_bos = [*ids[:3], 1, *ids[3:]]
    responses = [[*ids, sp.eos_id], with_bos, ids[:4]]
    rollout = _rollout(sp, "3 + 5 = ?", responses, [True, True, False])
    cross = CrossTokenizer(sp, [TeacherTokenizer(smol, same=False, max_length=512)])
    rows = cross.rows(rollout, [_prompt("3 + 5 = ?")], torch.zeros(3, dtype=torch.long))
    head = smol.apply_chat_template("3 + 5 = ?")
    start = int(rollout.prompt_lengths[0])
    for i in range(3):
        t = rows.tokens[i, : rows.lengths[i]].tolist()
        assert t[: len(head)] == head and (rows.teacher_span[i, : len(head)] == NO_SPAN).all()
        assert (rows.student_span[i, :start] == NO_SPAN).all()
    first = rows.tokens[0, : rows.lengths[0]].tolist()
    assert first == [*head, *smol.encode(solution), smol.eos_id]
    last_s, last_t = int(rollout.lengths[0]) - 1, int(rows.lengths[0]) - 1
    assert (
        rows.student_span[0, last_s] == rows.teacher_span[0, last_t] == rows.student_span[0].max()
    )
    assert (rows.student_span[0, start : last_s + 1] >= 0).all()  # every token in a span
    bos_at = start + 3
    assert rows.student_span[1, bos_at] == rows.student_span[1, bos_at + 1] >= 0
    assert rows.tokens[2, rows.lengths[2] - 1] != smol.eos_id  # cut short: no EOS added
    assert rows.counts["spans_dropped"] == 0
    # the teacher's model takes fewer positions: the row is cut, its later spans dropped
    short = CrossTokenizer(sp, [TeacherTokenizer(smol, same=False, max_length=len(head) + 4)])
    cut = short.rows(rollout, [_prompt("3 + 5 = ?")], torch.zeros(3, dtype=torch.long))
    assert int(cut.lengths.max()) == len(head) + 4 and cut.counts["truncated_rows"] == 3
    assert int((cut.teacher_span >= 0).sum()) <= 3 * 4


def test_re_encoding_a_canonical_response_rebuilds_the_students_own_row(sp: Any) -> None:
    """The full path (decode, re-encode in the teacher's template, align) with the student's
    own tokenizer on its own encoding gives the identity: the same row, every token 1:1."""
    for tok in (CharTokenizer(), sp):
        solution = TEXTS["chain"]
        rollout = _rollout(tok, "3 + 5 = ?", [[*tok.encode(solution), tok.eos_id]], [True])
        prompts, routes = [_prompt("3 + 5 = ?")], torch.zeros(1, dtype=torch.long)
        full = CrossTokenizer(tok, [TeacherTokenizer(tok, same=False, max_length=512)])
        same = CrossTokenizer(tok, [TeacherTokenizer(tok, same=True, max_length=512)])
        a, b = full.rows(rollout, prompts, routes), same.rows(rollout, prompts, routes)
        n = int(rollout.lengths[0])
        assert torch.equal(a.tokens[0, :n], rollout.tokens[0, :n])
        assert torch.equal(a.student_span, b.student_span)
        assert torch.equal(a.teacher_span[:, :n], b.teacher_span[:, :n])


def test_each_row_goes_to_its_own_teachers_tokens(sp: Any) -> None:
    """Several teachers (``teachers:``), one on the student's tokenizer and one on its own: each
    row is built for the teacher it is routed to, padded with that teacher's padding id."""
    char = CharTokenizer()
    solution = TEXTS["chain"]
    rollout = _rollout(char, "3 + 5 = ?", [[*char.encode(solution), char.eos_id]] * 2, [True] * 2)
    teachers = [TeacherTokenizer(char, same=True, max_length=512),
                TeacherTokenizer(sp, same=False, max_length=512)]  # fmt: skip
    rows = CrossTokenizer(char, teachers).rows(
        rollout, [_prompt("3 + 5 = ?")], torch.tensor([0, 1])
    )
    n = int(rollout.lengths[0])
    assert torch.equal(rows.tokens[0, :n], rollout.tokens[0, :n])
    own = [*sp.apply_chat_template("3 + 5 = ?"), *sp.encode(solution), sp.eos_id]
    assert rows.tokens[1, : rows.lengths[1]].tolist() == own
    assert (rows.tokens[1, rows.lengths[1] :] == sp.pad_id).all()
    assert int(rows.student_span[1].max()) + 1 == len(sp.encode(solution)) + 1  # + the EOS


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.estimator=vopd"], "top-k ids or a full-vocabulary KL"),
        (["algorithm.estimator=tgpo"], "own top-k ids"),
        (["algorithm.estimator=tropd", "algorithm.tropd.prefix_share_start=0.5"],
         "teacher-written prefixes"),
        (["algorithm.estimator=mix", "algorithm.distill_estimator=vopd",
          "algorithm.outcome_weight=0.5"], "top-k ids or a full-vocabulary KL"),
        (["teacher.server={url: 'http://127.0.0.1:9'}"], "a served teacher scores the student"),
    ],
)  # fmt: skip
def test_what_cannot_be_right_across_tokenizers_is_refused(
    overrides: list[str], message: str
) -> None:
    cfg = load_config(TINY, ["teacher.cross_tokenizer=true", *overrides])
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert "teacher.cross_tokenizer" in str(err.value)


@pytest.mark.parametrize("estimator", ["gndpo", "opd", "grpo", "mix"])
def test_the_span_methods_validate(estimator: str) -> None:
    extra = ["algorithm.outcome_weight=0.5"] if estimator == "mix" else []
    validate(load_config(TINY, ["teacher.cross_tokenizer=true", f"algorithm.estimator={estimator}",
                                "data.train=builtin:arithmetic", *extra]))  # fmt: skip


def test_another_tokenizer_without_the_switch_names_it(sp: Any) -> None:
    from megatron_gndpo.teacher.build import teacher_tokenizers

    path = str(Path(sp._path))
    cfg = load_config(TINY, [f"teacher.tokenizer={path}"])
    with pytest.raises(ConfigError, match=r"teacher.cross_tokenizer=true"):
        teacher_tokenizers(cfg, CharTokenizer())
    cfg = load_config(TINY, [f"teacher.tokenizer={path}", "teacher.cross_tokenizer=true"])
    tokenizers, cross = teacher_tokenizers(cfg, CharTokenizer())
    assert (
        cross is not None
        and not cross.teachers[0].same
        and tokenizers[0].vocab_size == sp.vocab_size
    )


# ---------------------------------------------------------------------------- the trainer, 2 ranks


def _trainer_runs(rank: int, world: int, run_dir: str, sp_model: str) -> dict[str, Any]:
    """On 2 ranks, the student at DP=2, the teacher at TP=2: the same step without and with
    ``cross_tokenizer`` on the student's own tokenizer, and two steps with the teacher on the
    demo's SentencePiece tokenizer."""
    teacher_tp2 = ["teacher.parallel.tensor_parallel=2"]
    out: dict[str, Any] = {}
    for name, extra in (
        ("same", []),
        ("same_cross", ["teacher.cross_tokenizer=true"]),
        ("cross", ["teacher.cross_tokenizer=true", f"teacher.tokenizer={sp_model}"]),
    ):
        trainer = tiny_trainer(f"{run_dir}/{name}", *teacher_tp2, *extra)
        prompts = trainer._next_prompts()
        rollout = trainer._sample(prompts)
        routes = trainer.c.teacher.routes(prompts, rollout.prompt_index)
        both = trainer.c.scorer.score(rollout, prompts, routes, trainer.method)
        teacher, student, scored, metrics = both.teacher, both.student, both.scored, both.metrics
        targets, found = trainer._targets(rollout, both, None, routes)
        before = snapshot(trainer.c.student)
        steps = [trainer.step() for _ in range(2)]  # no checkpoint (save_interval 0)
        after = snapshot(trainer.c.student)
        out[name] = {
            "tokens": rollout.tokens, "mask": rollout.response_mask, "teacher": teacher.logprobs,
            "old": student.logprobs, "scored": scored, "advantages": targets.advantages,
            "metrics": metrics | found, "steps": steps,
            "changed": [n for n in before if not torch.equal(before[n], after[n])],
            "params": list(before),
        }  # fmt: skip
        if name == "cross":
            rows = trainer.c.cross.rows(rollout, prompts, routes)
            own = trainer.c.teacher.score_batch(rows.tokens, rows.lengths, routes=routes)
            out[name] |= {"rows": rows, "own": own.logprobs}
        reset_megatron()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sp: Any) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("xtok")
    return run_distributed(_trainer_runs, 2, (str(root), str(sp._path)), timeout_s=400)


@pytest.mark.distributed
@pytest.mark.megatron
def test_the_same_tokenizer_through_the_cross_path_gives_the_same_advantages(
    runs: list[dict[str, Any]],
) -> None:
    for rank in runs:
        same, cross = rank["same"], rank["same_cross"]
        assert torch.equal(same["tokens"], cross["tokens"])
        assert torch.equal(same["advantages"], cross["advantages"])
        assert torch.equal(cross["scored"], same["mask"])
        assert cross["metrics"]["xtok/one_to_one_frac"] == 1.0
        for a, b in zip(same["steps"], cross["steps"], strict=True):
            assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


@pytest.mark.distributed
@pytest.mark.megatron
def test_a_teacher_with_another_tokenizer_and_layout_trains_the_student(
    runs: list[dict[str, Any]],
) -> None:
    metrics = [rank["cross"]["metrics"] for rank in runs]
    assert metrics[0] == metrics[1]  # global over the data-parallel ranks
    m = metrics[0]
    assert 0 < m["xtok/aligned_frac"] <= 1 and m["xtok/teacher_tokens_per_student"] > 0
    assert math.isfinite(m["xtok/span_kl"]) and math.isfinite(m["score/mean"])
    for rank in runs:
        r = rank["cross"]
        assert r["changed"] == r["params"]  # every parameter moved
        assert all(math.isfinite(s["loss"]) and "xtok/span_kl" in s for s in r["steps"])
        # lt' - lo on every token of a span is the span's score, from the teacher's own rows
        rows, lo, lt = r["rows"], r["old"], r["teacher"]
        for i in range(lo.shape[0]):
            for j in range(int(rows.student_span[i].max()) + 1):
                s_at, t_at = rows.student_span[i] == j, rows.teacher_span[i] == j
                want = float(r["own"][i][t_at].double().sum() - lo[i][s_at].double().sum())
                got = (lt[i][s_at] - lo[i][s_at]).double()
                torch.testing.assert_close(got, torch.full_like(got, want), atol=1e-5, rtol=0)
        assert torch.equal(r["scored"], (rows.student_span >= 0) & r["mask"])


@pytest.mark.megatron
def test_a_step_whose_responses_do_not_align_is_skipped_and_said(sp: Any, tmp_path: Path) -> None:
    """Issue 48, probe 7, end to end: one-token answers under the demo's tokenizer; step 2's
    batch has no aligned span (deterministic at this seed). Before: a RuntimeError traceback."""
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_gndpo.cli", "train", "-c", str(TINY),
         f"logging.run_dir={tmp_path / 'run'}", "teacher.cross_tokenizer=true",
         f"teacher.tokenizer={sp._path}", "rollout.max_response_length=1", "trainer.steps=2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        "megatron-gndpo: warning: step 2 skipped: only 0 response tokens of the batch align "
        "with the teacher's tokens" in proc.stderr
    ), proc.stderr[-3000:]
