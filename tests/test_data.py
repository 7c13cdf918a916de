"""Tests of megatron_gndpo.data: tokenizers, prompt loading and encoding, the prompt sampler.

Every tokenizer is built in the test (a SentencePiece model trained on a generated corpus, a
Hugging Face tokenizer assembled from ``tokenizers`` parts); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

from megatron_gndpo.data import (
    BUILTIN_DATASETS,
    CharTokenizer,
    EncodedPrompt,
    HFTokenizer,
    PromptExample,
    PromptSampler,
    SentencePieceTokenizer,
    Tokenizer,
    encode_prompts,
    load_prompts,
    load_tokenizer,
    vocabulary_fingerprint,
)
from megatron_gndpo.data.tasks import arithmetic

# ============================================================================ tokenizers


def test_char_tokenizer_vocabulary_layout() -> None:
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 100 < 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode(" ") == [4]
    assert tok.encode("~") == [98]
    assert tok.encode("\n") == [99]
    assert tok.encode("é\t") == [3, 3]  # outside the vocabulary -> <unk>


def test_char_tokenizer_round_trip_and_decode_drops_specials() -> None:
    tok = CharTokenizer()
    text = "What is 23 + 58?\nAnswer: \\boxed{81} ~!@#$%^&*()_{}|"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # A response with EOS and right padding decodes to its text.
    assert tok.decode([*tok.encode("81"), tok.eos_id, tok.pad_id, tok.pad_id]) == "81"
    assert tok.decode([tok.bos_id, 3]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the character vocabulary"):
        tok.decode([100])


def test_char_tokenizer_chat_template() -> None:
    tok = CharTokenizer()
    ids = tok.apply_chat_template("What is 1 + 1?")
    assert ids[0] == tok.bos_id
    assert ids[1:] == tok.encode("Q: What is 1 + 1?\nA: ")
    assert tok.decode(ids) == "Q: What is 1 + 1?\nA: "


def test_fingerprint_depends_only_on_the_vocabulary() -> None:
    assert CharTokenizer().fingerprint() == CharTokenizer().fingerprint()
    assert vocabulary_fingerprint(["a", "b"]) == vocabulary_fingerprint(("a", "b"))
    assert vocabulary_fingerprint(["a", "b"]) != vocabulary_fingerprint(["b", "a"])
    assert vocabulary_fingerprint(["a", "b"]) != vocabulary_fingerprint(["a", "b", "c"])
    assert vocabulary_fingerprint(["a", None]) != vocabulary_fingerprint(["a", "None"])
    assert len(CharTokenizer().fingerprint()) == 64  # sha256 hex


# ---------------------------------------------------------------------------- sentencepiece


def _train_sentencepiece(directory: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["what", "is", "the", "answer", "sum", "of", "and", "plus", "minus", "number"]
    lines = [
        " ".join(rng.choice(words) for _ in range(8)) + f" {rng.randint(0, 999)}?"
        for _ in range(400)
    ]
    prefix = directory / f"sp{vocab_size}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("sentencepiece")
    return _train_sentencepiece(directory, 64), _train_sentencepiece(directory, 72)


def test_sentencepiece_tokenizer(sp_models: tuple[Path, Path]) -> None:
    model, _ = sp_models
    tok = load_tokenizer(str(model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 64
    assert (tok.pad_id, tok.eos_id) == (0, 2)
    text = "what is the sum of 12 and 7?"
    ids = tok.encode(text)
    assert ids and all(0 <= i < 64 for i in ids)
    assert 1 not in ids and 2 not in ids  # no BOS/EOS added by encode
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    chat = tok.apply_chat_template("what is 5?")
    assert chat[0] == 1  # BOS
    assert chat[1:] == tok.encode("Q: what is 5?\nA: ")


def test_sentencepiece_fingerprint(sp_models: tuple[Path, Path]) -> None:
    small, larger = sp_models
    assert (
        SentencePieceTokenizer(small).fingerprint() == SentencePieceTokenizer(small).fingerprint()
    )
    assert (
        SentencePieceTokenizer(small).fingerprint() != SentencePieceTokenizer(larger).fingerprint()
    )
    assert SentencePieceTokenizer(small).fingerprint() != CharTokenizer().fingerprint()


def test_sentencepiece_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.model does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))


# ---------------------------------------------------------------------------- hugging face


def _save_hf_tokenizer(
    directory: Path, tokens: list[str], *, chat_template: str | None, eos: str | None = "</s>"
) -> Path:
    """A character-level WordLevel tokenizer over ``tokens`` (ids in list order), saved."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token=eos, pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return directory


