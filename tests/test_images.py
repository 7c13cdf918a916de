"""Image prompts: the built-in visual task, preprocessing, placeholder expansion, layout checks."""

from __future__ import annotations

import importlib.util
import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data import images as img
from megatron_gndpo.data.tasks import visual
from megatron_gndpo.data.tokenizer import CharTokenizer

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
VISION = VisionConfig(image_size=28, patch_size=7, image_token_id=CharTokenizer.UNK_ID)
LAYOUT = img.ImageLayout.of(VISION)


def test_visual_task_is_deterministic_and_checkable() -> None:
    for difficulty in (1, 2, 3):
        a = visual.generate(20, seed=3, difficulty=difficulty)
        b = visual.generate(20, seed=3, difficulty=difficulty)
        assert [p.prompt for p in a] == [p.prompt for p in b]
        assert all(p.image.tobytes() == q.image.tobytes() for p, q in zip(a, b, strict=True))
        for p in a:
            assert p.prompt.startswith(visual.IMAGE_MARKER) and p.image.size == (56, 56)
            product = "product" in p.prompt
            value = 1 if product else 0
            for d in p.digits:
                value = value * d if product else value + d
            assert p.answer == str(value) and p.solution.endswith(f"\\boxed{{{value}}}")
            assert len(p.digits) == {1: 2, 2: 3}.get(difficulty, len(p.digits))
    assert any("product" in p.prompt for p in visual.generate(20, seed=3, difficulty=3))
    assert (
        visual.generate(5, seed=1)[0].image.tobytes()
        != visual.generate(5, seed=2)[0].image.tobytes()
    )
    with pytest.raises(ValueError, match="difficulty"):
        visual.generate(1, difficulty=4)
    with pytest.raises(ValueError, match="legible"):
        visual.generate(1, size=20)


def test_digits_are_drawn_where_they_should_be() -> None:
    # an 8 lights every segment, a 1 only the right ones: the 8 has more ink
    rng = random.Random(0)
    eight = visual.render((8,), random.Random(0), 56)
    one = visual.render((1,), rng, 56)
    ink = lambda im: int((np.asarray(im) != 255).any(-1).sum())
    assert ink(eight) > 2 * ink(one) > 0


def test_tiling_and_normalisation() -> None:
    from PIL import Image

    wide = Image.new("RGB", (200, 100), (255, 0, 0))
    assert img.tile_grid(200, 100, 6, 28) == (2, 1)
    tiles = img.tile_image(wide, 28, max_tiles=6)
    assert len(tiles) == 3 and all(t.size == (28, 28) for t in tiles)  # 2 tiles + thumbnail
    assert len(img.tile_image(wide, 28, max_tiles=1)) == 1
    pixels = img.normalise(tiles, LAYOUT)
    assert pixels.shape == (3, 3, 28, 28) and pixels.dtype == torch.float32
    red = (1.0 - LAYOUT.mean[0]) / LAYOUT.std[0]
    torch.testing.assert_close(pixels[:, 0], torch.full((3, 28, 28), red))


def test_encode_expands_markers_once_for_student_and_teacher() -> None:
    tok = CharTokenizer()
    problem = visual.generate(1, seed=0)[0]
    example = img.MultimodalExample(problem.prompt, problem.answer, (problem.image,), 0)
    row = img.encode_multimodal(example, tok, LAYOUT)
    n = VISION.tokens_per_tile
    start = row.ids.index(LAYOUT.image_token_id)
    assert row.ids[start : start + n] == [LAYOUT.image_token_id] * n
    assert row.ids.count(LAYOUT.image_token_id) == n
    assert tok.decode(row.ids[start + n :]) == "\nWhat is the sum of the digits shown?\nA: "
    assert row.pixels is not None and row.pixels.shape == (1, 3, 28, 28)
    assert row.tiles_per_image == (1,)
    # a teacher with the same layout accepts the row; another layout fails clearly
    teacher = VisionConfig(
        encoder="internvit", image_size=28, patch_size=7, pixel_shuffle=True, image_token_id=3,
        hidden_size=64, num_layers=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="tokens_per_tile: student 16 vs teacher 4"):
        img.check_same_image_layout(VISION, teacher)
    with pytest.raises(ValueError, match="image_token_id: student 3 vs teacher 5"):
        img.check_same_image_layout(VISION, VisionConfig(image_size=28, image_token_id=5))
    img.check_same_image_layout(
        VISION, VisionConfig(hidden_size=64, num_layers=4, image_token_id=3)
    )
    with pytest.raises(ValueError, match="another image-token layout"):
        img.check_row(row.ids, row.tiles_per_image, img.ImageLayout.of(teacher))


