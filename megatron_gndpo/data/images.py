"""Prompts with images: loading, preprocessing and placeholder expansion, done once per row.

A row's text carries one marker (``<image>``) per image. :func:`encode_multimodal` turns the row
into what every model sees:

- ``pixels [N, 3, H, W]``: each image resized (or tiled, InternVL-style, up to ``max_tiles``
  tiles plus a thumbnail) to the encoder's ``image_size`` and normalised with its mean/std;
- ``ids``: the chat-templated prompt in which each image's marker is replaced by
  ``tiles x tokens_per_tile`` copies of the placeholder id, one per image embedding.

Because this happens once, before rollout, the student and the teacher score the very same ids
and pixels. That only works when their image-token layouts agree (placeholder id, tokens per tile,
tile size, tiling, normalisation): :func:`check_same_image_layout` fails clearly otherwise, and
:func:`check_row` checks one row's ids against a layout.

Rows come from JSONL (image paths, relative to the file), Parquet (image bytes, as the
geometry3k release stores them: pyarrow, the ``parquet`` extra) or the built-in visual task.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.datasets import (
    PromptExample,
    check_characters,
    file_records,
    routing_value,
)
from megatron_gndpo.data.tasks import visual
from megatron_gndpo.data.tokenizer import Tokenizer
from megatron_gndpo.errors import DataError, MissingFileError
from megatron_gndpo.fileio import not_a_file

if TYPE_CHECKING:
    from PIL import Image

IMAGE_MARKER = visual.IMAGE_MARKER


@dataclasses.dataclass(frozen=True)
class MultimodalExample:
    """One prompt with its images (paths, bytes or decoded) and reference answer."""

    prompt: str
    answer: str | None
    images: tuple[Any, ...]
    index: int
    source: str | None = None  # the routing value (data.teacher_key), None without


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How images become tokens; student and teacher must share it (the ids are shared)."""

    image_token_id: int
    tokens_per_tile: int
    image_size: int
    max_tiles: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    # tokens written around each image's placeholders (InternVL's <img> and </img>); None: none
    image_start_id: int | None = None
    image_end_id: int | None = None

    @classmethod
    def of(cls, vision: VisionConfig) -> ImageLayout:
        return cls(
            image_token_id=vision.image_token_id,
            tokens_per_tile=vision.tokens_per_tile,
            image_size=vision.image_size,
            max_tiles=vision.max_tiles,
            mean=vision.image_mean,
            std=vision.image_std,
            image_start_id=vision.image_start_id,
            image_end_id=vision.image_end_id,
        )

    def image_ids(self, tiles: int) -> list[int]:
        """The ids one image of ``tiles`` tiles becomes: its placeholders, wrapped when set."""
        ids = [self.image_token_id] * (tiles * self.tokens_per_tile)
        if self.image_start_id is None or self.image_end_id is None:
            return ids
        return [self.image_start_id, *ids, self.image_end_id]


def check_same_image_layout(student: VisionConfig, teacher: VisionConfig) -> None:
    """Fail, naming every difference, unless the teacher can score the student's rows as is."""
    ours, theirs = ImageLayout.of(student), ImageLayout.of(teacher)
    hints = {
        "image_token_id": "both tokenizers must use the same image placeholder id",
        "tokens_per_tile": "choose image_size/patch_size/pixel_shuffle/drop_class_token so "
        "that one tile gives the same number of image tokens",
        "image_size": "both encoders must take tiles of the same size",
        "max_tiles": "tile images the same way",
        "mean": "normalise pixels the same way (image_mean)",
        "std": "normalise pixels the same way (image_std)",
        "image_start_id": "wrap images in the same tokens (image_start_id / image_end_id)",
        "image_end_id": "wrap images in the same tokens (image_start_id / image_end_id)",
    }
    problems = [
        f"{field}: student {getattr(ours, field)} vs teacher {getattr(theirs, field)} ({hint})"
        for field, hint in hints.items()
        if getattr(ours, field) != getattr(theirs, field)
    ]
    if problems:
        raise DataError(
            "the student's and the teacher's image-token layouts differ, so the teacher cannot "
            "score the student's rows:\n  - " + "\n  - ".join(problems)
        )


