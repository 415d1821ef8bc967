"""The resize of transformers' torchvision image processors, without torch: antialiased bicubic on uint8 pixels.

transformers' default (torchvision) Qwen2-VL image processor resizes a uint8 image with torchvision's `resize`
(bicubic, antialias on); on the CPU, where vLLM runs it, torchvision hands uint8 straight to torch's
`interpolate(mode="bicubic", antialias=True)`, whose uint8 kernel works in fixed point: per dimension, each output
sample's cubic filter (a = -0.5, stretched by the scale when shrinking) is computed in double, normalized, and
scaled to int16 with the most fractional bits that keep the largest weight in 15 bits; a sample is the rounded
integer sum shifted back and clamped to 0..255. The width is resampled first, then the height, each pass to uint8;
a dimension whose size does not change is left alone. `aa_bicubic_resize` computes exactly that (bit-identical to
torch 2.13's kernel). Pillow's BICUBIC uses the same filter with 22 fractional bits, which puts its output up to a
few levels off.

The work is done in strips of output rows, reading only the input rows each strip needs, so what the resize holds
at its peak is `peak_bytes` whether its input is an array or an image read row range by row range.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

__all__ = ["Rows", "aa_bicubic_resize", "peak_bytes"]

# Output rows computed at a time: bounds the int32 temporaries beside the one uint8 intermediate.
_STRIP_ROWS = 64
_A = -0.5
_MAX_PRECISION = 22


def _cubic(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    x = np.abs(x)
    near = ((_A + 2.0) * x - (_A + 3.0)) * x * x + 1.0
    far = ((_A * x - 5.0 * _A) * x + 8.0 * _A) * x - 4.0 * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _support(in_size: int, out_size: int) -> float:
    scale = in_size / out_size
    return 2.0 * scale if scale >= 1.0 else 2.0


_Taps = tuple["npt.NDArray[np.intp]", "npt.NDArray[np.int32]", int]


def _taps(in_size: int, out_size: int) -> _Taps:
    """Per output sample, the input index of each filter tap (clipped in range) and its int16-range weight (0 past
    the support), `[out_size, taps]` each, and the weights' fractional bits."""
    scale = in_size / out_size
    support = _support(in_size, out_size)
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # C's float-to-int conversion truncates: the same as floor here, the result being clamped at 0.
    first = np.maximum((center - support + 0.5).astype(np.intp), 0)
    last = np.minimum((center + support + 0.5).astype(np.intp), in_size)
    taps = math.ceil(support) * 2 + 1
    offsets = np.arange(taps)
    weights = _cubic((offsets[None, :] + first[:, None] - center[:, None] + 0.5) * inv_scale)
    weights[offsets[None, :] >= (last - first)[:, None]] = 0.0
    total = np.zeros(out_size)
    for tap in range(taps):  # summed in tap order
        total += weights[:, tap]
    weights = np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0)
    largest = float(weights.max())
    precision = 0
    while precision < _MAX_PRECISION and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)
    index = np.minimum(first[:, None] + offsets[None, :], in_size - 1)
    return index, fixed, precision


Rows = Callable[[int, int], "npt.NDArray[np.uint8]"]
"""`rows(start, stop)`: uint8 `[stop - start, w, c]` pixels of those input rows."""


def _resample(
    rows: Rows, out: npt.NDArray[np.uint8], taps: _Taps, axis: int, between: Callable[[], None] | None
) -> None:
    """One pass along `axis` (0: rows, 1: columns) into `out`, strip by strip of output rows; only the input rows
    a strip needs are asked for. `between` runs before each strip (a caller's stop check may raise there)."""
    index, weights, precision = taps
    for start in range(0, out.shape[0], _STRIP_ROWS):
        if between is not None:
            between()
        stop = min(start + _STRIP_ROWS, out.shape[0])
        if axis == 1:
            block, tap_index, tap_weights = rows(start, stop), index, weights
        else:
            tap_index, tap_weights = index[start:stop], weights[start:stop]
            low, high = int(tap_index.min()), int(tap_index.max()) + 1
            block, tap_index = rows(low, high), tap_index - low
        total = np.full(out[start:stop].shape, 1 << (precision - 1) if precision else 0, dtype=np.int32)
        for tap in range(tap_index.shape[1]):
            weight = tap_weights[:, tap][None, :, None] if axis == 1 else tap_weights[:, tap][:, None, None]
            total += np.take(block, tap_index[:, tap], axis=axis).astype(np.int32) * weight
        np.right_shift(total, precision, out=total)
        np.clip(total, 0, 255, out=total)
        out[start:stop] = total


def aa_bicubic_resize(
    rows: Rows,
    size: tuple[int, int],
    channels: int,
    height: int,
    width: int,
    *,
    between: Callable[[], None] | None = None,
) -> npt.NDArray[np.uint8]:
    """Pixels of `size` (height, width), read through `rows`, resized to `height` x `width` as torch's antialiased
    bicubic uint8 kernel does; a new writable `[height, width, channels]` array. `between` runs before each strip
    of rows: what it raises stops the resize."""
    in_h, in_w = size
    if in_w != width:
        wide = np.empty((in_h, width, channels), dtype=np.uint8)
        _resample(rows, wide, _taps(in_w, width), 1, between)
        rows = _slicer(wide)
    if in_h == height:
        return np.array(rows(0, in_h), dtype=np.uint8) if in_w == width else wide
    tall = np.empty((height, width, channels), dtype=np.uint8)
    _resample(rows, tall, _taps(in_h, height), 0, between)
    return tall


def _slicer(pixels: npt.NDArray[np.uint8]) -> Rows:
    return lambda start, stop: pixels[start:stop]


def peak_bytes(size: tuple[int, int], height: int, width: int, channels: int = 3) -> int:
    """What `aa_bicubic_resize` holds at its peak beyond its input: the uint8 intermediate of the width pass, a
    strip's input rows and int32 temporaries (the sum, one tap's samples and their product), and the output."""
    in_h, in_w = size
    intermediate = in_h * width * channels if in_w != width else 0
    window = math.ceil(_STRIP_ROWS * max(in_h / height, 1.0)) + 2 * math.ceil(_support(in_h, height)) + 2
    strip = window * max(in_w, width) * channels + _STRIP_ROWS * width * channels * 4 * 3
    return intermediate + strip + height * width * channels
