"""Prompt sets: loading them (JSONL, Parquet, built-in) and encoding them with the chat template.

A prompt set is a list of ``PromptExample``; ``index`` is its position in the list, which is what
the sampler draws. Every malformed input is an error naming the file, the line or row, and the
fix: a training run never starts on a silently shortened data set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.data.tasks import arithmetic, chains
from megatron_gndpo.data.tokenizer import CharTokenizer, Tokenizer
from megatron_gndpo.errors import DataError, MissingFileError, MissingPackageError
from megatron_gndpo.fileio import is_stream, not_a_file

BUILTIN_PREFIX = "builtin:"


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt and its reference answer (None when the data set has none)."""

    prompt: str
    answer: str | None
    index: int
    where: str = dataclasses.field(default="", compare=False)
    """Where the record came from (``FILE:LINE``, ``FILE row N``), for error messages."""
    source: str | None = None
    """The record's routing value (data.teacher_key: which teacher scores it), None without."""
    fields: tuple[tuple[str, str], ...] = ()
    """The record's fields a teacher's own prompt names (teacher.context), as text: what the
    teacher sees and the student does not."""

    def field(self, name: str) -> str | None:
        """The record's field ``name`` as text (``fields``), None when the record has none."""
        return dict(self.fields).get(name)


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """A prompt's images, in the forms rollout engines take them.

    ``tiles`` ``[N, 3, H, W]``: every image's normalised tiles in order (what the megatron models
    take; the prompt's ids already hold their placeholders); ``tiles_per_image``: how the tiles
    split into images; ``sources``: the original images (path, bytes or PIL image), for an
    engine that preprocesses images itself (vLLM with pixel input).
    """

    tiles: torch.Tensor
    tiles_per_image: tuple[int, ...]
    sources: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if sum(self.tiles_per_image) != self.tiles.shape[0]:
            raise ValueError(
                f"tiles_per_image {self.tiles_per_image} does not add up to the "
                f"{self.tiles.shape[0]} tiles"
            )
        if self.sources and len(self.sources) != len(self.tiles_per_image):
            raise ValueError(
                f"{len(self.sources)} source images for {len(self.tiles_per_image)} images"
            )


def tiles_of(images: PromptImages | torch.Tensor | None) -> torch.Tensor | None:
    """The tiles ``[n, 3, H, W]`` of a prompt's images (given as such, or as their tiles)."""
    return images.tiles if isinstance(images, PromptImages) else images


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
    """A prompt with its chat-templated token ids (and, for a vision model, its images, whose
    placeholders the ids already hold)."""

    example: PromptExample
    ids: list[int]
    images: PromptImages | None = None


# ---------------------------------------------------------------------------------------------
# Built-in prompt sets

_ARITHMETIC_SEED = 0
_ARITHMETIC_EVAL_SEED = 1
_ARITHMETIC_SIZE = 256
_ARITHMETIC_EVAL_SIZE = 64
_ARITHMETIC_DIFFICULTY = 2


def _arithmetic() -> list[tuple[str, str]]:
    problems = arithmetic.generate(_ARITHMETIC_SIZE, _ARITHMETIC_SEED, _ARITHMETIC_DIFFICULTY)
    return [(p.prompt, p.answer) for p in problems]


def _arithmetic_eval() -> list[tuple[str, str]]:
    """Held-out problems: drawn from another seed, with every training prompt removed."""
    train = {prompt for prompt, _ in _arithmetic()}
    # Four times the size leaves ample room after removing the (rare) collisions.
    candidates = arithmetic.generate(
        4 * _ARITHMETIC_EVAL_SIZE, _ARITHMETIC_EVAL_SEED, _ARITHMETIC_DIFFICULTY
    )
    held_out = [(p.prompt, p.answer) for p in candidates if p.prompt not in train]
    return held_out[:_ARITHMETIC_EVAL_SIZE]


BUILTIN_DATASETS: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "arithmetic": _arithmetic,
    "arithmetic_eval": _arithmetic_eval,
    "chains": lambda: chains.prompt_examples("train"),
    "chains_eval": lambda: chains.prompt_examples("eval"),
}
"""Built-in prompt sets by name (``builtin:NAME``): each returns ``(prompt, answer)`` pairs."""


def _mixed() -> list[tuple[str, str, str]]:
    """The arithmetic and chains training prompts together, each with its set's name as its
    routing value: a two-teacher run on built-in data (examples/tiny_cpu_two_teachers.yaml)."""
    return [(p, a, "arithmetic") for p, a in _arithmetic()] + [
        (p, a, "chains") for p, a in chains.prompt_examples("train")
    ]


BUILTIN_ROUTED: dict[str, Callable[[], list[tuple[str, str, str]]]] = {"mixed": _mixed}
"""Built-in prompt sets with a routing value per prompt: ``(prompt, answer, source)``."""


