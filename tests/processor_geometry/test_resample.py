"""processor_geometry/resample.py: bit-identical to torch's antialiased bicubic uint8 kernel (what
transformers' torchvision image processors run on the CPU), within the memory `peak_bytes` says."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import numpy.typing as npt
import pytest
import torch
from PIL import Image

from processor_geometry import QWEN2_VL, resize_for_model, resized_peak_bytes, smart_resize
from processor_geometry.resample import Rows, aa_bicubic_resize, peak_bytes

TORCHVISION = dataclasses.replace(QWEN2_VL, resize="torchvision")

# (input height, width) -> (output height, width): down, up, one side each way, one side unchanged, tiny, elongated.
SIZES = [
    ((300, 500), (308, 504)),
    ((1000, 1400), (448, 616)),
    ((480, 640), (476, 644)),
    ((100, 100), (224, 224)),
    ((37, 1000), (28, 980)),
    ((2000, 1500), (560, 420)),
    ((300, 56), (28, 56)),
    ((56, 300), (56, 28)),
    ((5, 7), (56, 56)),
    ((2, 2000), (28, 1988)),
]


def torch_resize(pixels: npt.NDArray[np.uint8], height: int, width: int) -> npt.NDArray[np.uint8]:
    tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None].contiguous()
    out = torch.nn.functional.interpolate(tensor, size=(height, width), mode="bicubic", antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def rows_of(pixels: npt.NDArray[np.uint8]) -> Rows:
    return lambda start, stop: pixels[start:stop]


def noise(height: int, width: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def gradient(height: int, width: int) -> npt.NDArray[np.uint8]:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize(("size", "out"), SIZES)
def test_equal_to_torchs_uint8_kernel_bit_for_bit(size: tuple[int, int], out: tuple[int, int]) -> None:
    for pixels in (noise(*size), gradient(*size)):
        got = aa_bicubic_resize(rows_of(pixels), size, 3, *out)
        np.testing.assert_array_equal(got, torch_resize(pixels, *out))
        assert got.flags.writeable
        assert got.flags.c_contiguous


def test_an_unchanged_size_is_a_copy_of_the_pixels() -> None:
    pixels = noise(56, 84)
    got = aa_bicubic_resize(rows_of(pixels), (56, 84), 3, 56, 84)
    np.testing.assert_array_equal(got, pixels)
    assert not np.shares_memory(got, pixels)


def test_resize_for_model_follows_the_geometrys_resize() -> None:
    image = Image.fromarray(noise(333, 517, seed=3))
    torchvision = resize_for_model(image, TORCHVISION)
    pil = resize_for_model(image, QWEN2_VL)
    height, width = smart_resize(333, 517, QWEN2_VL.factor, QWEN2_VL.min_pixels, QWEN2_VL.max_pixels)
    np.testing.assert_array_equal(torchvision, torch_resize(np.array(image), height, width))
    assert pil.shape == torchvision.shape
    assert np.abs(pil.astype(int) - torchvision.astype(int)).max() > 0  # the two resizes differ


def test_transparency_is_composited_before_the_resize() -> None:
    rgba = Image.new("RGBA", (300, 200), (10, 20, 30, 0))
    assert (resize_for_model(rgba, TORCHVISION) == 255).all()  # fully transparent: white, as transformers converts


@pytest.mark.parametrize(
    ("size", "out"), [((2000, 1500), (560, 420)), ((480, 640), (476, 644)), ((64, 64), (448, 448))]
)
def test_what_the_resize_allocates_stays_within_peak_bytes(size: tuple[int, int], out: tuple[int, int]) -> None:
    pixels = noise(*size)
    tracemalloc.start()
    try:
        aa_bicubic_resize(rows_of(pixels), size, 3, *out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= peak_bytes(size, *out)
    assert resized_peak_bytes(size, out, TORCHVISION) == peak_bytes(size, *out)


class Stop(Exception):
    pass


def test_what_between_raises_stops_the_resize_at_its_strip() -> None:
    pixels = noise(1000, 700)
    calls: list[int] = []

    def between() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    with pytest.raises(Stop):
        aa_bicubic_resize(rows_of(pixels), (1000, 700), 3, 448, 308, between=between)
    assert len(calls) == 3  # nothing ran after the stop
    finished: list[int] = []
    aa_bicubic_resize(rows_of(pixels), (1000, 700), 3, 448, 308, between=lambda: finished.append(1))
    # One check a strip of 64 rows: the width pass over 1000 input rows, the height pass over 448 output rows.
    assert len(finished) == -(-1000 // 64) + -(-448 // 64)
