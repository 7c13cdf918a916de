"""Tests of megatron_gndpo.rewards: answer extraction, matching and the 0/1 reward.

Exact-mode tests force ``use_math_verify=False`` so they hold whether or not math-verify is
installed; the symbolic tests run only where it is.
"""

from __future__ import annotations

import pytest

from megatron_gndpo.rewards import (
    answers_match,
    extract_answer,
    math_verify_available,
    normalize_answer,
    reward,
    short_answer_reward,
    verifiable,
)

# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # \boxed: nested braces kept, the last one wins, an unclosed or empty one is ignored.
        (r"so \boxed{81}", "81"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}} then \boxed{3}", "3"),
        (r"\boxed{5} and a truncated \boxed{6", "5"),
        (r"\boxed{ 7 }", "7"),
        (r"\boxed{} but 12", "12"),
        (r"The answer is 3 so \boxed{4}", "4"),  # boxed beats the marker
        (r"\boxed{-3}", "-3"),
        # "answer is" / "Answer:" markers: the last one, up to the end of the line / sentence.
        ("The answer is 42.", "42"),
        ("the ANSWER IS 17", "17"),
        ("Answer: -7\nmore text 3", "-7"),
        ("Answer: 5. Then I checked 6", "5"),
        ("answer is 1, no wait, the answer is 2", "2"),
        ("The final answer is: 3.5.", "3.5"),
        (r"The final answer is $\frac{3}{4}$. I hope it is correct.", r"$\frac{3}{4}$"),
        ("Answer: x + 1", "x + 1"),
        ("answer is", None),  # marker with nothing after it, and no number
        ("answer is:\n 5", "5"),  # empty marker line falls back to the last number
        # Last number.
        ("23 + 58 = 81", "81"),
        ("so 10-3 = 7 and then 8", "8"),
        ("it is 10-3", "3"),  # binary minus is not a sign
        ("x = -5", "-5"),
        ("x=-5", "-5"),
        ("total 1,234,567 apples", "1234567"),
        ("It is 3.50.", "3.50"),
        ("ratio 3/4", "4"),  # a fraction is not one number without a marker or box
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


# ---------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("81", "81"),
        ("81", "81.0"),
        ("81.00", "81"),
        (" 81 ", "81"),
        ("$81$", "81"),
        ("81.", "81"),
        ("-48", "-48"),
        ("-48.0", "-48"),
        ("+5", "5"),
        ("0.5", ".5"),
        ("-0", "0"),
        ("1,000", "1000"),
        (r"\frac{1}{2}", r"\frac{1}{2}"),
        (r"\frac {1} {2}", r"\frac{1}{2}"),
        ("x + 1", "x+1"),
    ],
)
def test_exact_match_equal(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference, use_math_verify=False)
    assert answers_match(reference, predicted, use_math_verify=False)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        ("81", "82"),
        ("-48", "48"),
        ("81.01", "81"),
        ("3/4", "0.75"),  # no algebra in exact mode: equal only with math-verify
        (r"\frac{3}{4}", "0.75"),
        ("1+x", "x+1"),
        ("1e2", "100"),  # only plain decimals compare by value
        ("inf", "Infinity"),  # Decimal would call these equal; exact mode does not parse them
        ("", "0"),
        ("1,00", "100"),  # not a thousands separator
    ],
)
def test_exact_match_different(predicted: str, reference: str) -> None:
    assert not answers_match(predicted, reference, use_math_verify=False)
    assert not answers_match(reference, predicted, use_math_verify=False)


def test_no_answer_never_matches() -> None:
    assert not answers_match(None, "81")
    assert not answers_match(None, "")


def test_normalize_answer() -> None:
    assert normalize_answer(" $1,234$. ") == "1234"
    assert normalize_answer(r"\frac{1}{2} .") == r"\frac{1}{2}"
    assert normalize_answer("1,2") == "1,2"


