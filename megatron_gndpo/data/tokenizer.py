"""The tokenizer the trainer sees: one small protocol, three implementations.

``Tokenizer`` is all the rollout, the teacher check and the reward code need: ids in, text out,
the chat-formatted prompt, and a fingerprint of the vocabulary. Conventions shared by every
implementation:

- ``encode(text)`` returns the ids of ``text`` alone: no BOS/EOS is added.
- ``decode(ids)`` drops special tokens (padding, BOS, EOS), so a right-padded response with its
  EOS decodes to its text.
- ``apply_chat_template(prompt)`` returns the prompt exactly as the model should see it,
  BOS and the generation prompt ("assistant turn starts here") included.
- ``fingerprint()`` hashes the vocabulary only (id -> token string for every id), so two
  tokenizers that give the same ids for the same strings have the same fingerprint whatever
  class loaded them. The trainer refuses a teacher whose fingerprint differs from the student's.
- A tokenizer without a padding token pads with EOS (``pad_id == eos_id``); padding is masked
  by the response mask, never recognised by its id.

``transformers`` and ``sentencepiece`` are imported only by the class that needs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_gndpo.errors import DataError, MissingFileError

BUILTIN_CHAR = "builtin:char"

# The prompt wrapper of the tokenizers that have no chat template of their own.
QA_PREFIX = "Q: "
QA_SUFFIX = "\nA: "


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer (see the module docstring for conventions)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (ids are ``0 .. vocab_size - 1``)."""
        ...

    @property
    def eos_id(self) -> int:
        """Id that ends a response."""
        ...

    @property
    def pad_id(self) -> int:
        """Id used to right-pad sequences (EOS when the tokenizer has no padding token)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...

    def apply_chat_template(
        self, prompt: str, system: str | None = None, turns: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        """The prompt as the model should see it, generation prompt included; ``system``: a
        system prompt (None: the template's own, if any); ``turns``: earlier (user, assistant)
        exchanges before it."""
        ...

    def fingerprint(self) -> str:
        """Stable hash of the vocabulary (id -> token string)."""
        ...


def _preamble(system: str | None, turns: Sequence[tuple[str, str]]) -> str:
    """A system prompt and earlier exchanges where a tokenizer has no chat template for them:
    the system prompt's own line, then each exchange as the template's question and answer."""
    lines = "" if system is None else system + "\n"
    return lines + "".join(f"{QA_PREFIX}{user}{QA_SUFFIX}{answer}\n" for user, answer in turns)


def vocabulary_fingerprint(tokens: Sequence[str | None]) -> str:
    """SHA-256 (hex) of the vocabulary, ``tokens[i]`` being the string of id ``i``.

    ``None`` marks an id with no token (a hole in a Hugging Face vocabulary). The hash covers the
    number of ids too, so a vocabulary extended by one token has a different fingerprint.
    """
    payload = json.dumps(list(tokens), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Built-in character tokenizer


class CharTokenizer:
    """Character-level tokenizer with a fixed vocabulary of 100 ids; needs no file.

    Ids 0..3 are ``<pad>``, ``<s>`` (BOS), ``</s>`` (EOS), ``<unk>``; then printable ASCII
    32..126 (ids 4..98) and ``"\\n"`` (id 99). Any other character encodes to ``<unk>``.
    Chat template: ``<s>`` + ``"Q: " + prompt + "\\nA: "``. Used by the tests and the tiny CPU
    example.
    """

    PAD_ID = 0
    BOS_ID = 1
    EOS_ID = 2
    UNK_ID = 3
    SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

    def __init__(self) -> None:
        chars = [chr(c) for c in range(32, 127)] + ["\n"]
        self._tokens: tuple[str, ...] = self.SPECIAL_TOKENS + tuple(chars)
        self._char_to_id = {
            c: i for i, c in enumerate(self._tokens) if i >= len(self.SPECIAL_TOKENS)
        }

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eos_id(self) -> int:
        return self.EOS_ID

    @property
    def pad_id(self) -> int:
        return self.PAD_ID

    @property
    def bos_id(self) -> int:
        return self.BOS_ID

    def encode(self, text: str) -> list[int]:
        return [self._char_to_id.get(c, self.UNK_ID) for c in text]

    def unknown_characters(self, text: str) -> list[str]:
        """The distinct characters of ``text`` that would encode to ``<unk>``, in order."""
        return list(dict.fromkeys(c for c in text if c not in self._char_to_id))

    def decode(self, ids: Sequence[int]) -> str:
        pieces = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the character vocabulary (0..{self.vocab_size - 1}); "
                    "the ids were not produced by CharTokenizer (check model.vocab_size / "
                    "data.vocab_size)"
                )
            if i == self.UNK_ID:
                pieces.append("\ufffd")
            elif i >= len(self.SPECIAL_TOKENS):
                pieces.append(self._tokens[i])
        return "".join(pieces)

    def apply_chat_template(
        self, prompt: str, system: str | None = None, turns: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        text = _preamble(system, turns) + QA_PREFIX + prompt + QA_SUFFIX
        return [self.BOS_ID, *self.encode(text)]

    def fingerprint(self) -> str:
        return vocabulary_fingerprint(self._tokens)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# SentencePiece


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file.

    SentencePiece models carry no chat template, so the prompt is wrapped as the built-in one
    is: BOS (when the model has one) + ``"Q: " + prompt + "\\nA: "``. Note that SentencePiece's
    default normaliser turns the newline into a space. The model must define EOS; without a
    padding piece, EOS pads.
    """

    def __init__(
        self, model_file: str | os.PathLike[str], *, setting: str = "data.tokenizer"
    ) -> None:
        import sentencepiece as spm

        path = Path(model_file)
        if not path.is_file():
            raise MissingFileError(
                f"SentencePiece model {path} does not exist; set {setting} to an existing "
                ".model file"
            )
        self._path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        if self._sp.eos_id() < 0:
            raise DataError(
                f"SentencePiece model {path} defines no EOS piece (eos_id = -1), so responses "
                "could never end; retrain it with eos_id >= 0"
            )
        pad = self._sp.pad_id()
        self._pad_id = pad if pad >= 0 else self._sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        # Control pieces (BOS, EOS, padding) decode to nothing in SentencePiece.
        return str(self._sp.decode([int(i) for i in ids]))

    def apply_chat_template(
        self, prompt: str, system: str | None = None, turns: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        bos = self._sp.bos_id()
        prefix = [bos] if bos >= 0 else []
        return prefix + self.encode(_preamble(system, turns) + QA_PREFIX + prompt + QA_SUFFIX)

    def fingerprint(self) -> str:
        return vocabulary_fingerprint([self._sp.id_to_piece(i) for i in range(self.vocab_size)])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self._path)!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# Hugging Face


# The files of a Hugging Face tokenizer directory that travel with a model (conversion, FP8
# export, a vLLM engine's directory). A directory is taken for a tokenizer when it holds one of
# the first four.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)  # fmt: skip
_HF_TOKENIZER_FILES = TOKENIZER_FILES[:4]


def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer / generation files present in ``src`` to ``dst``; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


class HFTokenizer:
    """A Hugging Face tokenizer directory, loaded offline (``local_files_only=True``).

    The chat template is the tokenizer's own (one user message, generation prompt added),
    rendered to text and encoded without extra special tokens, exactly as ``transformers`` does
    when it tokenizes a template; a tokenizer without a template encodes the bare prompt with its
    usual special tokens (BOS for Llama-style tokenizers). ``vocab_size`` is ``len(tokenizer)``:
    base vocabulary plus added tokens.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, setting: str = "data.tokenizer"
    ) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise MissingFileError(
                f"Hugging Face tokenizer directory {path} does not exist; set {setting} to "
                "a directory holding tokenizer.json / tokenizer_config.json"
            )
        if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
            raise MissingFileError(
                f"{path} holds none of {', '.join(_HF_TOKENIZER_FILES)}; point {setting} "
                "at the directory where the tokenizer was saved (tokenizer.save_pretrained)"
            )
        _check_tokenizer_json(path / "tokenizer.json")
        from transformers import AutoTokenizer

        self._path = path
        self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self._tok.eos_token_id is None:
            raise DataError(
                f"tokenizer in {path} has no eos_token, so responses could never end; set "
                '"eos_token" in its tokenizer_config.json'
            )
        pad = self._tok.pad_token_id
        self._pad_id = int(pad) if pad is not None else int(self._tok.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def has_chat_template(self) -> bool:
        return getattr(self._tok, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
        """:meth:`encode`'s ids and each one's ``(start, end)`` character offsets in ``text``
        (cross-tokenizer alignment, data/alignment.py); None for a slow tokenizer, which has no
        offset mapping."""
        if not getattr(self._tok, "is_fast", False):
            return None
        found = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(found["input_ids"]), [(int(a), int(b)) for a, b in found["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def apply_chat_template(
        self, prompt: str, system: str | None = None, turns: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        if not self.has_chat_template:
            text = _preamble(system, turns) + prompt
            return list(self._tok.encode(text, add_special_tokens=True))
        messages = [] if system is None else [{"role": "system", "content": system}]
        for user, assistant in turns:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        messages.append({"role": "user", "content": prompt})
        # Rendering to text and encoding it is what tokenize=True does, and its return type
        # (list vs BatchEncoding) changed between transformers releases.
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def fingerprint(self) -> str:
        tokens = self._tok.convert_ids_to_tokens(list(range(self.vocab_size)))
        return vocabulary_fingerprint([None if t is None else str(t) for t in tokens])

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self._path)!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------


def _is_hf_tokenizer_json(path: Path) -> bool:
    """Whether ``path`` reads as a Hugging Face ``tokenizer.json`` (a JSON object with a
    ``model`` section); the demo's tokenizer directory has a note of that name instead."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict)


def _sentencepiece_directory(directory: Path) -> Path | None:
    """The ``tokenizer.model`` of a directory that holds a SentencePiece model and no Hugging
    Face tokenizer (the demo's tokenizer directory and the checkpoints made from it: their
    ``tokenizer.json`` is the demo's note of how the model was trained); None otherwise."""
    model, note = directory / "tokenizer.model", directory / "tokenizer.json"
    if not model.is_file() or (directory / "tokenizer_config.json").is_file():
        return None
    return model if not note.is_file() or not _is_hf_tokenizer_json(note) else None


def _check_tokenizer_json(path: Path) -> None:
    """A ``tokenizer.json`` that is not a Hugging Face tokenizer is a DataError naming it (not a
    KeyError from deep inside ``transformers``)."""
    if path.is_file() and not _is_hf_tokenizer_json(path):
        raise DataError(
            f"{path} is not a Hugging Face tokenizer (no JSON object with a 'model' section): "
            "point the tokenizer setting at the directory tokenizer.save_pretrained wrote, or at "
            "a SentencePiece '.model' file"
        )


def load_tokenizer(spec: str | None, *, setting: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer named by ``data.tokenizer`` (``setting``: what the errors name as the fix,
    such as prune's ``--tokenizer``).

    Accepted forms: ``None`` or ``"builtin:char"`` (``CharTokenizer``), a path ending in
    ``.model`` (``SentencePieceTokenizer``), a directory (``HFTokenizer``; a directory with a
    ``tokenizer.model`` and no Hugging Face tokenizer, such as the demo's, is that
    ``SentencePieceTokenizer``).
    """
    if spec is None or spec == BUILTIN_CHAR:
        return CharTokenizer()
    accepted = (
        f"null or {BUILTIN_CHAR!r} for the built-in character tokenizer, a SentencePiece "
        "'.model' file, or a Hugging Face tokenizer directory"
    )
    if spec.startswith("builtin:"):
        raise DataError(f"unknown built-in tokenizer {spec!r}; {setting} accepts {accepted}")
    if spec.endswith(".model"):
        return SentencePieceTokenizer(spec, setting=setting)
    if Path(spec).is_dir():
        sentencepiece = _sentencepiece_directory(Path(spec))
        if sentencepiece is not None:
            return SentencePieceTokenizer(sentencepiece, setting=setting)
        return HFTokenizer(spec, setting=setting)
    if not Path(spec).exists():
        raise MissingFileError(f"tokenizer {spec!r} does not exist; {setting} accepts {accepted}")
    raise DataError(f"cannot tell which tokenizer {spec!r} is; {setting} accepts {accepted}")
