"""The reward of a short answer (a word, a name, a sentence to repeat): the reference said in the
answer's first sentence, so an answer never scores by rambling on until it says the reference.

    short_answer_reward("Paris. It is also ...", "Paris")        # 1.0
    short_answer_reward("It is big. Paris.", "Paris")            # 0.0: a later sentence
    short_answer_reward("a cat sat. a cat sat.", "A cat sat.")   # 0.0: a sentence, said once

Words are compared lower-case, punctuation and spacing aside. A reference that is itself a
sentence (it ends in ``.``, ``!`` or ``?``) is the whole answer, said once; any other is a whole
word or phrase of the answer's first sentence (``data.answer_match=first_sentence``).
"""

from __future__ import annotations

import re

_SENTENCE_END = ".!?"


def words(text: str) -> list[str]:
    """Lower-case words of ``text``; punctuation, quotes and spacing dropped."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop, question or exclamation mark, or line break."""
    return next((part for part in re.split(r"[.!?\n]", text) if part.strip()), "")


def short_answer_reward(text: str, reference: str, *, whole: bool | None = None) -> float:
    """1.0 when ``text`` answers with ``reference``: the reference's words as the whole answer
    (``whole``), otherwise as a whole word or phrase of its first sentence. ``whole`` None: when
    the reference is itself a sentence."""
    wanted = words(reference)
    if whole is None:
        whole = reference.rstrip().endswith(tuple(_SENTENCE_END))
    if whole:
        return float(words(text) == wanted)
    said = words(first_sentence(text))
    n = len(wanted)
    return float(n > 0 and any(said[i : i + n] == wanted for i in range(len(said) - n + 1)))
