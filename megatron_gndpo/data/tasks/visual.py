"""Built-in visual reasoning task: digits drawn on a small canvas, their sum or product.

    image:     a 56x56 canvas showing "4 9 7" (seven-segment digits)
    prompt:    "<image>\\nWhat is the sum of the digits shown?"
    solution:  "The digits are 4, 9, 7. 4 + 9 + 7 = 20, so \\boxed{20}"
    answer:    "20"

The answer needs both reading the image and a short computation; the worked solution first
names the digits (the reading step), then computes. Digits are drawn as seven-segment glyphs
with PIL line primitives (no font file, so the pixels are the same on every platform and Pillow
version), at a random offset, stroke width and colour pair.

``difficulty``: 1 = two digits, sum; 2 = three digits, sum; 3 = two or three digits, sum or
product, with a random background tint. Deterministic from ``(n, seed, difficulty, size)``
(Python's ``random.Random`` with an integer seed gives the same stream everywhere).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING

from megatron_gndpo.data.tasks.request import check_request

if TYPE_CHECKING:
    from PIL import Image, ImageDraw

# The text marker where the image goes in a prompt; data/images.py expands it into the image's
# placeholder tokens.
IMAGE_MARKER = "<image>"

MAX_DIFFICULTY = 3
DEFAULT_DIFFICULTY = 2
DEFAULT_SIZE = 56
# Below this a seven-segment digit is a few pixels tall and stops being readable.
MIN_SIZE = 28

TRAIN_SEED = 0
EVAL_SEED = 1

# Segments a..g of a seven-segment display: a top, b top-right, c bottom-right, d bottom,
# e bottom-left, f top-left, g middle.
_SEGMENTS = {
    0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg",
    5: "acdfg", 6: "acdefg", 7: "abc", 8: "abcdefg", 9: "abcdfg",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class VisualProblem:
    """One image, its question, the worked solution (ending in ``\\boxed{answer}``), the answer."""

    image: Image.Image
    prompt: str
    solution: str
    answer: str
    digits: tuple[int, ...]


def generate(
    n: int, seed: int = 0, difficulty: int = DEFAULT_DIFFICULTY, size: int = DEFAULT_SIZE
) -> list[VisualProblem]:
    """``n`` problems on ``size`` x ``size`` RGB canvases."""
    check_request(
        "visual", n, difficulty, MAX_DIFFICULTY,
        f"1..{MAX_DIFFICULTY} (1: two digits, sum; 2: three digits, sum; 3: two or three "
        "digits, sum or product)",
    )  # fmt: skip
    if size < MIN_SIZE:
        raise ValueError(
            f"visual canvases need size >= {MIN_SIZE} pixels to be legible, got {size}"
        )
    rng = random.Random(seed)
    return [_problem(rng, difficulty, size) for _ in range(n)]


def _problem(rng: random.Random, difficulty: int, size: int) -> VisualProblem:
    count = 2 if difficulty == 1 else 3 if difficulty == 2 else rng.choice((2, 3))
    operation = "product" if difficulty == 3 and rng.random() < 0.5 else "sum"
    digits = tuple(rng.randint(0, 9) for _ in range(count))
    image = render(digits, rng, size, tinted=difficulty == 3)
    symbol = " x " if operation == "product" else " + "
    value = math.prod(digits) if operation == "product" else sum(digits)
    listed = ", ".join(str(d) for d in digits)
    worked = symbol.join(str(d) for d in digits) + f" = {value}"
    return VisualProblem(
        image=image,
        prompt=f"{IMAGE_MARKER}\nWhat is the {operation} of the digits shown?",
        solution=f"The digits are {listed}. {worked}, so \\boxed{{{value}}}",
        answer=str(value),
        digits=digits,
    )


def render(
    digits: tuple[int, ...], rng: random.Random, size: int, *, tinted: bool = False
) -> Image.Image:
    """``digits`` left to right as seven-segment glyphs on a ``size`` square canvas."""
    from PIL import Image, ImageDraw

    dark = rng.randint(0, 60)
    background = (255, 255, 255)
    if tinted:
        background = tuple(rng.randint(170, 255) for _ in range(3))  # type: ignore[assignment]
    ink = (dark, dark, rng.randint(0, 120))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    cell = size // (len(digits) + 1)  # glyph width plus spacing
    width, height = max(cell * 2 // 3, 4), max(size // 2, 8)
    stroke = max(1, size // 28 + rng.randint(0, 1))
    x = rng.randint(1, max(1, size - len(digits) * cell - 1))
    y = rng.randint(1, size - height - 1)
    for digit in digits:
        _draw_digit(draw, digit, x, y, width, height, ink, stroke)
        x += cell
    return image


def _draw_digit(
    draw: ImageDraw.ImageDraw,
    digit: int,
    x: int,
    y: int,
    w: int,
    h: int,
    ink: tuple[int, int, int],
    stroke: int,
) -> None:
    mid = y + h // 2
    ends = {
        "a": ((x, y), (x + w, y)),
        "b": ((x + w, y), (x + w, mid)),
        "c": ((x + w, mid), (x + w, y + h)),
        "d": ((x, y + h), (x + w, y + h)),
        "e": ((x, mid), (x, y + h)),
        "f": ((x, y), (x, mid)),
        "g": ((x, mid), (x + w, mid)),
    }
    for segment in _SEGMENTS[digit]:
        draw.line(ends[segment], fill=ink, width=stroke)
