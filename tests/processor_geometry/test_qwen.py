"""processor_geometry/qwen.py: smart_resize, presets, per-image rows/bytes/tokens, and the gateway's resize."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from processor_geometry.qwen import (
    GEOMETRIES,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_VL,
    AspectRatioError,
    ProcessorGeometry,
    get_geometry,
    image_geometry,
    resize_for_model,
    smart_resize,
    video_geometry,
    video_smart_resize,
)
from tests.engine_adapter.transformers_parity import hf_processor

# --- smart_resize against transformers ------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 20_000),
    width=st.integers(1, 20_000),
    factor=st.sampled_from([28, 32, 14, 56]),
    min_pixels=st.sampled_from([56 * 56, 256 * 256, 4 * 28 * 28, 1]),
    max_pixels=st.sampled_from([28 * 28 * 1280, 28 * 28 * 16384, 32 * 32 * 16384, 64 * 64, 200_000]),
)
def test_smart_resize_matches_transformers(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> None:
    try:
        expected = hf_smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(AspectRatioError):
            smart_resize(height, width, factor, min_pixels, max_pixels)
        return
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected


def test_smart_resize_matches_transformers_on_a_grid_of_sizes() -> None:
    # Deterministic sweep through rounding boundaries (x.5 * factor) and both clamping branches.
    sizes = sorted({*range(1, 120, 7), *range(14, 3000, 97), 27, 28, 29, 42, 70, 4096, 8192, 12_000})
    for geometry in GEOMETRIES.values():
        for h in sizes:
            for w in sizes:
                if max(h, w) / min(h, w) > 200:
                    continue
                args = (geometry.factor, geometry.min_pixels, geometry.max_pixels)
                assert smart_resize(h, w, *args) == hf_smart_resize(h, w, *args), (geometry.name, h, w)


def test_smart_resize_defaults_are_transformers_defaults() -> None:
    for h, w in [(224, 224), (1000, 3000), (20, 20), (5000, 5000)]:
        assert smart_resize(h, w) == hf_smart_resize(h, w)


def test_aspect_ratio_over_200_is_refused_with_a_clear_message() -> None:
    with pytest.raises(AspectRatioError, match=r"aspect ratio of 201\.0.*at most 200"):
        smart_resize(10, 2010)
    assert issubclass(AspectRatioError, ValueError)
    assert smart_resize(10, 2000) == hf_smart_resize(10, 2000)  # exactly 200 is accepted


@pytest.mark.parametrize(("height", "width"), [(0, 10), (10, 0), (-5, 10)])
def test_non_positive_sizes_are_refused(height: int, width: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        smart_resize(height, width)


# --- presets ----------------------------------------------------------------------------------------------


def test_presets_row_widths_and_lookup() -> None:
    assert QWEN2_VL.row_width == 3 * 2 * 14 * 14 == 1176
    assert QWEN2_5_VL.row_width == 1176
    assert QWEN3_VL.row_width == 3 * 2 * 16 * 16 == 1536
    assert (QWEN2_VL.factor, QWEN3_VL.factor) == (28, 32)
    assert get_geometry("qwen3_vl") is QWEN3_VL
    with pytest.raises(ValueError, match=r"unknown processor geometry 'llava'.*qwen2_5_vl, qwen2_vl"):
        get_geometry("llava")


def test_presets_match_transformers_processor_and_checkpoint_configs() -> None:
    # Mean/std of transformers' Qwen2-VL processor (OpenAI CLIP); Qwen3-VL checkpoints ship 0.5/0.5.
    processor = Qwen2VLImageProcessorPil()
    assert QWEN2_VL.image_mean == tuple(processor.image_mean)
    assert QWEN2_VL.image_std == tuple(processor.image_std)
    assert (QWEN2_VL.patch_size, QWEN2_VL.temporal_patch_size, QWEN2_VL.merge_size) == (
        processor.patch_size,
        processor.temporal_patch_size,
        processor.merge_size,
    )
    assert QWEN2_VL.min_pixels == processor.size["shortest_edge"] == 3136
    # The published preprocessor_config.json (what a server loads) raises max_pixels over the class default.
    assert processor.size["longest_edge"] == 28 * 28 * 1280
    assert QWEN2_VL.max_pixels == QWEN2_5_VL.max_pixels == 12_845_056
    assert (QWEN3_VL.min_pixels, QWEN3_VL.max_pixels) == (65_536, 16_777_216)
    assert QWEN3_VL.image_mean == QWEN3_VL.image_std == (0.5, 0.5, 0.5)


def test_geometry_validation_and_with_pixels() -> None:
    small = QWEN2_VL.with_pixels(max_pixels=28 * 28 * 256)
    assert (small.min_pixels, small.max_pixels, small.patch_size) == (3136, 200_704, 14)
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        QWEN2_VL.with_pixels(min_pixels=10**9)
    with pytest.raises(ValueError, match="patch_size must be positive"):
        ProcessorGeometry("x", 0, 2, 2, 1, 2, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


# --- per-image geometry -----------------------------------------------------------------------------------


def _processed_shape(geometry: ProcessorGeometry, height: int, width: int) -> tuple[int, int, list[int]]:
    """Run transformers' processor on a real image and report (rows, row width, grid_thw)."""
    image = Image.new("RGB", (width, height), (90, 120, 200))
    out = hf_processor(geometry)(images=image, return_tensors="np")
    rows, row_width = out["pixel_values"].shape
    assert out["pixel_values"].dtype == np.float32
    return rows, row_width, out["image_grid_thw"][0].tolist()