def test_marker_count_must_match_images() -> None:
    tok = CharTokenizer()
    marker = tok.encode(img.IMAGE_MARKER)
    ids = tok.encode("a <image> b <image>")
    with pytest.raises(ValueError, match="2 <image> marker"):
        img.expand_markers(ids, marker, [1, 1, 1], LAYOUT)
    with pytest.raises(ValueError, match="more <image> markers"):
        img.expand_markers(tok.encode("<image><image>"), marker, [1], LAYOUT)
    with pytest.raises(ValueError, match="already contains the image placeholder"):
        img.expand_markers([LAYOUT.image_token_id], marker, [], LAYOUT)
    out = img.expand_markers(ids, marker, [1, 2], LAYOUT)
    assert out.count(LAYOUT.image_token_id) == 3 * VISION.tokens_per_tile


def test_jsonl_rows_with_image_paths(tmp_path: Path) -> None:
    problems = visual.generate(2, seed=4)
    lines = []
    for i, p in enumerate(problems):
        p.image.save(tmp_path / f"{i}.png")
        lines.append(
            json.dumps({"prompt": p.prompt, "answer": int(p.answer), "images": [f"{i}.png"]})
        )
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    examples = img.load_multimodal_prompts(str(tmp_path / "rows.jsonl"))
    assert [e.answer for e in examples] == [p.answer for p in problems]
    row = img.encode_multimodal(examples[1], CharTokenizer(), LAYOUT)
    direct = img.normalise(img.tile_image(problems[1].image, 28, 1), LAYOUT)
    assert row.pixels is not None and torch.equal(row.pixels, direct)  # PNG is lossless
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "no marker", "images": ["0.png"]}))
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: the prompt has 0 <image> marker"):
        img.load_multimodal_prompts(str(tmp_path / "bad.jsonl"))