# ---------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass(frozen=True)
class PromptOptions:
    """The settings an error message names as the fix: the config keys of ``train``, or the
    options of another command (``prune``: ``--calib-data``, ``--calib-prompt-key``)."""

    file: str = "data.train / data.eval"
    prompt_key: str = "data.prompt_key"


def load_prompts(
    spec: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    source_key: str | None = None,
    named_by: PromptOptions = PromptOptions(),
    fields: tuple[str, ...] = (),
) -> list[PromptExample]:
    """The prompts named by ``spec``: a ``.jsonl`` file, a ``.parquet`` file or ``builtin:NAME``.

    Each JSONL line (blank lines aside) and each Parquet row is one record; ``prompt_key`` names
    its prompt (a non-empty string), ``answer_key`` its reference answer (optional; numbers are
    turned into text), ``source_key`` (when given) its routing value (an optional string: the
    teacher that scores it), ``fields`` the further fields kept (as text, when present: the
    privileged context a teacher's own prompt names). ``named_by``: the settings the errors name
    as the fix.
    """
    if spec.startswith(BUILTIN_PREFIX):
        return _load_builtin(spec[len(BUILTIN_PREFIX) :], routed=source_key is not None)
    path = Path(spec)
    stream = is_stream(path)  # a pipe (`<(zcat x.jsonl.gz)`): read once, as JSONL
    if path.suffix not in (".jsonl", ".parquet") and not stream:
        raise DataError(
            f"cannot read prompts from {spec!r}: use a .jsonl file (one JSON object per line), "
            f"a .parquet file, or builtin:NAME with NAME in {sorted(BUILTIN_DATASETS)}"
        )
    why = not_a_file(path)
    if why is not None:
        raise MissingFileError(
            f"prompt file {why}; fix {named_by.file}, or use builtin:arithmetic for the "
            "built-in task"
        )
    examples = [
        _example(
            record,
            where,
            prompt_key=prompt_key,
            answer_key=answer_key,
            index=index,
            source_key=source_key,
            key_option=named_by.prompt_key,
            fields=fields,
        )
        for index, (where, record) in enumerate(file_records(path))
    ]
    if not examples:
        raise DataError(f"prompt file {path} contains no records; it needs at least one prompt")
    return examples


def _load_builtin(name: str, *, routed: bool = False) -> list[PromptExample]:
    """A built-in set; ``routed``: with its routing values (the others have none)."""
    if name in BUILTIN_ROUTED:
        return [
            PromptExample(prompt=p, answer=a, index=i, source=source if routed else None)
            for i, (p, a, source) in enumerate(BUILTIN_ROUTED[name]())
        ]
    if name not in BUILTIN_DATASETS:
        raise DataError(
            f"unknown built-in prompt set 'builtin:{name}'; available: "
            + ", ".join(f"builtin:{n}" for n in sorted([*BUILTIN_DATASETS, *BUILTIN_ROUTED]))
        )
    pairs = BUILTIN_DATASETS[name]()
    return [PromptExample(prompt=p, answer=a, index=i) for i, (p, a) in enumerate(pairs)]


def file_records(
    path: Path,
    *,
    without_pyarrow: str = "install pyarrow to read Parquet (pip install pyarrow), or convert "
    "the prompts to .jsonl",
) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """``(location, record)`` of each record of a prompt file: a ``.parquet`` file's rows,
    else a JSON-lines file's objects. ``without_pyarrow``: what the error says to do when
    Parquet cannot be read."""
    if path.suffix == ".parquet":
        return _parquet_records(path, without_pyarrow)
    return _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(location, record)`` for each non-blank line; location is ``"FILE:LINE"``."""
    for line_number, line in _utf8_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        yield where, _json_record(line, where)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: an object that names a key twice is refused (json keeps
    the last value without a word)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _json_record(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a JSON object; a DataError naming ``where`` for invalid JSON, for
    another kind of value, and for a key given twice in an object."""
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except _DuplicateKey as dup:
        raise DataError(
            f"{where}: the key {dup.key!r} appears twice in the record (JSON keeps only the "
            "last, silently); keep one of them"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
            "prompt file must be one JSON object"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object, got {type(record).__name__}; each line of "
            "a .jsonl prompt file must be one JSON object"
        )
    return record


def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line; a byte that is not UTF-8 is a DataError naming the
    file, line and column."""
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                yield line_number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{line_number}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is "
                    "not UTF-8; save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None


def _parquet_records(path: Path, without_pyarrow: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """``(location, record)`` for each row; location is ``"FILE row N"`` (0-based)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingPackageError(f"cannot read {path}: {without_pyarrow}") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) say what is wrong
        raise DataError(f"cannot read {path} as Parquet: {e}") from None
    return ((f"{path} row {i}", row) for i, row in enumerate(rows))