@pytest.mark.parametrize(
    ("geometry", "height", "width", "rows", "processed_bytes", "llm_tokens"),
    [
        # 2048 is a multiple of 32 and under max_pixels: 128 x 128 patches of 16 px.
        (QWEN3_VL, 2048, 2048, 16_384, 16_384 * 1536 * 4, 4096),
        # round(1024 / 28) = 37 -> 1036 px, 74 x 74 patches of 14 px.
        (QWEN2_VL, 1024, 1024, 5476, 5476 * 1176 * 4, 1369),
        (QWEN2_5_VL, 480, 640, 34 * 46, 34 * 46 * 1176 * 4, 17 * 23),
    ],
)
def test_image_geometry_matches_transformers_output_shapes(
    geometry: ProcessorGeometry, height: int, width: int, rows: int, processed_bytes: int, llm_tokens: int
) -> None:
    got = image_geometry(height, width, geometry)
    hf_rows, hf_width, hf_grid = _processed_shape(geometry, height, width)
    assert (got.rows, geometry.row_width, list(got.grid_thw)) == (hf_rows, hf_width, hf_grid)
    assert got.processed_bytes == hf_rows * hf_width * 4 == processed_bytes
    assert got.llm_tokens == hf_rows // geometry.merge_size**2 == llm_tokens
    assert (got.height, got.width) == (hf_grid[1] * geometry.patch_size, hf_grid[2] * geometry.patch_size)