def test_reward_is_zero_or_one() -> None:
    assert reward(r"23 + 58 = 81, so \boxed{81}", "81", use_math_verify=False) == 1.0
    assert reward("The answer is 81.0.", "81", use_math_verify=False) == 1.0
    assert reward("I think 80", "81", use_math_verify=False) == 0.0
    assert reward("no idea", "81", use_math_verify=False) == 0.0
    # The last boxed answer counts, not the first.
    assert reward(r"\boxed{81} wait, \boxed{80}", "81", use_math_verify=False) == 0.0
    assert reward("What is 49 - 97? 49 - 97 = -48", "-48", use_math_verify=False) == 1.0


def test_missing_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifiable, "_math_verify", lambda: None)
    assert not math_verify_available()
    assert not answers_match("3/4", "0.75")  # auto mode falls back to exact match
    assert answers_match("81.0", "81")
    with pytest.raises(ImportError, match="pip install math-verify"):
        answers_match("3/4", "0.75", use_math_verify=True)


@pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")
@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        ("3/4", "0.75", True),
        (r"\frac{3}{4}", "0.75", True),
        (r"$\frac{3}{4}$", r"\frac{3}{4}", True),
        ("1+x", "x+1", True),
        (r"\frac{1}{2}", "1/2", True),
        ("0.74", "0.75", False),
        ("82", "81", False),
        (r"\frac{", "1", False),  # unparseable: no match, no exception
    ],
)
def test_math_verify_match(predicted: str, reference: str, expected: bool) -> None:
    assert answers_match(predicted, reference) is expected
    assert answers_match(predicted, reference, use_math_verify=True) is expected


# ------------------------------------------------------------------ short answers (first sentence)


@pytest.mark.parametrize(
    ("text", "reference", "expected"),
    [
        ("Paris. It is also big.", "Paris", 1.0),
        ("It is big. Paris.", "Paris", 0.0),  # a later sentence never scores
        ("Parisian food", "Paris", 0.0),  # a whole word only
        ("It is New York, I think", "new york", 1.0),  # a phrase
        ("The cat sat!", "The cat sat.", 1.0),  # a sentence: punctuation and case aside
        ("The cat sat. The cat sat.", "The cat sat.", 0.0),  # a sentence said once, nothing more
        ("", "Paris", 0.0),
        ("anything", "", 0.0),  # an empty reference is never said
    ],
)
def test_short_answer_reward(text: str, reference: str, expected: float) -> None:
    assert short_answer_reward(text, reference) == expected


def test_short_answer_reward_whole_overrides_the_reference_form() -> None:
    assert short_answer_reward("a cat sat. a cat sat.", "a cat sat") == 1.0  # a phrase
    assert short_answer_reward("a cat sat. a cat sat.", "a cat sat", whole=True) == 0.0
    assert short_answer_reward("Yes, the cat sat", "The cat sat.", whole=False) == 1.0


def test_rollout_rewards_match_as_data_answer_match_says() -> None:
    """The trainer's reward: ``final`` reads the stated final answer (a later sentence counts),
    ``first_sentence`` the short answer at the start only."""
    import torch

    from megatron_gndpo.data.datasets import EncodedPrompt, PromptExample
    from megatron_gndpo.rewards.rollout import rollout_rewards
    from megatron_gndpo.rollout.base import Rollout

    class Chars:  # a tokenizer of one id per character
        def decode(self, ids: list[int]) -> str:
            return "".join(map(chr, ids))

    texts = ["7. Or 8.", "It is 8. The answer is 7"]
    width = 2 + max(map(len, texts))
    tokens = torch.zeros(2, width, dtype=torch.long)
    for i, t in enumerate(texts):
        tokens[i, 2 : 2 + len(t)] = torch.tensor([ord(c) for c in t])
    rollout = Rollout(
        tokens, torch.full((2,), 2), torch.tensor([2 + len(t) for t in texts]),
        torch.zeros(2, width), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool),
    )  # fmt: skip
    prompts = [EncodedPrompt(PromptExample("x?", "7", 0), [0, 0])]
    final = rollout_rewards(rollout, prompts, Chars())  # type: ignore[arg-type]
    first = rollout_rewards(rollout, prompts, Chars(), match="first_sentence")  # type: ignore[arg-type]
    assert final is not None and first is not None
    assert final.tolist() == [0.0, 1.0]  # the last number / the text after "answer is"
    assert first.tolist() == [1.0, 0.0]