def test_parquet_style_records_with_image_bytes(tmp_path: Path) -> None:
    problem = visual.generate(1, seed=5)[0]
    buffer = io.BytesIO()
    problem.image.save(buffer, format="PNG")
    record = {"prompt": problem.prompt, "answer": problem.answer,
              "images": [{"bytes": buffer.getvalue(), "path": None}]}  # fmt: skip
    example = img._example(record, "x row 0", 0, "prompt", "answer", "images", base=tmp_path)
    assert example.images == (buffer.getvalue(),)
    assert img.load_image(example.images[0]).tobytes() == problem.image.tobytes()
    if HAS_PYARROW:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([record]), tmp_path / "rows.parquet")
        loaded = img.load_multimodal_prompts(str(tmp_path / "rows.parquet"))
        assert loaded[0].images == (buffer.getvalue(),)
    else:
        (tmp_path / "rows.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match=r"megatron-gndpo\[parquet\]"):
            img.load_multimodal_prompts(str(tmp_path / "rows.parquet"))


def test_builtin_visual_sets() -> None:
    train = img.load_multimodal_prompts("builtin:visual")
    held_out = img.load_multimodal_prompts("builtin:visual_eval")
    assert len(train) == 256 and len(held_out) == 64
    assert train[0].images[0].tobytes() != held_out[0].images[0].tobytes()


# ---------------------------------------------------------------------------------------------
# Tiling against transformers' InternVL image processor (GotOcr2ImageProcessor, crop_to_patches)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # InternVL's (ImageNet) mean/std


def _sides(size: int) -> list[int]:
    """Tiny, just under/at/over one tile, exact multiples and odd sizes of a ``size`` tile."""
    return sorted({1, 2, 3, size // 2, size - 1, size, size + 1, 2 * size, 3 * size - 5,
                   5 * size // 2, 4 * size + 3, 7 * size})  # fmt: skip


def _slow_processor() -> type:
    """The PIL/numpy GotOcr2 processor: ``GotOcr2ImageProcessorPil`` in transformers 5,
    ``GotOcr2ImageProcessor`` in 4."""
    pytest.importorskip("transformers")
    try:
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
            GotOcr2ImageProcessorPil,
        )
    except ImportError:
        from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor

        return GotOcr2ImageProcessor
    return GotOcr2ImageProcessorPil


def _fast_processor() -> type:
    """The torchvision one (vLLM's): ``GotOcr2ImageProcessor`` in 5, ``...Fast`` in 4."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    if importlib.util.find_spec("transformers.models.got_ocr2.image_processing_pil_got_ocr2"):
        from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor

        return GotOcr2ImageProcessor  # transformers 5: the torchvision backend
    from transformers.models.got_ocr2.image_processing_got_ocr2_fast import (
        GotOcr2ImageProcessorFast,
    )

    return GotOcr2ImageProcessorFast


def _hf_pixels(processor: type, image: Any, size: int, max_tiles: int) -> torch.Tensor:
    hf = processor(
        size={"height": size, "width": size}, crop_to_patches=True, min_patches=1,
        max_patches=max_tiles, image_mean=list(MEAN), image_std=list(STD),
    )  # fmt: skip
    return hf(images=[image], return_tensors="pt")["pixel_values"]


def _ours(image: Any, size: int, max_tiles: int) -> torch.Tensor:
    layout = img.ImageLayout(0, 1, size, max_tiles, MEAN, STD)
    return img.normalise(img.tile_image(image, size, max_tiles), layout)


def _noise(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_tile_grid_matches_transformers() -> None:
    slow = _slow_processor()
    module = importlib.import_module(slow.__module__)
    for size in (28, 448):
        for width in _sides(size):
            for height in _sides(size):
                for max_tiles in range(1, 13):
                    theirs = module.get_optimal_tiled_canvas(
                        (height, width), (size, size), 1, max_tiles
                    )
                    where = (width, height, max_tiles, size)
                    assert img.tile_grid(width, height, max_tiles, size) == theirs, where
                    kwargs = {"crop_to_patches": True, "min_patches": 1, "max_patches": max_tiles}
                    n = slow(size={"height": size, "width": size}).get_number_of_image_patches(
                        height, width, kwargs
                    )
                    cols, rows = theirs
                    assert n == (1 if max_tiles == 1 or cols * rows == 1 else cols * rows + 1)
    # ties in the ratio difference go to more tiles only while the image covers over half of
    # their canvas (InternVL's area condition): a square image of 39² < 2·28² stays one tile
    assert img.tile_grid(39, 39, 12, 28) == (1, 1)
    assert img.tile_grid(40, 40, 12, 28) == (2, 2)
    assert img.tile_grid(100, 100, 12, 28) == (3, 3)
    assert img.tile_grid(125, 100, 6, 28) == (3, 2)  # 1.25: as far from 1 as from 1.5
    assert img.tile_grid(10, 8, 6, 28) == (1, 1)
    assert img.tile_grid(28, 100, 12, 28) == (1, 4)  # tall: one column, rows top to bottom


def test_tiles_and_pixels_equal_the_slow_processor() -> None:
    """Same grid, tile order, thumbnail, PIL bicubic and float32 rescale-then-normalise as
    transformers' PIL GotOcr2 processor: ``pixel_values`` equal ours exactly (max abs diff 0)."""
    from PIL import Image

    slow = _slow_processor()
    size, seed = 28, 0
    for width in _sides(size):
        for height in _sides(size):
            seed += 1
            image = _noise(width, height, seed)
            for max_tiles in (1, 2, 4, 6, 12):
                theirs = _hf_pixels(slow, image, size, max_tiles)
                ours = _ours(image, size, max_tiles)
                assert theirs.dtype == ours.dtype == torch.float32
                assert torch.equal(ours, theirs), (width, height, max_tiles)
    # a larger tile size, a tie case and a wide and a tall image
    for width, height in ((448, 448), (1000, 800), (1600, 450), (300, 1200)):
        image = _noise(width, height, width + height)
        for max_tiles in (1, 6, 12):
            theirs = _hf_pixels(slow, image, 448, max_tiles)
            assert torch.equal(_ours(image, 448, max_tiles), theirs), (width, height, max_tiles)
    # non-RGB inputs: transparency goes onto white, as theirs does
    rgba = np.asarray(_noise(70, 50, 1)).copy()
    alpha = np.random.default_rng(2).integers(0, 256, (50, 70, 1), dtype=np.uint8)
    rgba_image = Image.fromarray(np.concatenate([rgba, alpha], -1), "RGBA")
    for image in (rgba_image, Image.fromarray(rgba[..., 0], "L")):
        for max_tiles in (1, 4):
            theirs = _hf_pixels(slow, image, size, max_tiles)
            assert torch.equal(_ours(image, size, max_tiles), theirs), image.mode


def test_fast_processor_is_close() -> None:
    """The torchvision GotOcr2 processor (vLLM's) picks the same grids, but resizes with torch's
    antialiased bicubic instead of PIL's and folds the 1/255 into mean/std. Measured max abs
    difference from ours (torchvision 0.29.1, torch 2.14.1, transformers 5.24): at most 2 uint8
    levels (0.035 after /std) on smooth images and the built-in visual task, but up to 23 here
    (25, 0.438, with other seeds) on random noise resized up along one side and down along the
    other (e.g. 14x29 -> 28x28); most noise cases differ by at most 1 level (0.0175)."""
    from PIL import Image, ImageFilter

    fast = _fast_processor()
    level = 1 / 255 / min(STD)  # one uint8 level after normalisation
    smooth = []
    rng = np.random.default_rng(0)
    for width, height in ((640, 480), (300, 900), (1000, 200), (448, 448), (50, 70), (896, 448)):
        coarse = rng.integers(0, 256, (height // 16 + 2, width // 16 + 2, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
        smooth.append(image.filter(ImageFilter.GaussianBlur(2)))
    smooth += [p.image for p in visual.generate(6, seed=0)]
    for image in smooth:
        for size in (28, 448):
            for max_tiles in (1, 2, 4, 6, 12):
                ours = _ours(image, size, max_tiles)
                theirs = _hf_pixels(fast, image, size, max_tiles)
                assert ours.shape == theirs.shape
                assert (ours - theirs).abs().max().item() <= 2 * level + 1e-5
    worst, size, seed = 0.0, 28, 0
    for width in _sides(size):
        for height in _sides(size):
            seed += 1
            image = _noise(width, height, seed)
            for max_tiles in (1, 4, 12):
                ours = _ours(image, size, max_tiles)
                theirs = _hf_pixels(fast, image, size, max_tiles)
                assert ours.shape == theirs.shape, (width, height, max_tiles)
                worst = max(worst, (ours - theirs).abs().max().item())
    assert worst <= 32 * level  # measured: 23 levels (0.403) with these seeds


def test_images_wrapped_in_start_and_end_ids() -> None:
    vision = VisionConfig(image_token_id=3, image_start_id=4, image_end_id=5)
    layout = img.ImageLayout.of(vision)
    assert layout.image_ids(2) == [4] + [3] * (2 * vision.tokens_per_tile) + [5]
    ids = img.expand_markers([7, 8, 9, 8], [8], (1, 2), layout)
    n = vision.tokens_per_tile
    assert ids == [7, 4, *[3] * n, 5, 9, 4, *[3] * (2 * n), 5]
    img.check_row(ids, (1, 2), layout)
    theirs = img.ImageLayout.of(VisionConfig(image_token_id=3))
    with pytest.raises(ValueError, match="image_start_id"):
        img.check_same_image_layout(vision, VisionConfig(image_token_id=3))
    assert theirs.image_ids(1) == [3] * n
    with pytest.raises(ValueError, match="both image_start_id and image_end_id"):
        VisionConfig(image_start_id=4)
    with pytest.raises(ValueError, match="three different ids"):
        VisionConfig(image_token_id=3, image_start_id=3, image_end_id=5)


def test_load_image_puts_transparency_on_white() -> None:
    from PIL import Image

    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent, dark colour beneath
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    buffer = io.BytesIO()
    rgba.save(buffer, format="PNG")
    for source in (rgba, buffer.getvalue()):
        image = img.load_image(source)
        assert image.mode == "RGB"
        assert image.getpixel((1, 1)) == (255, 255, 255) and image.getpixel((0, 0)) == (10, 20, 30)


def test_image_paths_must_stay_inside_the_prompt_files_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    inside = img._image_source("sub/../a.png", "p.jsonl:1", data)
    assert inside == str(data / "a.png")
    for item in ("../secret.png", "sub/../../x.png", "/etc/hostname"):
        with pytest.raises(ValueError, match=r"p\.jsonl:3: image .* is outside the prompt file"):
            img._image_source(item, "p.jsonl:3", data)
    (data / "rows.jsonl").write_text(json.dumps({"prompt": "<image>?", "images": "../../x"}))
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: image '\.\./\.\./x' is outside"):
        img.load_multimodal_prompts(str(data / "rows.jsonl"))