_CHAR_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)] + ["\n"]
_TEMPLATE = (
    "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "templated": _save_hf_tokenizer(root / "templated", _CHAR_TOKENS, chat_template=_TEMPLATE),
        "plain": _save_hf_tokenizer(root / "plain", _CHAR_TOKENS, chat_template=None),
        "extended": _save_hf_tokenizer(
            root / "extended", [*_CHAR_TOKENS, "<extra>"], chat_template=None
        ),
    }


def test_hf_tokenizer_round_trip(hf_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(str(hf_dirs["templated"]))
    assert isinstance(tok, HFTokenizer)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 100
    assert (tok.eos_id, tok.pad_id) == (2, 0)
    text = "What is 23 + 58?"
    ids = tok.encode(text)
    # Same vocabulary as the built-in tokenizer, so the same ids.
    assert ids == CharTokenizer().encode(text)
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text


def test_hf_tokenizer_chat_template(hf_dirs: dict[str, Path]) -> None:
    templated = HFTokenizer(hf_dirs["templated"])
    assert templated.has_chat_template
    ids = templated.apply_chat_template("hi")
    assert ids[0] == 1  # <s> from the template, not added twice
    assert ids[1:] == templated.encode("[user] hi\n[assistant] ")
    plain = HFTokenizer(hf_dirs["plain"])
    assert not plain.has_chat_template
    assert plain.apply_chat_template("hi") == plain.encode("hi")


def test_hf_fingerprint_matches_equal_vocabularies_across_classes(
    hf_dirs: dict[str, Path],
) -> None:
    templated = HFTokenizer(hf_dirs["templated"]).fingerprint()
    # The chat template is not part of the vocabulary; the same ids for the same strings
    # give the same fingerprint whichever class loaded them.
    assert templated == HFTokenizer(hf_dirs["plain"]).fingerprint()
    assert templated == CharTokenizer().fingerprint()
    assert templated != HFTokenizer(hf_dirs["extended"]).fingerprint()


def test_hf_tokenizer_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds none of tokenizer\.json"):
        HFTokenizer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer(tmp_path / "nowhere")
    no_eos = _save_hf_tokenizer(tmp_path / "no_eos", _CHAR_TOKENS, chat_template=None, eos=None)
    with pytest.raises(ValueError, match="has no eos_token"):
        HFTokenizer(no_eos)


def test_load_tokenizer_forms(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), CharTokenizer)
    assert isinstance(load_tokenizer("builtin:char"), CharTokenizer)
    with pytest.raises(ValueError, match="unknown built-in tokenizer 'builtin:bytes'"):
        load_tokenizer("builtin:bytes")
    with pytest.raises(FileNotFoundError, match=r"SentencePiece '\.model' file"):
        load_tokenizer(str(tmp_path / "nothing_here"))
    other = tmp_path / "vocab.txt"
    other.write_text("a\n")
    with pytest.raises(ValueError, match="cannot tell which tokenizer"):
        load_tokenizer(str(other))


# ============================================================================ prompt sets


def _write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_load_jsonl(tmp_path: Path) -> None:
    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}),
            "",  # blank lines are not records
            json.dumps({"prompt": "Say hi", "extra": 1}),
            json.dumps({"prompt": "What is 1/2?", "answer": 0.5}),
            json.dumps({"prompt": "Ünïcode ✓", "answer": None}),
        ],
    )
    examples = load_prompts(spec)
    assert examples == [
        PromptExample("What is 2 + 2?", "4", 0),
        PromptExample("Say hi", None, 1),
        PromptExample("What is 1/2?", "0.5", 2),
        PromptExample("Ünïcode ✓", None, 3),
    ]


def test_load_jsonl_custom_keys(tmp_path: Path) -> None:
    spec = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"question": "q?", "solution": 7})])
    assert load_prompts(spec, prompt_key="question", answer_key="solution") == [
        PromptExample("q?", "7", 0)
    ]


