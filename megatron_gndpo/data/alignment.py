"""One text under two tokenizers: which runs of tokens on each side cover the same characters.

Cross-tokenizer distillation (docs/methods/cross_tokenizer.md) scores the student's sampled
response with a teacher of another tokenizer. The response is decoded to text, the text is
encoded by the teacher's tokenizer, and the two token sequences are cut into **spans** at the
character positions where a token ends on both sides:

    text      "12 + 345"
    student   "1" "2" " +" " 3" "45"          ends  1 2 4 6 8
    teacher   "12" " +" " 345"                ends  2 4 8
    spans     ("1" "2" | "12")  (" +" | " +")  (" 3" "45" | " 345")

A span of one token on each side is 1:1: there the teacher's score is the same-tokenizer score.

Where a token ends is measured in characters (Python ``str`` positions) of the decoded text:

- The student's ids are sampled, not the tokenizer's encoding of some text ("1" "2" where the
  tokenizer would write "12"), so offset mappings, which come from encoding, do not apply. Their
  ends come from **incremental decoding** (:func:`decoded_ends`): the text each token adds,
  decoded over a short window of the tokens before it (as vLLM's detokenizer does, so
  SentencePiece's dropped leading space and byte-level tokens holding part of a character come
  out right), checked against the decoded whole; if they disagree, the exact quadratic reading
  of every prefix's decode is used instead.
- The teacher's ids are its tokenizer's encoding of the text, so a tokenizer with an offset
  mapping (a Hugging Face fast tokenizer, ``encode_with_offsets``) gives the ends directly; the
  others (SentencePiece, the built-in character tokenizer) fall back to incremental decoding.

A token that adds no character (a special token, the first bytes of a character split over
several byte-level tokens) belongs to the span of the next character; at the end of the text,
to the last span.

When the teacher's tokenizer does not reproduce the text (SentencePiece's normaliser collapses
whitespace runs and turns newlines into spaces; an unknown character becomes ``<unk>``), the
teacher's decoded text differs from the student's. The two texts are then matched character by
character (``difflib``), spans close only where both sides agree on the position, and a span
whose two texts differ is **dropped**: its student tokens get no teacher score.

Pure Python: no torch, no model. ``teacher/cross_tokenizer.py`` builds the teacher's rows and the
span tensors from these alignments; ``algorithms/cross_tokenizer.py`` holds the span math.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
from collections.abc import Callable, Sequence
from typing import Any

# What a decoder writes for bytes that do not (yet) form a whole UTF-8 character.
REPLACEMENT = "\ufffd"
# Incremental decoding gives up (for the exact quadratic reading) when this many tokens in a
# row add no settled text: a longer run means the window's decode is not prefix-stable.
_MAX_PENDING = 32

Decode = Callable[[Sequence[int]], str]


def _prefix_ends(decode: Decode, ids: Sequence[int], text: str) -> list[int]:
    """Exact, O(len(ids)^2): token k ends where ``decode(ids[:k+1])`` stops agreeing with
    ``text`` (a trailing replacement character, a character not yet complete, not counted); a
    suffix minimum makes the ends non-decreasing and a character settled only once every later
    prefix agrees on it."""
    ends = []
    for k in range(len(ids)):
        prefix = decode(ids[: k + 1]).rstrip(REPLACEMENT)
        n = min(len(prefix), len(text))
        agree = next((i for i in range(n) if prefix[i] != text[i]), n)
        ends.append(agree)
    if ends:
        ends[-1] = len(text)
    for k in range(len(ends) - 2, -1, -1):
        ends[k] = min(ends[k], ends[k + 1])
    return ends


def _incremental_ends(decode: Decode, ids: Sequence[int], text: str) -> list[int] | None:
    """Linear: each token's added text from a window decode; None when the pieces do not
    rebuild ``text`` (then the exact reading is needed).

    The window starts at the token after the last-but-one point where the decoded text was
    complete (no trailing replacement character), so a decoder's artefacts at a window's start
    (SentencePiece drops a leading space) are the same in every decode that is compared.
    """
    ends: list[int] = []
    start = read = 0  # window start; the last token end where the text was complete
    emitted = ""  # the window's text counted so far
    done = 0  # characters of ``text`` settled so far
    for k in range(len(ids)):
        window = decode(ids[start : k + 1])
        settled = window.rstrip(REPLACEMENT)
        if len(settled) > len(emitted) and settled.startswith(emitted):
            delta = settled[len(emitted) :]
            if text[done : done + len(delta)] != delta:
                return None
            done += len(delta)
            emitted = settled
        if settled == window and settled.startswith(emitted):  # complete: move the window
            start, read = read, k + 1
            emitted = decode(ids[start:read])
        elif k + 1 - read > _MAX_PENDING:
            return None
        ends.append(done)
    if ends:  # an incomplete character at the very end is text too (decoded as REPLACEMENT)
        ends[-1] = len(text)
    return ends if done <= len(text) else None


def decoded_ends(decode: Decode, ids: Sequence[int]) -> tuple[str, list[int]]:
    """``decode(ids)`` and the character where each token ends in it (non-decreasing, the last
    one the text's length; 0 for tokens before the first character)."""
    ids = list(ids)
    text = decode(ids)
    ends = _incremental_ends(decode, ids, text)
    if ends is None:
        ends = _prefix_ends(decode, ids, text)
    return text, ends


def offset_ends(offsets: Sequence[tuple[int, int]], length: int) -> list[int]:
    """Token ends from an encoder's offset mapping ``(start, end)`` per token.

    Tokens that hold parts of one character share its offsets (a byte-level BPE writes "世" as
    two tokens, both ``(45, 46)``): such a token ends where the next one starts, so the
    character closes on its last token. Non-decreasing; the last end is ``length``.
    """
    ends = []
    for k, (_, end) in enumerate(offsets):
        following = offsets[k + 1][0] if k + 1 < len(offsets) else length
        ends.append(min(end, following))
    for k in range(1, len(ends)):
        ends[k] = max(ends[k], ends[k - 1])
    if ends:
        ends[-1] = length
    return ends


def encode_ends(tokenizer: Any, text: str) -> tuple[list[int], str, list[int]]:
    """The tokenizer's ids of ``text``, their decoded text and the character ends in it.

    A tokenizer with ``encode_with_offsets`` (Hugging Face fast) gives the ends from its offset
    mapping when its ids decode back to ``text``; otherwise they come from decoding.
    """
    encode_with_offsets = getattr(tokenizer, "encode_with_offsets", None)
    if encode_with_offsets is not None:
        found = encode_with_offsets(text)
        if found is not None:
            ids, offsets = found
            if tokenizer.decode(ids) == text:
                return ids, text, offset_ends(offsets, len(text))
    ids = tokenizer.encode(text)
    decoded, ends = decoded_ends(tokenizer.decode, ids)
    return ids, decoded, ends


@dataclasses.dataclass(frozen=True)
class Alignment:
    """The spans of one response: ``spans[j] = ((a, b), (c, d))`` pairs student tokens
    ``[a, b)`` with teacher tokens ``[c, d)`` (indices into the two token lists), in order,
    kept spans only; what was dropped, counted."""

    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
    dropped_spans: int = 0
    dropped_tokens: int = 0  # student tokens in dropped spans


def _anchors(
    student_text: str, student_ends: Sequence[int], teacher_text: str, teacher_ends: Sequence[int]
) -> list[tuple[int, int]]:
    """Character positions ``(p, q)`` where a span may close: p ends a student token, q a
    teacher token, and p in the student's text is q in the teacher's; strictly increasing on
    both sides, from ``(0, 0)`` to the two texts' ends."""
    s_len, t_len = len(student_text), len(teacher_text)
    teacher_set = set(teacher_ends)
    student_set = sorted(set(student_ends) - {0, s_len})
    pairs = [(0, 0)]
    if student_text == teacher_text:
        pairs += [(p, p) for p in student_set if p in teacher_set]
    else:
        matcher = difflib.SequenceMatcher(None, student_text, teacher_text, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            lo = bisect.bisect_left(student_set, a)
            hi = bisect.bisect_right(student_set, a + size)
            for p in student_set[lo:hi]:
                q = b + p - a
                if q in teacher_set and p > pairs[-1][0] and q > pairs[-1][1] and q < t_len:
                    pairs.append((p, q))
    if s_len or t_len:
        pairs.append((s_len, t_len))
    return pairs


def _span_of(ends: Sequence[int], cuts: Sequence[int]) -> list[int]:
    """The span index of each token whose ends are ``ends``, given the span boundaries ``cuts``
    (``cuts[0] = 0``, span j is the characters ``(cuts[j], cuts[j+1]]``): the span of its first
    character; a token with no character, the span of the next one (at the end: the last).
    Non-decreasing, as ``ends`` are."""
    last = len(cuts) - 2
    starts = [0, *ends[:-1]]
    return [min(bisect.bisect_right(cuts, start) - 1, last) for start in starts]


def _ranges(span_of: Sequence[int], count: int) -> list[tuple[int, int]]:
    """``[first, end)`` token range of each of ``count`` spans (``(0, 0)``: no token)."""
    out = [(0, 0)] * count
    for k, j in enumerate(span_of):
        first = out[j][0] if out[j] != (0, 0) else k
        out[j] = (first, k + 1)
    return out


def align(
    student_text: str,
    student_ends: Sequence[int],
    teacher_text: str,
    teacher_ends: Sequence[int],
) -> Alignment:
    """The spans of one text as two tokenizers cut it (see the module docstring).

    ``*_ends[k]``: the character where token ``k`` ends in its side's text (non-decreasing).
    A span whose student and teacher texts differ is dropped; so is every span of a text with
    no token on one side.
    """
    pairs = _anchors(student_text, student_ends, teacher_text, teacher_ends)
    if len(pairs) < 2 or not student_ends or not teacher_ends:
        count = len(student_ends)
        return Alignment((), dropped_spans=int(count > 0), dropped_tokens=count)
    count = len(pairs) - 1
    s_ranges = _ranges(_span_of(student_ends, [p for p, _ in pairs]), count)
    t_ranges = _ranges(_span_of(teacher_ends, [q for _, q in pairs]), count)
    spans, dropped, dropped_tokens = [], 0, 0
    for j in range(count):
        (p0, q0), (p1, q1) = pairs[j], pairs[j + 1]
        (a, b), (c, d) = s_ranges[j], t_ranges[j]
        if b == a or d == c or student_text[p0:p1] != teacher_text[q0:q1]:
            dropped += 1
            dropped_tokens += b - a
            continue
        spans.append(((a, b), (c, d)))
    return Alignment(tuple(spans), dropped, dropped_tokens)
