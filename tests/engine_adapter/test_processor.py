"""Engine-side processor: gateway resize + our normalize/patchify against transformers' Qwen processors.

transformers 5 has two Qwen2-VL image processors, the one Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints all load:
`Qwen2VLImageProcessor` (its default, torchvision backend: torchvision's antialiased bicubic, then rescale and
normalize fused into one step) and `Qwen2VLImageProcessorPil` (Pillow BICUBIC, then NumPy's rescale and normalize
one after the other). Its video processors (Qwen2-VL's, Qwen3-VL's) have the torchvision backend only. A geometry's
`resize` names the backend followed; pixel values are bitwise those of that backend's processors. Without
torchvision installed the torchvision processors run on frames already at their resized size
(tests/engine_adapter/transformers_parity.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from engine_adapter.processor import normalize_frames, process_image, process_video
from processor_geometry import (
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_VL,
    ProcessorGeometry,
    resize_for_model,
    video_geometry,
    video_smart_resize,
)
from tests.engine_adapter.transformers_parity import (
    HAS_TORCHVISION,
    hf_process_video,
    hf_processor,
    hf_torchvision_image_processor,
)


def noise_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode)


CASES = [
    (QWEN2_VL, noise_image(224, 224)),  # already a multiple of 28
    (QWEN2_VL, noise_image(300, 517, seed=1)),  # non-square, resized
    (QWEN2_VL, noise_image(1000, 37, seed=2)),  # tall and thin
    (QWEN2_VL, noise_image(20, 30, seed=3)),  # under min_pixels: upscaled
    (QWEN2_VL.with_pixels(max_pixels=28 * 28 * 64), noise_image(700, 500, seed=4)),  # over max_pixels
    (QWEN2_VL, noise_image(90, 130, "RGBA", seed=5)),  # alpha composited onto white
    (QWEN2_VL, noise_image(64, 80, "L", seed=6)),
    (QWEN3_VL, noise_image(300, 400, seed=7)),  # patch 16, mean/std 0.5, min_pixels upscales
]


@pytest.mark.parametrize(("geometry", "image"), CASES)
def test_gateway_resize_then_processor_equals_transformers(geometry: ProcessorGeometry, image: Image.Image) -> None:
    expected = hf_processor(geometry)(images=image, return_tensors="pt")
    got = process_image(resize_for_model(image, geometry), geometry)
    assert got.grid_thw.tolist() == expected["image_grid_thw"].tolist()
    assert got.grid_thw.dtype == torch.int64
    assert got.pixel_values.shape == expected["pixel_values"].shape
    assert got.pixel_values.shape[1] == geometry.row_width
    assert got.pixel_values.dtype == torch.float32
    assert torch.equal(got.pixel_values, expected["pixel_values"])


TORCHVISION = [dataclasses.replace(g, resize="torchvision") for g in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)]
IMAGES = [
    noise_image(224, 224),
    noise_image(300, 517, seed=1),
    noise_image(1000, 37, seed=2),
    noise_image(20, 30, seed=3),
]


@pytest.mark.parametrize("geometry", TORCHVISION, ids=lambda g: g.name)
@pytest.mark.parametrize("image", IMAGES, ids=lambda i: f"{i.width}x{i.height}")
def test_torchvision_resize_then_processor_equals_transformers_default_processor(
    geometry: ProcessorGeometry, image: Image.Image
) -> None:
    resized = resize_for_model(image, geometry)
    got = process_image(resized, geometry)
    if HAS_TORCHVISION:  # transformers' default image processor, its own resize included
        expected = hf_torchvision_image_processor(geometry)(images=image, return_tensors="pt")
        pixel_values, grid = expected["pixel_values"], expected["image_grid_thw"]
    else:  # its torchvision backend's rescale-and-normalize and patchify of the resized image, as a clip
        clip = np.stack([resized] * geometry.temporal_patch_size)
        pixel_values, grid = hf_process_video(geometry, clip, do_resize=False)
    assert got.grid_thw.tolist() == grid.tolist()
    assert torch.equal(got.pixel_values, pixel_values)


@pytest.mark.parametrize("resize", ["pil", "torchvision"])
@pytest.mark.parametrize("geometry", [QWEN2_VL, QWEN3_VL], ids=lambda g: g.name)
def test_every_byte_value_normalizes_as_that_backend_does(geometry: ProcessorGeometry, resize: str) -> None:
    geometry = dataclasses.replace(geometry, resize=resize)
    side = 2 * geometry.factor
    values = np.arange(side * side * 3) % 256  # every value on every channel
    frame = np.random.default_rng(0).permutation(values).astype(np.uint8).reshape(side, side, 3)
    got = normalize_frames(torch.from_numpy(frame[None]), geometry)[0]
    if resize == "pil":
        image = hf_processor(geometry)
        rescaled = image.rescale(frame.transpose(2, 0, 1), 1 / 255)
        expected = torch.from_numpy(image.normalize(rescaled, list(geometry.image_mean), list(geometry.image_std)))
    else:
        clip = np.stack([frame] * geometry.temporal_patch_size)
        rows, _ = hf_process_video(geometry, clip, do_resize=False)
        expected = process_video(clip, geometry).pixel_values
        assert torch.equal(expected, rows)
        expected = normalize_frames(torch.from_numpy(frame[None]), geometry)[0]
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_the_two_backends_differ_in_the_last_bit() -> None:
    """The fused normalization is not the rescale followed by normalize: the byte values it differs on."""
    frame = np.arange(256, dtype=np.uint8).repeat(3).reshape(16, 16, 3)
    pil = normalize_frames(torch.from_numpy(frame[None]), QWEN3_VL)
    fused = normalize_frames(torch.from_numpy(frame[None]), dataclasses.replace(QWEN3_VL, resize="torchvision"))
    differ = (pil != fused).sum().item()
    assert 0 < differ < pil.numel()
    assert (pil - fused).abs().max().item() < 1e-7


# Clips as (frames, height, width) at their resized size; each is a fixed point of the video processor's resize.
CLIPS = [(2, 64, 96), (4, 96, 192), (6, 256, 160), (8, 32, 320)]


@pytest.mark.parametrize("geometry", TORCHVISION, ids=lambda g: g.name)
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: "x".join(map(str, c)))
def test_video_rows_equal_transformers_video_processor(geometry: ProcessorGeometry, clip: tuple[int, int, int]) -> None:
    count, height, width = clip
    height, width = height // 32 * geometry.factor, width // 32 * geometry.factor
    assert video_smart_resize(count, height, width, geometry) == (height, width)
    frames = np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    pixel_values, grid = hf_process_video(geometry, frames)
    got = process_video(frames, geometry)
    assert got.grid_thw.tolist() == grid.tolist()
    assert video_geometry(count, height, width, geometry).grid_thw == tuple(grid[0].tolist())
    assert torch.equal(got.pixel_values, pixel_values)


def reference_rows(frames: np.ndarray, geometry: ProcessorGeometry) -> np.ndarray:
    """Row layout spelled out with loops: rows over (t, block_h, block_w, merge_h, merge_w), each row
    (channel, temporal, patch_h, patch_w); clips padded with their last frame to whole temporal patches."""
    p, m, tp = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    mean = np.array(geometry.image_mean, dtype=np.float32)
    std = np.array(geometry.image_std, dtype=np.float32)
    norm = ((frames.astype(np.float32) / np.float32(255.0)) - mean) / std  # [t, h, w, c]
    while len(norm) % tp:
        norm = np.concatenate([norm, norm[-1:]])
    t, h, w, _ = norm.shape
    rows = []
    for gt in range(t // tp):
        for bh in range(h // (p * m)):
            for bw in range(w // (p * m)):
                for mh in range(m):
                    for mw in range(m):
                        y, x = (bh * m + mh) * p, (bw * m + mw) * p
                        cube = norm[gt * tp : (gt + 1) * tp, y : y + p, x : x + p, :]  # [tp, p, p, c]
                        rows.append(cube.transpose(3, 0, 1, 2).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("num_frames", [2, 3, 4])
def test_video_rows_follow_the_qwen_layout(num_frames: int) -> None:
    rng = np.random.default_rng(num_frames)
    frames = rng.integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)
    got = process_video(frames, QWEN2_VL)
    grid_t = -(-num_frames // 2)
    assert got.grid_thw.tolist() == [[grid_t, 4, 6]]
    np.testing.assert_allclose(got.pixel_values.numpy(), reference_rows(frames, QWEN2_VL), rtol=0, atol=1e-6)


def test_image_is_a_clip_of_its_frame_repeated() -> None:
    frame = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    image = process_image(frame, QWEN3_VL)
    clip = process_video(np.stack([frame, frame]), QWEN3_VL)
    assert torch.equal(image.pixel_values, clip.pixel_values)
    assert image.grid_thw.tolist() == clip.grid_thw.tolist() == [[1, 4, 6]]
    single = process_video(frame[None], QWEN3_VL)  # one frame is padded to a temporal patch
    assert torch.equal(image.pixel_values, single.pixel_values)
    assert image.rows == 24


def test_accepts_torch_input_and_casts_dtype() -> None:
    frame = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    from_numpy = process_image(frame, QWEN2_VL)
    from_torch = process_image(torch.from_numpy(frame), QWEN2_VL, dtype=torch.bfloat16, device="cpu")
    assert from_torch.pixel_values.dtype == torch.bfloat16
    torch.testing.assert_close(from_torch.pixel_values.float(), from_numpy.pixel_values, atol=2e-2, rtol=1e-2)


def test_rejects_pixels_that_were_not_smart_resized() -> None:
    with pytest.raises(ValueError, match=r"not at a smart-resized size.*multiples of 28"):
        process_image(np.zeros((50, 56, 3), dtype=np.uint8), QWEN2_VL)
    with pytest.raises(ValueError, match="multiples of 32"):
        process_image(np.zeros((56, 56, 3), dtype=np.uint8), QWEN3_VL)


def test_rejects_wrong_dtype_and_shape() -> None:
    with pytest.raises(TypeError, match="uint8"):
        process_image(np.zeros((56, 56, 3), dtype=np.float32), QWEN2_VL)
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        process_image(np.zeros((56, 56), dtype=np.uint8), QWEN2_VL)
    with pytest.raises(ValueError, match=r"\[t, height, width, 3\]"):
        process_video(np.zeros((2, 56, 56, 4), dtype=np.uint8), QWEN2_VL)