@pytest.mark.parametrize(
    ("lines", "error", "match"),
    [
        (['{"prompt": "a"}', "{not json"], ValueError, r"p\.jsonl:2: invalid JSON"),
        (
            ['{"prompt": "a"}', "[1, 2]"],
            ValueError,
            r"p\.jsonl:2: expected a JSON object, got list",
        ),
        (
            ['{"prompt": "a"}', "", '{"question": "b", "id": 3}'],
            ValueError,
            r"p\.jsonl:3: no 'prompt' field; the record has \['id', 'question'\].*data\.prompt_key",
        ),
        (['{"prompt": "a"}', '{"prompt": ""}'], ValueError, r"p\.jsonl:2: the prompt .* is empty"),
        (['{"prompt": " \\n\\t "}'], ValueError, r"p\.jsonl:1: the prompt .* is empty"),
        (['{"prompt": 5}'], ValueError, r"p\.jsonl:1: field 'prompt' is a int, not a string"),
        ([], ValueError, r"p\.jsonl contains no records"),
        (["", "  "], ValueError, r"p\.jsonl contains no records"),
    ],
)
def test_load_jsonl_errors(
    tmp_path: Path, lines: list[str], error: type[Exception], match: str
) -> None:
    spec = _write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(error, match=match):
        load_prompts(spec)


def test_load_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"use a \.jsonl file"):
        load_prompts(str(tmp_path / "prompts.csv"))
    with pytest.raises(
        ValueError, match=r"unknown built-in prompt set 'builtin:gsm8k'.*arithmetic"
    ):
        load_prompts("builtin:gsm8k")


def test_parquet_without_pyarrow_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    # A None entry in sys.modules makes the import fail as if pyarrow were not installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="install pyarrow to read Parquet"):
        load_prompts(str(path))


def test_load_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "answer": ["1", None]}), path)
    assert load_prompts(str(path)) == [PromptExample("a?", "1", 0), PromptExample("b?", None, 1)]
    pq.write_table(pa.table({"prompt": ["a?", "  "]}), path)
    with pytest.raises(ValueError, match=r"p\.parquet row 1: the prompt .* is empty"):
        load_prompts(str(path))
    pq.write_table(pa.table({"text": ["a?"]}), path)
    with pytest.raises(ValueError, match=r"no 'prompt' field; the record has \['text'\]"):
        load_prompts(str(path))


def test_builtin_arithmetic() -> None:
    examples = load_prompts("builtin:arithmetic")
    assert len(examples) == 256
    assert examples == load_prompts("builtin:arithmetic")  # deterministic
    # Pinned: a change here changes every run's data.
    assert examples[0] == PromptExample("What is 49 - 97?", "-48", 0)
    for e in examples:
        _, _, a, op, b = e.prompt.rstrip("?").split(" ")
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert e.answer == str(expected)
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert [e.index for e in examples] == list(range(256))
    held_out = load_prompts("builtin:arithmetic_eval")
    assert len(held_out) == 64
    assert not {e.prompt for e in held_out} & {e.prompt for e in examples}
    assert set(BUILTIN_DATASETS) >= {"arithmetic", "arithmetic_eval"}


def test_arithmetic_generate() -> None:
    assert arithmetic.generate(5, seed=3) == arithmetic.generate(5, seed=3)
    assert arithmetic.generate(5, seed=3) != arithmetic.generate(5, seed=4)
    hard = arithmetic.generate(50, seed=0, difficulty=4)
    assert max(int(p.prompt.split()[2]) for p in hard) >= 1000
    assert all(int(p.prompt.split()[2]) <= 9 for p in arithmetic.generate(50, difficulty=1))
    with pytest.raises(ValueError, match="difficulty"):
        arithmetic.generate(5, difficulty=0)
    with pytest.raises(ValueError, match="n >= 1"):
        arithmetic.generate(0)


