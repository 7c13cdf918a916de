"""Verifiable rewards: pull the final answer out of a response and check it against a reference.

``extract_answer`` looks, in order, for

1. the content of the last ``\\boxed{...}`` whose braces balance (nested braces kept; a
   ``\\boxed{`` left open by a truncated response, or an empty one, is ignored);
2. the text after the last ``answer is`` / ``Answer:`` marker (case-insensitive): a ``$...$``
   span right after it, else the rest of that line up to the end of the sentence, without a
   trailing period;
3. the last number in the text (a minus sign counts only when it is not a binary minus, so
   ``10-3`` ends in ``3``; thousands separators are dropped).

``answers_match`` is normalised exact match (spaces, ``$`` and a trailing period removed; two
plain decimal numbers compare by value, so ``81 == 81.0 == 81.00``), and, when the
``math-verify`` package is installed, additionally symbolic equivalence through it. So ``3/4``
and ``0.75`` or ``\\frac{3}{4}`` match only with math-verify; the exact mode does no algebra.
"""

from __future__ import annotations

import decimal
import re
import threading
from functools import cache
from types import ModuleType

_BOXED = "\\boxed{"
_MARKER_RE = re.compile(r"(?:answer\s+is|answer\s*:)", re.IGNORECASE)
# After a marker: "$...$" is the answer as typeset (Minerva's "The final answer is $x$. I hope it
# is correct."); otherwise the answer ends at the end of the line or of the sentence.
_MATH_SPAN_RE = re.compile(r"\$[^$]+\$")
_SENTENCE_END_RE = re.compile(r"\n|\.\s")
# A number: the minus sign only where it cannot be a binary minus (not after a word character,
# a closing bracket or a decimal point); optional thousands groups and decimals.
_NUMBER_RE = re.compile(r"(?:(?<![\w)\].])-)?\d+(?:,\d{3})*(?:\.\d+)?")
# What exact mode compares by value: a plain decimal number, nothing else (no exponent, nan, inf).
_PLAIN_DECIMAL_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")

# math-verify's own default; it bounds sympy on adversarial inputs (signal-based, main thread only).
_MATH_VERIFY_TIMEOUT_S = 5


def extract_answer(text: str) -> str | None:
    """The final answer stated in ``text`` (see the module docstring), or None if there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = _after_last_marker(text)
    if marked:
        return marked
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last non-empty ``\\boxed{...}`` with balanced braces."""
    start = text.rfind(_BOXED)
    while start != -1:
        content = _balanced(text, start + len(_BOXED))
        if content is not None and content.strip():
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def _balanced(text: str, begin: int) -> str | None:
    """Text from ``begin`` to the brace closing the one just before it, or None if unclosed."""
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def _after_last_marker(text: str) -> str | None:
    """The answer after the last marker: a ``$...$`` span, else the sentence up to ". "/newline."""
    matches = list(_MARKER_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].lstrip(" \t:")
    math = _MATH_SPAN_RE.match(rest)
    if math:
        return math.group(0)
    sentence = _SENTENCE_END_RE.split(rest, maxsplit=1)[0]
    return sentence.strip().rstrip(".").strip() or None


# ---------------------------------------------------------------------------------------------


def normalize_answer(answer: str) -> str:
    """Exact-mode form: no whitespace, no ``$``, no trailing period, no thousands separators."""
    s = "".join(answer.split()).replace("$", "").rstrip(".")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s


def _exact_match(predicted: str, reference: str) -> bool:
    p, r = normalize_answer(predicted), normalize_answer(reference)
    if _PLAIN_DECIMAL_RE.fullmatch(p) and _PLAIN_DECIMAL_RE.fullmatch(r):
        return decimal.Decimal(p) == decimal.Decimal(r)
    return p == r


@cache
def _math_verify() -> ModuleType | None:
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def math_verify_available() -> bool:
    """Whether ``answers_match`` also checks symbolic equivalence (math-verify installed)."""
    return _math_verify() is not None


def _symbolic_match(predicted: str, reference: str, mv: ModuleType) -> bool:
    # Wrapped in $...$ so math-verify reads LaTeX (\frac{3}{4}) as well as plain expressions.
    # Its timeout uses signal.alarm, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if main else None
    try:
        gold = mv.parse(f"${reference.replace('$', '')}$", parsing_timeout=timeout)
        target = mv.parse(f"${predicted.replace('$', '')}$", parsing_timeout=timeout)
        if not gold or not target:
            return False
        return bool(mv.verify(gold, target, timeout_seconds=timeout))
    except Exception:
        # math-verify raises on inputs sympy cannot handle; such an answer does not match.
        return False


def answers_match(
    predicted: str | None, reference: str, *, use_math_verify: bool | None = None
) -> bool:
    """Whether ``predicted`` states ``reference``.

    ``use_math_verify``: None uses math-verify when installed, False forces exact mode, True
    requires math-verify (an error when it is missing).
    """
    if predicted is None:
        return False
    if _exact_match(predicted, reference):
        return True
    if use_math_verify is False:
        return False
    mv = _math_verify()
    if mv is None:
        if use_math_verify:
            raise ImportError(
                "use_math_verify=True needs the math-verify package: pip install math-verify"
            )
        return False
    return _symbolic_match(predicted, reference, mv)


def reward(text: str, reference: str, *, use_math_verify: bool | None = None) -> float:
    """1.0 when the answer extracted from ``text`` matches ``reference``, else 0.0."""
    matched = answers_match(extract_answer(text), reference, use_math_verify=use_math_verify)
    return 1.0 if matched else 0.0
