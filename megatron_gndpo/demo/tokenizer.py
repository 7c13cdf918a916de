"""The demo's tokenizer: a small SentencePiece BPE model trained on the task at run time.

Trained on the chat-templated prompts and worked solutions, so every number the task uses
becomes one piece (the task spaces its numbers and operators; ``split_by_whitespace`` keeps pieces
inside words). ``\\boxed{``, ``}`` and ``,`` are user-defined symbols: always single pieces, so
the final answer is one number token between two fixed ones and a step separator never merges
into a number. No byte fallback: every character of the corpus is in the vocabulary.

Cached in a directory as ``tokenizer.model`` beside ``tokenizer.json`` (the hash of the corpus
and the training settings); a later call with the same corpus reuses the file. Under
torch.distributed rank 0 trains and writes it, the others wait and load it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from megatron_gndpo.data.tokenizer import QA_PREFIX, QA_SUFFIX, SentencePieceTokenizer
from megatron_gndpo.fileio import write_atomic
from megatron_gndpo.parallel.distributed import barrier, rank

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"

# The task's alphabet is about 25 characters and its numbers about 40 words: 128 leaves room for
# every number with and without a leading space. The limit is soft (a smaller corpus gives fewer
# pieces rather than an error).
DEFAULT_VOCAB_SIZE = 128

# Ids of the special pieces, as the built-in character tokenizer numbers them.
_SPECIAL_IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}
_USER_SYMBOLS = ("\\boxed{", "}", ",")


def task_corpus(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """One line per ``(prompt, solution)``: the prompt as the chat template wraps it + solution."""
    return [f"{QA_PREFIX}{prompt}{QA_SUFFIX}{solution}" for prompt, solution in pairs]


def _settings(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "model_type": "bpe",
        "character_coverage": 1.0,
        "byte_fallback": False,
        "split_digits": False,
        "hard_vocab_limit": False,
        "user_defined_symbols": list(_USER_SYMBOLS),
        "num_threads": 1,  # one thread: the same corpus gives the same model
        **_SPECIAL_IDS,
    }


def _digest(corpus: Sequence[str], settings: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for line in corpus:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def train_tokenizer(
    directory: str | os.PathLike[str],
    corpus: Sequence[str],
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> SentencePieceTokenizer:
    """The tokenizer of ``corpus`` in ``directory``: reused when cached, else trained there."""
    directory = Path(directory)
    settings = _settings(vocab_size)
    digest = _digest(corpus, settings)
    if rank() == 0 and not _cached(directory, digest):
        _train(directory, corpus, settings, digest)
    barrier()
    return SentencePieceTokenizer(directory / MODEL_FILE)


def _cached(directory: Path, digest: str) -> bool:
    meta = directory / META_FILE
    if not (meta.is_file() and (directory / MODEL_FILE).is_file()):
        return False
    return bool(json.loads(meta.read_text()).get("digest") == digest)


def _train(directory: Path, corpus: Sequence[str], settings: dict[str, Any], digest: str) -> None:
    import sentencepiece as spm

    if not corpus:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, minloglevel=2, **settings
    )
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / MODEL_FILE, model.getvalue())
    meta = {"digest": digest, "lines": len(corpus), "settings": settings}
    write_atomic(directory / META_FILE, json.dumps(meta, indent=2).encode())