def test_encode_prompts_skips_and_counts_long_prompts() -> None:
    tok = CharTokenizer()
    examples = [PromptExample("x" * n, None, i) for i, n in enumerate([1, 20, 5, 30, 14])]
    overhead = len(tok.apply_chat_template(""))  # BOS + "Q: " + "\nA: "
    encoded, skipped = encode_prompts(examples, tok, max_prompt_length=overhead + 14)
    assert skipped == 2
    assert [e.example.index for e in encoded] == [0, 2, 4]  # the limit itself is allowed
    assert all(isinstance(e, EncodedPrompt) for e in encoded)
    assert encoded[1].ids == tok.apply_chat_template("x" * 5)
    encoded, skipped = encode_prompts(examples, tok, max_prompt_length=1000)
    assert (len(encoded), skipped) == (5, 0)
    with pytest.raises(ValueError, match=r"all 5 prompts are longer.*shortest has 9.*max_prompt"):
        encode_prompts(examples, tok, max_prompt_length=overhead)
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        encode_prompts(examples, tok, max_prompt_length=0)
    assert encode_prompts([], tok, max_prompt_length=4) == ([], 0)


# ============================================================================ sampler


def _sampler(
    n: int = 10, pps: int = 4, rank: int = 0, dp: int = 1, *, shuffle: bool = True
) -> PromptSampler:
    return PromptSampler(n, prompts_per_step=pps, dp_rank=rank, dp_size=dp, seed=7, shuffle=shuffle)


def _global_batches(n: int, pps: int, dp: int, steps: int) -> list[list[int]]:
    """Each step's global batch, assembled from every rank's slice in rank order."""
    samplers = [_sampler(n, pps, r, dp) for r in range(dp)]
    return [[i for s in samplers for i in s.next_step()] for _ in range(steps)]


def test_sampler_is_deterministic_and_seeded() -> None:
    a, b = _sampler(), _sampler()
    assert [a.next_step() for _ in range(5)] == [b.next_step() for _ in range(5)]
    first = _sampler()
    other_seed = PromptSampler(10, prompts_per_step=4, dp_rank=0, dp_size=1, seed=8)
    assert [first.next_step() for _ in range(5)] != [other_seed.next_step() for _ in range(5)]


def test_sampler_epochs_are_permutations_carried_across_steps() -> None:
    sampler = _sampler(n=10, pps=4)
    stream = [i for _ in range(10) for i in sampler.next_step()]  # 40 indices = 4 epochs
    for epoch in range(4):
        chunk = stream[10 * epoch : 10 * (epoch + 1)]
        expected = list(range(10))
        random.Random(7 + epoch).shuffle(expected)
        assert chunk == expected
    assert (sampler.epoch, sampler.position) == (4, 0)


def test_sampler_rollover_position() -> None:
    sampler = _sampler(n=10, pps=4)
    for _ in range(3):
        sampler.next_step()
    # 12 indices drawn: epoch 0 complete and 2 of epoch 1.
    assert sampler.state_dict() == {
        "epoch": 1,
        "position": 2,
        "seed": 7,
        "num_examples": 10,
        "shuffle": True,
        "fingerprint": None,
    }


def test_sampler_batch_larger_than_data_set() -> None:
    sampler = _sampler(n=3, pps=8)
    batch = sampler.next_step()
    assert len(batch) == 8
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]
    assert (sampler.epoch, sampler.position) == (2, 2)


def test_sampler_without_shuffle_is_sequential() -> None:
    sampler = _sampler(n=5, pps=2, shuffle=False)
    assert [sampler.next_step() for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]
    assert next(iter(sampler)) == [1, 2]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 7])
def test_sampler_resume_continues_exactly(k: int) -> None:
    uninterrupted = _sampler(n=10, pps=4, rank=1, dp=2)
    for _ in range(k):
        uninterrupted.next_step()
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    restored = _sampler(n=10, pps=4, rank=1, dp=2)
    restored.load_state_dict(state)
    assert [restored.next_step() for _ in range(8)] == [uninterrupted.next_step() for _ in range(8)]


def test_sampler_resume_under_another_dp_size() -> None:
    before = _sampler(n=10, pps=4, dp=1)
    for _ in range(3):
        before.next_step()
    state = before.state_dict()
    ranks = [_sampler(n=10, pps=4, rank=r, dp=4) for r in range(4)]
    for s in ranks:
        s.load_state_dict(state)
    assert [i for s in ranks for i in s.next_step()] == before.next_step()