# ---------------------------------------------------------------------------------------------
# Pixels


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB as transformers' image processors make it: transparency composited onto
    white (a plain ``convert("RGB")`` would drop it and keep the hidden colours)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: Any, base: Path | None = None) -> Image.Image:
    """An RGB image (:func:`to_rgb`) from a path (relative to ``base``), encoded bytes, or a PIL
    image."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return to_rgb(source)
    if isinstance(source, bytes | bytearray):
        with Image.open(io.BytesIO(source)) as image:
            return to_rgb(image).copy()
    path = Path(source)
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.is_file():
        raise MissingFileError(f"image {path} does not exist (paths are relative to the JSONL)")
    with Image.open(path) as image:
        image.load()
        return to_rgb(image).copy()


def tile_grid(width: int, height: int, max_tiles: int, size: int) -> tuple[int, int]:
    """InternVL's grid choice, as transformers' ``GotOcr2ImageProcessor`` (``crop_to_patches``,
    ``min_patches=1``, ``get_optimal_tiled_canvas``) makes it: ``(cols, rows)``, at most
    ``max_tiles`` tiles, whose aspect ratio is closest to the image's.

    Grids are tried by tile count; on a tie in the ratio difference, the later (larger) grid wins
    only while the image's area exceeds half of that grid's canvas (``size``-square tiles),
    InternVL's ``find_closest_aspect_ratio`` condition. A small image keeps fewer tiles: a square
    image of at most ``2·size²`` pixels stays one tile, however large ``max_tiles`` is. Equal to
    theirs for every size tried (``test_tile_grid_matches_transformers``).
    """
    grids = sorted(
        (
            (c, r)
            for c in range(1, max_tiles + 1)
            for r in range(1, max_tiles + 1)
            if c * r <= max_tiles
        ),
        key=lambda g: g[0] * g[1],  # stable: equal counts keep the cols-major order, as theirs
    )
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * size * size * cols * rows:
            best = (cols, rows)
    return best


def tile_image(image: Image.Image, size: int, max_tiles: int) -> list[Image.Image]:
    """``image`` as ``size``-square tiles, as transformers' ``GotOcr2ImageProcessor`` (the PIL one,
    ``crop_to_patches=True, min_patches=1, max_patches=max_tiles``) cuts them: one bicubic resize
    when ``max_tiles == 1`` or the grid is 1x1; else the grid's tiles row by row, cut from one
    bicubic resize to ``cols·size x rows·size``, then a bicubic thumbnail of the whole image.

    A non-RGB image is made RGB first as theirs does: transparency composited onto white.
    Tiles and pixels (after :func:`normalise`) equal theirs exactly (``tests/test_images.py``).
    """
    from PIL import Image

    image = to_rgb(image)
    resample = Image.Resampling.BICUBIC
    if max_tiles == 1:
        return [image.resize((size, size), resample)]
    cols, rows = tile_grid(image.width, image.height, max_tiles, size)
    if cols * rows == 1:
        return [image.resize((size, size), resample)]
    grid = image.resize((cols * size, rows * size), resample)
    tiles = [
        grid.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
        for r in range(rows)
        for c in range(cols)
    ]
    return [*tiles, image.resize((size, size), resample)]


def normalise(tiles: Sequence[Image.Image], layout: ImageLayout) -> torch.Tensor:
    """Tiles as float32 ``[N, 3, H, W]``: pixel values in [0, 1], minus mean, over std.

    The order and precision of transformers' ``GotOcr2ImageProcessor`` (PIL backend): rescale by
    1/255 then normalise, both in float32; its ``pixel_values`` equal ours exactly (max abs
    difference 0.0). vLLM's and transformers' torchvision processor (v5 ``GotOcr2ImageProcessor``,
    v4 ``GotOcr2ImageProcessorFast``) picks the same grids but resizes with torch's antialiased
    bicubic instead of PIL's and folds the 1/255 into mean/std: measured up to 2 uint8 levels
    apart (0.035 after /std) on smooth images, up to 25 (0.438) on random noise
    (``test_fast_processor_is_close``).
    """
    import numpy as np

    pixels = torch.stack(
        [torch.from_numpy(np.asarray(t, dtype=np.uint8).copy()) for t in tiles]
    )  # [N, H, W, 3]
    x = pixels.permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(layout.mean).view(1, 3, 1, 1)
    std = torch.tensor(layout.std).view(1, 3, 1, 1)
    return (x - mean) / std


# ---------------------------------------------------------------------------------------------
# Token ids


@dataclasses.dataclass(frozen=True)
class MultimodalRow:
    """A prompt ready for any model with this layout: expanded ids and normalised tiles."""

    example: MultimodalExample
    ids: list[int]
    pixels: torch.Tensor | None  # [N, 3, H, W]; None without images
    tiles_per_image: tuple[int, ...]


def expand_markers(
    ids: Sequence[int],
    marker_ids: Sequence[int],
    tiles_per_image: Sequence[int],
    layout: ImageLayout,
) -> list[int]:
    """``ids`` with the i-th occurrence of ``marker_ids`` replaced by image i's placeholders
    (:meth:`ImageLayout.image_ids`)."""
    if not marker_ids:
        raise DataError("the image marker encodes to no tokens; use a marker the tokenizer keeps")
    if layout.image_token_id in ids:
        raise DataError(
            f"the prompt's text already contains the image placeholder id "
            f"{layout.image_token_id}; choose a placeholder id the tokenizer never produces"
        )
    out: list[int] = []
    t, k, m = 0, 0, len(marker_ids)
    while t < len(ids):
        if list(ids[t : t + m]) == list(marker_ids):
            if k == len(tiles_per_image):
                raise DataError(
                    f"the prompt has more {IMAGE_MARKER} markers than its {len(tiles_per_image)} "
                    "image(s); give one image per marker"
                )
            out += layout.image_ids(tiles_per_image[k])
            t, k = t + m, k + 1
        else:
            out.append(int(ids[t]))
            t += 1
    if k != len(tiles_per_image):
        raise DataError(
            f"the prompt has {k} {IMAGE_MARKER} marker(s) but {len(tiles_per_image)} image(s); "
            f"put one {IMAGE_MARKER} in the prompt where each image goes"
        )
    return out


def encode_multimodal(
    example: MultimodalExample,
    tokenizer: Tokenizer,
    layout: ImageLayout,
    *,
    base: Path | None = None,
    marker: str = IMAGE_MARKER,
) -> MultimodalRow:
    """The row's expanded, chat-templated ids and its normalised tiles (see the module doc)."""
    check_characters(PromptExample(example.prompt, example.answer, example.index), tokenizer)
    tiles: list[Image.Image] = []
    tiles_per_image = []
    for source in example.images:
        image_tiles = tile_image(load_image(source, base), layout.image_size, layout.max_tiles)
        tiles += image_tiles
        tiles_per_image.append(len(image_tiles))
    ids = expand_markers(
        tokenizer.apply_chat_template(example.prompt),
        tokenizer.encode(marker),
        tiles_per_image,
        layout,
    )
    pixels = normalise(tiles, layout) if tiles else None
    row = MultimodalRow(example, ids, pixels, tuple(tiles_per_image))
    check_row(row.ids, row.tiles_per_image, layout)
    return row


