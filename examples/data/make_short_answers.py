"""Write the short-answer prompt sets of the SmolLM2 distillation example (no downloads).

    python examples/data/make_short_answers.py          # rewrites the two files beside it

Four kinds of question SmolLM2-135M-Instruct answers in one short sentence that ends with
``<|im_end|>`` well inside 24 tokens, and mostly right (its arithmetic is not: "12 + 7 = 9"):
capital cities, opposites, plurals, and repeating a sentence. Measured on its greedy answers
(benchmarks/results/real-distill-cpu-2026-12-05.md): the teacher is right on about four in five
of the held-out questions.

Each line is ``{"prompt", "reference", "task"}``. The reference is deliberately not in the
``answer`` field: the trainer's verifiable reward extracts numbers and boxed answers, which these
are not. ``benchmarks/real_distill.py`` scores them (``task_score``): for ``repeat`` the answer
must be the sentence, for the others the reference must appear as a whole word or phrase.

``short_answers_eval.jsonl`` holds 16 questions of each kind, ``short_answers_train.jsonl`` the
rest; the split is seeded, so rerunning this script rewrites the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL_PER_TASK = 16
SEED = 0

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "England": "London", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw",
    "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Cuba": "Havana",
    "Thailand": "Bangkok", "South Korea": "Seoul", "Iran": "Tehran", "Hungary": "Budapest",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Argentina": "Buenos Aires", "Chile": "Santiago",
    "India": "New Delhi", "Turkey": "Ankara", "Australia": "Canberra", "Brazil": "Brasilia",
    "the United States": "Washington", "Scotland": "Edinburgh", "Wales": "Cardiff",
    "Iceland": "Reykjavik", "Switzerland": "Bern", "the Czech Republic": "Prague",
    "Romania": "Bucharest", "Bulgaria": "Sofia", "Ukraine": "Kyiv", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Vietnam": "Hanoi", "the Philippines": "Manila",
    "Indonesia": "Jakarta", "Pakistan": "Islamabad", "Saudi Arabia": "Riyadh",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Israel": "Jerusalem",
    "New Zealand": "Wellington", "Croatia": "Zagreb",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "happy": "sad", "day": "night",
    "open": "closed", "light": "dark", "tall": "short", "wet": "dry", "hard": "soft",
    "good": "bad", "left": "right", "early": "late", "rich": "poor", "strong": "weak",
    "black": "white", "win": "lose", "push": "pull", "buy": "sell", "high": "low",
    "love": "hate", "yes": "no", "heavy": "light", "thick": "thin", "true": "false",
    "above": "below", "before": "after", "inside": "outside", "near": "far", "first": "last",
    "north": "south", "east": "west", "laugh": "cry", "sweet": "sour", "loud": "quiet",
    "cheap": "expensive", "friend": "enemy", "remember": "forget", "give": "take",
    "arrive": "leave", "wide": "narrow", "question": "answer", "always": "never",
    "increase": "decrease", "accept": "reject", "summer": "winter", "awake": "asleep",
    "alive": "dead", "war": "peace",
}  # fmt: skip
PLURALS = {
    "cat": "cats", "box": "boxes", "child": "children", "mouse": "mice", "man": "men",
    "woman": "women", "foot": "feet", "tooth": "teeth", "baby": "babies", "city": "cities",
    "book": "books", "car": "cars", "bus": "buses", "leaf": "leaves", "knife": "knives",
    "person": "people", "apple": "apples", "house": "houses", "glass": "glasses",
    "story": "stories", "wolf": "wolves", "church": "churches", "wish": "wishes",
    "party": "parties", "lady": "ladies", "potato": "potatoes", "tomato": "tomatoes",
    "hero": "heroes", "wife": "wives", "life": "lives", "half": "halves", "dish": "dishes",
    "class": "classes", "toy": "toys", "key": "keys", "day": "days", "chair": "chairs",
    "bird": "birds", "tree": "trees", "flower": "flowers", "country": "countries",
    "family": "families", "watch": "watches", "brush": "brushes",
}  # fmt: skip
SUBJECTS = ["The cat", "My brother", "Our teacher", "A small dog", "The old man", "She", "We",
            "The children", "My friend", "The farmer"]  # fmt: skip
ACTIONS = ["walks to the park", "reads a book", "drinks warm milk", "sings a song",
           "paints the fence", "opens the door", "waters the garden", "plays the piano",
           "bakes fresh bread", "feeds the birds"]  # fmt: skip
TIMES = ["every morning", "after lunch", "on Sundays", "at night", "in the summer"]
REPEATS = 60


def _agree(subject: str, action: str) -> str:
    """The verb of ``action`` in the form ``subject`` takes (plural subjects drop the -s)."""
    if subject not in ("We", "The children"):
        return action
    verb, rest = action.split(" ", 1)
    return f"{verb[:-1]} {rest}"  # every verb of ACTIONS takes a plain -s


def records() -> list[dict[str, str]]:
    """Every question, in a fixed order (the split shuffles them)."""
    rng = random.Random(SEED)
    rows = [{"task": "capital", "reference": city,
             "prompt": f"What is the capital of {country}? Answer with the city name only."}
            for country, city in CAPITALS.items()]  # fmt: skip
    rows += [{"task": "opposite", "reference": other,
              "prompt": f'What is the opposite of "{word}"? Answer with one word.'}
             for word, other in OPPOSITES.items()]  # fmt: skip
    rows += [{"task": "plural", "reference": many,
              "prompt": f'What is the plural of "{one}"? Answer with one word.'}
             for one, many in PLURALS.items()]  # fmt: skip
    sentences: set[str] = set()
    while len(sentences) < REPEATS:
        subject = rng.choice(SUBJECTS)
        action = _agree(subject, rng.choice(ACTIONS))
        sentences.add(f"{subject} {action} {rng.choice(TIMES)}.")
    rows += [{"task": "repeat", "reference": s, "prompt": f"Repeat this sentence exactly: {s}"}
             for s in sorted(sentences)]  # fmt: skip
    return rows


def split(rows: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval): ``EVAL_PER_TASK`` questions of each kind held out, drawn with ``SEED``."""
    rng = random.Random(SEED)
    train, held_out = [], []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        rng.shuffle(mine)
        held_out += mine[:EVAL_PER_TASK]
        train += mine[EVAL_PER_TASK:]
    rng.shuffle(train)
    return train, held_out


def main() -> None:
    train, held_out = split(records())
    for part, rows in (("train", train), ("eval", held_out)):
        name = f"short_answers_{part}.jsonl"
        with (HERE / name).open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {HERE / name}: {len(rows)} questions")


if __name__ == "__main__":
    main()