@pytest.mark.parametrize(("n", "pps", "dp"), [(10, 4, 2), (10, 4, 4), (7, 6, 3), (256, 32, 8)])
def test_sampler_dp_shards_union_is_the_global_batch(n: int, pps: int, dp: int) -> None:
    single = _sampler(n, pps, 0, 1)
    reference = [single.next_step() for _ in range(9)]
    sharded = _global_batches(n, pps, dp, 9)
    assert sharded == reference
    # Each rank's slice is contiguous and of equal size.
    ranks = [_sampler(n, pps, r, dp) for r in range(dp)]
    slices = [s.next_step() for s in ranks]
    k = pps // dp
    assert all(sl == reference[0][r * k : (r + 1) * k] for r, sl in enumerate(slices))


def test_sampler_validation() -> None:
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 4"):
        _sampler(pps=6, dp=4)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        _sampler(rank=2, dp=2, pps=4)
    with pytest.raises(ValueError, match="at least one prompt"):
        _sampler(n=0)
    with pytest.raises(ValueError, match="prompts_per_step must be >= 1"):
        _sampler(pps=0)


def test_sampler_state_mismatch_is_an_error() -> None:
    state = _sampler(n=10).state_dict()
    with pytest.raises(ValueError, match="num_examples=10 but this run has num_examples=11"):
        _sampler(n=11).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed=7 but this run has seed=8.*trainer\.seed"):
        PromptSampler(10, prompts_per_step=4, dp_rank=0, dp_size=1, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        _sampler(n=10, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['position'\]"):
        _sampler().load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match="invalid sampler state"):
        _sampler().load_state_dict({**state, "position": 10})


# ---------------------------------------------------------------------------------------------
# Inputs that used to pass silently or as bare tracebacks (issue 15)


def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path: Path) -> None:
    from megatron_gndpo.errors import DataError

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        load_prompts(str(path))
    assert str(err.value).startswith(f"{path}:2: byte 0xe9 at column 16 is not UTF-8")
    assert "save the file as UTF-8" in str(err.value)


def test_characters_the_builtin_tokenizer_lacks_are_an_error_naming_the_record(
    tmp_path: Path,
) -> None:
    from megatron_gndpo.errors import DataError

    spec = _write_jsonl(
        tmp_path / "p.jsonl",
        ['{"prompt": "1+1=?", "answer": "2"}', '{"prompt": "1+1=? réponse", "answer": "2"}'],
    )
    with pytest.raises(DataError) as err:
        encode_prompts(load_prompts(spec), CharTokenizer(), max_prompt_length=64)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'p.jsonl'}:2: the prompt has characters")
    assert "'é'" in msg and "<unk>" in msg and "data.tokenizer" in msg
    answer = [PromptExample("2+2=?", "quatre ½", 0)]
    with pytest.raises(DataError, match=r"prompt 0: the answer has characters .*'½'"):
        encode_prompts(answer, CharTokenizer(), max_prompt_length=64)
    assert CharTokenizer().unknown_characters("aéb½é") == ["é", "½"]


def test_data_errors_are_user_errors_with_the_message_the_user_sees(tmp_path: Path) -> None:
    from megatron_gndpo.errors import DataError, MissingFileError, MissingPackageError, UserError

    with pytest.raises(MissingFileError) as missing:
        load_prompts(str(tmp_path / "absent.jsonl"))
    assert isinstance(missing.value, UserError) and isinstance(missing.value, FileNotFoundError)
    assert str(missing.value) == (
        f"prompt file {tmp_path / 'absent.jsonl'} does not exist; fix data.train / data.eval, "
        "or use builtin:arithmetic for the built-in task"
    )
    spec = _write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "a"', '{"prompt": "b"}'])
    with pytest.raises(DataError) as bad:
        load_prompts(spec)
    assert str(bad.value).startswith(f"{tmp_path / 'p.jsonl'}:1: invalid JSON")
    assert issubclass(MissingPackageError, UserError) and issubclass(DataError, ValueError)


def test_a_parquet_file_pyarrow_cannot_read_is_a_data_error(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    from megatron_gndpo.errors import DataError

    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=rf"cannot read {re.escape(str(path))} as Parquet: "):
        load_prompts(str(path))