def check_row(ids: Sequence[int], tiles_per_image: Sequence[int], layout: ImageLayout) -> None:
    """Fail unless ``ids`` hold, per image, one contiguous run of its placeholders."""
    runs, t = [], 0
    while t < len(ids):
        if ids[t] == layout.image_token_id:
            start = t
            while t < len(ids) and ids[t] == layout.image_token_id:
                t += 1
            runs.append(t - start)
        else:
            t += 1
    expected = [n * layout.tokens_per_tile for n in tiles_per_image]
    # adjacent images merge into one run; compare totals and the run boundaries they allow
    if sum(runs) != sum(expected) or any(r % layout.tokens_per_tile for r in runs):
        raise DataError(
            f"the row's image placeholders (id {layout.image_token_id}) form runs {runs}, but "
            f"its images need {expected} ({layout.tokens_per_tile} per tile): the ids were "
            "expanded for another image-token layout (check_same_image_layout)"
        )


# ---------------------------------------------------------------------------------------------
# Data sets


def load_multimodal_prompts(
    spec: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    image_key: str = "images",
    source_key: str | None = None,
) -> list[MultimodalExample]:
    """Prompts with images from ``.jsonl`` (paths), ``.parquet`` (bytes) or ``builtin:visual``.

    ``image_key`` holds one image or a list: a path (JSONL, relative to the file), bytes, or a
    ``{"bytes": ..., "path": ...}`` struct (Hugging Face ``datasets`` Image columns in Parquet).
    """
    if spec in (f"builtin:{name}" for name in BUILTIN_VISUAL):
        return BUILTIN_VISUAL[spec.removeprefix("builtin:")]()
    path = Path(spec)
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(
            f"cannot read multimodal prompts from {spec!r}: use a .jsonl file (image paths), a "
            f".parquet file (image bytes) or one of "
            + ", ".join(f"builtin:{n}" for n in BUILTIN_VISUAL)
        )
    why = not_a_file(path)
    if why is not None:
        raise MissingFileError(f"prompt file {why}")
    records = file_records(
        path,
        without_pyarrow="Parquet needs pyarrow, which is not installed; `pip install "
        "'megatron-gndpo[parquet]'` (or pyarrow), or convert the rows to .jsonl with image paths",
    )
    examples = [
        _example(
            record,
            where,
            index,
            prompt_key,
            answer_key,
            image_key,
            base=path.parent,
            source_key=source_key,
        )
        for index, (where, record) in enumerate(records)
    ]
    if not examples:
        raise DataError(f"prompt file {path} contains no records")
    return examples