def test_image_geometry_clamps_huge_images_to_max_pixels() -> None:
    got = image_geometry(40_000, 40_000, QWEN2_VL)
    assert got.height * got.width <= QWEN2_VL.max_pixels
    assert got.processed_bytes == got.rows * 1176 * 4 <= QWEN2_VL.max_pixels // 196 * 1176 * 4
    h, w = hf_smart_resize(40_000, 40_000, 28, 3136, 28 * 28 * 1280)
    assert image_geometry(40_000, 40_000, QWEN2_VL.with_pixels(max_pixels=28 * 28 * 1280)).rows == (h // 14 * (w // 14))


def test_video_geometry_pads_frames_to_whole_temporal_patches() -> None:
    one = image_geometry(448, 448, QWEN2_VL)
    assert one.grid_thw == (1, 32, 32)
    assert video_geometry(2, 448, 448, QWEN2_VL).grid_thw == (1, 32, 32)
    three = video_geometry(3, 448, 448, QWEN2_VL)
    assert three.grid_thw == (2, 32, 32)
    assert three.rows == 2 * one.rows
    assert three.llm_tokens == 2 * one.llm_tokens
    with pytest.raises(ValueError, match="num_frames"):
        video_geometry(0, 448, 448, QWEN2_VL)


QWEN3_CLIPS = [
    (2, 480, 640),  # 2 x 480 x 640 inside 4,096..25,165,824: only rounded to the factor
    (5, 100, 130),  # 5 frames round half to even to 4
    (3, 10, 10),  # sides under the factor: scaled up first
    (9, 31, 500),
    (33, 1080, 1920),  # over the clip's maximum: scaled by frames x pixels
    (768, 720, 1280),
    (7, 335, 17),
]


@pytest.mark.parametrize(("frames", "height", "width"), QWEN3_CLIPS)
def test_qwen3_vl_video_geometry_is_transformers_qwen3_vl_video_rule(frames: int, height: int, width: int) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_smart_resize

    low, high = QWEN3_VL.video_pixels
    expected = hf_video_smart_resize(frames, height, width, 2, 32, low, high)
    assert video_smart_resize(frames, height, width, QWEN3_VL) == expected
    got = video_geometry(frames, height, width, QWEN3_VL)
    assert got.grid_thw == (-(-frames // 2), expected[0] // 16, expected[1] // 16)
    # Not the image rule: that one bounds each frame by the image bounds.
    if (frames, height, width) == (33, 1080, 1920):
        assert (got.height, got.width) != smart_resize(height, width, 32, QWEN3_VL.min_pixels, QWEN3_VL.max_pixels)


def test_qwen3_vl_video_rule_refuses_a_clip_shorter_than_a_temporal_patch() -> None:
    with pytest.raises(ValueError, match="a clip of 1 frame"):
        video_geometry(1, 480, 640, QWEN3_VL)
    assert image_geometry(480, 640, QWEN3_VL).grid_thw == (1, 30, 40)  # an image is one frame, by the image rule


@pytest.mark.parametrize("frames", [1, 2, 3, 32])
def test_qwen2_vl_video_geometry_bounds_each_frame(frames: int) -> None:
    geometry = QWEN2_VL.with_video_pixels(max_pixels=28 * 28 * 64)
    got = video_geometry(frames, 480, 640, geometry)
    assert (got.height, got.width) == hf_smart_resize(480, 640, 28, QWEN2_VL.min_pixels, 28 * 28 * 64)
    assert image_geometry(480, 640, geometry).height == smart_resize(480, 640, 28, 3136, QWEN2_VL.max_pixels)[0]


def test_geometry_refuses_bad_video_bounds() -> None:
    with pytest.raises(ValueError, match="video_bounds"):
        dataclasses.replace(QWEN2_VL, video_bounds="clips")
    with pytest.raises(ValueError, match="video_min_pixels <= video_max_pixels"):
        QWEN3_VL.with_video_pixels(min_pixels=1 << 20, max_pixels=1 << 10)


# --- resize_for_model -------------------------------------------------------------------------------------


def test_resize_for_model_is_pil_bicubic_to_the_smart_size() -> None:
    rng = np.random.default_rng(1)
    for height, width in [(300, 517), (57, 59), (28, 28), (1000, 37)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        pixels = resize_for_model(image, QWEN2_VL)
        h, w = smart_resize(height, width, 28, QWEN2_VL.min_pixels, QWEN2_VL.max_pixels)
        assert pixels.shape == (h, w, 3)
        assert pixels.dtype == np.uint8
        assert pixels.flags.writeable
        assert pixels.flags.c_contiguous
        expected = np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))
        np.testing.assert_array_equal(pixels, expected)


def test_resize_for_model_converts_modes_like_transformers() -> None:
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # fully transparent red -> white
    assert (resize_for_model(rgba, QWEN2_VL) == 255).all()
    half = Image.new("RGBA", (56, 56), (0, 0, 0, 128))  # half-transparent black over white
    assert np.abs(resize_for_model(half, QWEN2_VL).astype(int) - 127).max() <= 1
    gray = Image.new("L", (56, 56), 77)
    assert (resize_for_model(gray, QWEN2_VL) == 77).all()
    palette = Image.new("P", (56, 56), 3)
    palette.putpalette([0, 0, 0, 10, 20, 30, 40, 50, 60, 1, 2, 3] + [0] * 756)
    assert (resize_for_model(palette, QWEN2_VL) == [1, 2, 3]).all()
    palette.info["transparency"] = 3
    assert (resize_for_model(palette, QWEN2_VL) == 255).all()


@pytest.mark.slow
def test_geometry_module_imports_without_torch_or_numpy() -> None:
    code = (
        "import sys; import processor_geometry.qwen as g; "
        "g.image_geometry(100, 100, g.QWEN2_VL); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_the_geometry_loads_neither_the_wire_format_nor_the_engine_client() -> None:
    # The gateway's config imports GEOMETRIES: that must not load the wire format or the client.
    code = (
        "import sys; from processor_geometry import GEOMETRIES; from processor_geometry.rgb import pixel_size; "
        "assert 'numpy' not in sys.modules and 'aiohttp' not in sys.modules, sorted(sys.modules); "
        "from engine_adapter.client import SUBMIT_CONTENT_TYPE, EngineRefusal; "
        "assert 'numpy' in sys.modules and 'aiohttp' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