def _example(
    record: Mapping[str, Any],
    where: str,
    *,
    prompt_key: str,
    answer_key: str,
    index: int,
    source_key: str | None = None,
    key_option: str = "data.prompt_key",
    fields: tuple[str, ...] = (),
) -> PromptExample:
    if prompt_key not in record:
        raise DataError(
            f"{where}: no {prompt_key!r} field; the record has {sorted(record)}. Set "
            f"{key_option} to the field that holds the prompt"
        )
    prompt = record[prompt_key]
    if not isinstance(prompt, str):
        raise DataError(
            f"{where}: field {prompt_key!r} is a {type(prompt).__name__}, not a string; the "
            "prompt must be text (chat-message lists are not supported yet)"
        )
    if not prompt.strip():
        raise DataError(f"{where}: the prompt ({prompt_key!r}) is empty; remove the record")
    answer = _answer(record.get(answer_key))
    source = None if source_key is None else routing_value(record, source_key, where)
    kept = tuple((k, _field(record[k], k, where)) for k in fields if k in record)
    return PromptExample(
        prompt=prompt, answer=answer, index=index, where=where, source=source, fields=kept
    )


def _field(value: Any, key: str, where: str) -> str:
    """A context field's value as text: a string, or a number turned into text."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"{where}: field {key!r} is a {type(value).__name__}; a teacher's prompt takes text or "
        "a number there"
    )


def routing_value(record: Mapping[str, Any], key: str, where: str) -> str | None:
    """The record's ``key`` field (which teacher scores it): a string, or None when absent."""
    value = record.get(key)
    if value is None or isinstance(value, str):
        return value
    raise DataError(
        f"{where}: field {key!r} is a {type(value).__name__} ({value!r}), not a string; it names "
        "the teacher that scores the prompt (data.teacher_key): write the teacher's name or "
        "one of its sources"
    )


def _answer(value: Any) -> str | None:
    """The reference answer as text: numbers keep their JSON spelling, absent/null is None."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_prompts(
    examples: Sequence[PromptExample], tokenizer: Tokenizer, *, max_prompt_length: int
) -> tuple[list[EncodedPrompt], int]:
    """Chat-templated ids of each prompt; returns ``(encoded, number_skipped)``.

    Prompts whose templated length exceeds ``max_prompt_length`` tokens are skipped (never
    truncated: a cut prompt asks a different question) and counted, so the caller can report
    them. Skipping every prompt is an error naming the shortest one's length.
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    encoded: list[EncodedPrompt] = []
    shortest = None
    for example in examples:
        check_characters(example, tokenizer)
        ids = tokenizer.apply_chat_template(example.prompt)
        shortest = len(ids) if shortest is None else min(shortest, len(ids))
        if len(ids) <= max_prompt_length:
            encoded.append(EncodedPrompt(example=example, ids=ids))
    skipped = len(examples) - len(encoded)
    if examples and not encoded:
        raise DataError(
            f"all {len(examples)} prompts are longer than max_prompt_length={max_prompt_length} "
            f"tokens (the shortest has {shortest}); raise rollout.max_prompt_length"
        )
    return encoded, skipped


def check_characters(example: PromptExample, tokenizer: Tokenizer) -> None:
    """The built-in character tokenizer reads a character it lacks as ``<unk>``: a prompt (or an
    answer) with one would train on a different question, so it is an error naming the record."""
    if not isinstance(tokenizer, CharTokenizer):
        return  # SentencePiece and Hugging Face tokenizers cover their text (byte fallback)
    for field, text in (("prompt", example.prompt), ("answer", example.answer or "")):
        unknown = tokenizer.unknown_characters(text)
        if unknown:
            where = example.where or f"prompt {example.index}"
            raise DataError(
                f"{where}: the {field} has characters the built-in tokenizer cannot encode "
                f"({''.join(unknown)!r}; it knows printable ASCII and newlines and would read "
                "them as <unk>); use a SentencePiece or Hugging Face tokenizer (data.tokenizer), "
                "or remove those characters"
            )


# ---------------------------------------------------------------------------------------------
# Fingerprint


def _image_key(image: Any) -> str:
    """What identifies one image source in a fingerprint: its path, or its bytes' hash."""
    if isinstance(image, bytes | bytearray):
        return "sha256:" + hashlib.sha256(image).hexdigest()
    if hasattr(image, "tobytes"):  # an image decoded in memory (PIL)
        return "sha256:" + hashlib.sha256(image.tobytes()).hexdigest()
    return str(image)


def prompt_fingerprint(prompts: Sequence[EncodedPrompt]) -> str:
    """SHA-256 (hex) of a prompt set's content in order: each prompt's text, reference answer,
    routing value and image sources (paths as written, in-memory images by their bytes).
    Saved with the sampler's state: a resume on a file rewritten with as many records is
    refused (data/sampler.py)."""
    digest = hashlib.sha256()
    for p in prompts:
        e = p.example
        images = [] if p.images is None else [_image_key(i) for i in p.images.sources]
        record = [e.prompt, e.answer, e.source, images]
        digest.update(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()