def _example(
    record: Mapping[str, Any],
    where: str,
    index: int,
    prompt_key: str,
    answer_key: str,
    image_key: str,
    *,
    base: Path,
    source_key: str | None = None,
) -> MultimodalExample:
    prompt = record.get(prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(
            f"{where}: {prompt_key!r} must be a non-empty string; the record has {sorted(record)}"
        )
    raw = record.get(image_key)
    items = [] if raw is None else raw if isinstance(raw, list) else [raw]
    images = tuple(_image_source(item, where, base) for item in items)
    if prompt.count(IMAGE_MARKER) != len(images):
        raise DataError(
            f"{where}: the prompt has {prompt.count(IMAGE_MARKER)} {IMAGE_MARKER} marker(s) but "
            f"the record has {len(images)} image(s) in {image_key!r}; put one marker per image"
        )
    answer = record.get(answer_key)
    text = None if answer is None else answer if isinstance(answer, str) else json.dumps(answer)
    source = None if source_key is None else routing_value(record, source_key, where)
    return MultimodalExample(prompt=prompt, answer=text, images=images, index=index, source=source)


def _image_source(item: Any, where: str, base: Path) -> str | bytes:
    if isinstance(item, dict):  # a datasets Image struct
        item = item.get("bytes") or item.get("path")
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str) and item:
        return str(_inside(base, item, where))
    raise DataError(
        f"{where}: an image must be a path, bytes or a {{'bytes', 'path'}} struct; got "
        f"{type(item).__name__}"
    )


def _inside(base: Path, item: str, where: str) -> Path:
    """``base / item``, refused when it leaves ``base`` (an absolute path, or ``..`` past it):
    a prompt file may only name images in its own directory tree. Checked on the names, not
    on resolved links, so a symbolic link inside the directory may point anywhere."""
    path = Path(os.path.normpath(base / item))
    root = Path(os.path.normpath(base))
    if Path(item).is_absolute() or not path.is_relative_to(root):
        raise DataError(
            f"{where}: image {item!r} is outside the prompt file's directory {root}; image paths "
            "are relative to the prompt file and must stay inside its directory: move the "
            "images there (or link them into it)"
        )
    return path


def _builtin_visual(seed: int, n: int) -> list[MultimodalExample]:
    problems = visual.generate(n, seed, visual.DEFAULT_DIFFICULTY)
    return [
        MultimodalExample(prompt=p.prompt, answer=p.answer, images=(p.image,), index=i)
        for i, p in enumerate(problems)
    ]


# Built-in sets (builtin:visual, builtin:visual_eval), each from its own seed.
BUILTIN_VISUAL = {
    "visual": lambda: _builtin_visual(visual.TRAIN_SEED, 256),
    "visual_eval": lambda: _builtin_visual(visual.EVAL_SEED, 64),
}
