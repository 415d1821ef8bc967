"""Qwen-family image and video processor geometry: the one place that knows how an image or a clip becomes
encoder rows.

The gateway uses it to predict what a model server's processors will materialize (processed-tensor bytes and LLM
tokens) and, in engine mode, to resize images and clips before sending pixels; the engine uses it to patchify.
Everything here is plain integer arithmetic and imports only the standard library. `resize_for_model`
additionally needs Pillow and NumPy (`rgb`, `resample`), imported when it is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import numpy.typing as npt
    from PIL import Image


MAX_ASPECT_RATIO = 200
# transformers' image processor backends, by the resize each makes: Pillow's BICUBIC on the uint8 image (`pil`), or
# torch's antialiased bicubic uint8 kernel (`torchvision`, transformers 5's default; what vLLM runs on the CPU).
RESIZES = ("pil", "torchvision")
# What a video processor's pixel bounds bound: each frame's pixels, as the image processor does (`frame`: the
# Qwen2-VL and Qwen2.5-VL video processors), or frames x pixels of the whole clip (`clip`: Qwen3-VL's).
VIDEO_BOUNDS = ("frame", "clip")
FLOAT32_BYTES = 4


class AspectRatioError(ValueError):
    """The image is more elongated than the Qwen processors accept (longer side / shorter side > 200)."""


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """Return the (height, width) the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors resize an image to.

    Both sides become multiples of `factor` (patch_size * merge_size), the area is brought inside
    [min_pixels, max_pixels] and the aspect ratio is kept as closely as possible. Same arithmetic as
    transformers' `smart_resize` (including Python's round-half-to-even), so predictions match exactly.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"image of {width}x{height} pixels has an aspect ratio of {ratio:.1f}; "
            f"the model's image processor accepts at most {MAX_ASPECT_RATIO}"
        )
    return _fit(height, width, factor, min_pixels, max_pixels)


def _fit(
    height: int, width: int, factor: int, low: int, high: int, frames: int = 1, temporal: int = 1
) -> tuple[int, int]:
    """Both sides rounded to multiples of `factor`, then scaled, aspect kept, so that `frames` frames (rounded to
    whole temporal patches of `temporal`) of that size are within [low, high] pixels: transformers' arithmetic."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > high:
        beta = math.sqrt(frames * height * width / high)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < low:
        beta = math.sqrt(low / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class ProcessorGeometry:
    """Per-model image processor geometry (what the model's `preprocessor_config.json` fixes)."""

    name: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    channels: int = 3
    resize: str = "pil"
    """Whose resize and normalization the pixels follow (`RESIZES`): transformers' PIL image processor, or its
    torchvision one."""
    video_bounds: str = "frame"
    """What the video pixel bounds bound (`VIDEO_BOUNDS`)."""
    video_min_pixels: int | None = None
    """The video processor's lower pixel bound; None: `min_pixels`."""
    video_max_pixels: int | None = None
    """The video processor's upper pixel bound; None: `max_pixels`."""

    def __post_init__(self) -> None:
        if self.resize not in RESIZES:
            raise ValueError(f"geometry {self.name!r}: resize must be one of {', '.join(RESIZES)}, got {self.resize!r}")
        for field in ("patch_size", "temporal_patch_size", "merge_size", "channels"):
            if getattr(self, field) <= 0:
                raise ValueError(f"geometry {self.name!r}: {field} must be positive")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"geometry {self.name!r}: need 0 < min_pixels <= max_pixels, "
                f"got min_pixels={self.min_pixels}, max_pixels={self.max_pixels}"
            )
        if len(self.image_mean) != self.channels or len(self.image_std) != self.channels:
            raise ValueError(f"geometry {self.name!r}: image_mean and image_std need {self.channels} values")
        if self.video_bounds not in VIDEO_BOUNDS:
            raise ValueError(
                f"geometry {self.name!r}: video_bounds must be one of {', '.join(VIDEO_BOUNDS)}, "
                f"got {self.video_bounds!r}"
            )
        low, high = self.video_pixels
        if not 0 < low <= high:
            raise ValueError(
                f"geometry {self.name!r}: need 0 < video_min_pixels <= video_max_pixels, "
                f"got video_min_pixels={low}, video_max_pixels={high}"
            )

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @property
    def row_width(self) -> int:
        """Width of one processed row: channels * temporal_patch_size * patch_size**2."""
        return self.channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def video_pixels(self) -> tuple[int, int]:
        """The video processor's (min, max) pixel bounds, of one frame or of the clip (`video_bounds`)."""
        low = self.min_pixels if self.video_min_pixels is None else self.video_min_pixels
        high = self.max_pixels if self.video_max_pixels is None else self.video_max_pixels
        return low, high

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ProcessorGeometry:
        """The same geometry with a deployment's own min/max pixel settings."""
        return replace(
            self,
            min_pixels=self.min_pixels if min_pixels is None else min_pixels,
            max_pixels=self.max_pixels if max_pixels is None else max_pixels,
        )

    def with_video_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ProcessorGeometry:
        """The same geometry with a deployment's own video pixel bounds (None keeps the current one)."""
        return replace(
            self,
            video_min_pixels=self.video_min_pixels if min_pixels is None else min_pixels,
            video_max_pixels=self.video_max_pixels if max_pixels is None else max_pixels,
        )


_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# min/max pixels are those of the published checkpoints' preprocessor_config.json, which is what a model
# server loads. transformers' class defaults (min 56*56, max 28*28*1280) are lower and would under-predict
# large images. The Qwen2-VL and Qwen2.5-VL checkpoints publish no video processor config: their video processor
# takes the image bounds, per frame. Qwen3-VL's video_preprocessor_config.json bounds the clip's frames x pixels
# by 4,096..25,165,824.
QWEN2_VL = ProcessorGeometry(
    name="qwen2_vl",
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,
    image_mean=_CLIP_MEAN,
    image_std=_CLIP_STD,
)
QWEN2_5_VL = replace(QWEN2_VL, name="qwen2_5_vl")
QWEN3_VL = ProcessorGeometry(
    name="qwen3_vl",
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=256 * 256,
    max_pixels=32 * 32 * 16384,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    video_bounds="clip",
    video_min_pixels=4096,
    video_max_pixels=25165824,
)

GEOMETRIES: dict[str, ProcessorGeometry] = {g.name: g for g in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)}


def get_geometry(name: str) -> ProcessorGeometry:
    """Look a preset up by name (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`)."""
    try:
        return GEOMETRIES[name]
    except KeyError:
        known = ", ".join(sorted(GEOMETRIES))
        raise ValueError(f"unknown processor geometry {name!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class ImageGeometry:
    """What the model's processor makes of one image or video."""

    height: int
    """Resized height in pixels."""
    width: int
    """Resized width in pixels."""
    grid_t: int
    grid_h: int
    grid_w: int
    rows: int
    """Processed rows = encoder tokens = grid_t * grid_h * grid_w."""
    processed_bytes: int
    """Bytes of the float32 `pixel_values` the processor materializes: rows * row_width * 4."""
    llm_tokens: int
    """Embedding rows the LLM receives: rows / merge_size**2."""

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (self.grid_t, self.grid_h, self.grid_w)


def video_smart_resize(num_frames: int, height: int, width: int, geometry: ProcessorGeometry) -> tuple[int, int]:
    """Return the (height, width) the model's video processor resizes every frame of a clip of `num_frames`
    frames of height x width to.

    `frame` bounds: the image rule (`smart_resize`) with the video pixel bounds. `clip` bounds: Qwen3-VL's video
    processor (transformers' `video_processing_qwen3_vl.smart_resize`, the same arithmetic): a clip shorter than
    one temporal patch is refused; a side under the factor scales the frame up (truncated to whole pixels); the
    bounds apply to (frames rounded half to even to whole temporal patches) x height x width, and when scaling
    to frames x height x width. Raises ValueError (AspectRatioError among them).
    """
    if num_frames <= 0:
        raise ValueError(f"num_frames must be positive, got {num_frames}")
    low, high = geometry.video_pixels
    factor = geometry.factor
    if geometry.video_bounds == "frame":
        return smart_resize(height, width, factor, low, high)
    if height <= 0 or width <= 0:
        raise ValueError(f"video frame size must be positive, got height={height}, width={width}")
    temporal = geometry.temporal_patch_size
    if num_frames < temporal:
        raise ValueError(
            f"a clip of {num_frames} frame(s) is shorter than one temporal patch of {temporal} frames, which the "
            f"{geometry.name} video processor refuses"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"video frames of {width}x{height} pixels have an aspect ratio of {ratio:.1f}; the model's video "
            f"processor accepts at most {MAX_ASPECT_RATIO}"
        )
    return _fit(height, width, factor, low, high, num_frames, temporal)


def _grid_geometry(num_frames: int, h: int, w: int, geometry: ProcessorGeometry) -> ImageGeometry:
    grid_t = -(-num_frames // geometry.temporal_patch_size)
    grid_h = h // geometry.patch_size
    grid_w = w // geometry.patch_size
    rows = grid_t * grid_h * grid_w
    return ImageGeometry(
        height=h,
        width=w,
        grid_t=grid_t,
        grid_h=grid_h,
        grid_w=grid_w,
        rows=rows,
        processed_bytes=rows * geometry.row_width * FLOAT32_BYTES,
        llm_tokens=rows // (geometry.merge_size * geometry.merge_size),
    )


def video_geometry(num_frames: int, height: int, width: int, geometry: ProcessorGeometry) -> ImageGeometry:
    """Geometry of a clip of `num_frames` frames of one size, resized by `video_smart_resize`; frames are padded
    to whole temporal patches."""
    h, w = video_smart_resize(num_frames, height, width, geometry)
    return _grid_geometry(num_frames, h, w, geometry)


def image_geometry(height: int, width: int, geometry: ProcessorGeometry) -> ImageGeometry:
    """Geometry of one image: it is one temporal patch (the frame is repeated temporal_patch_size times)."""
    h, w = smart_resize(height, width, geometry.factor, geometry.min_pixels, geometry.max_pixels)
    return _grid_geometry(1, h, w, geometry)


def resize_for_model(
    image: Image.Image, geometry: ProcessorGeometry, *, between: Callable[[], None] | None = None
) -> npt.NDArray[np.uint8]:
    """Convert to RGB and resize to the smart_resize size the way transformers' Qwen2-VL processor of
    `geometry.resize` does.

    The conversion is `processor_geometry.rgb.to_rgb` (transformers' `convert_to_rgb`: transparency is
    composited onto white), the one the gateway decodes with; the resize is Pillow BICUBIC on the uint8 image
    (`pil`), or torch's antialiased bicubic uint8 kernel (`torchvision`, `processor_geometry.resample`).
    Returns a writable C-contiguous uint8 array of shape [height, width, 3]. `between` runs between the strips of
    the torchvision resize (Pillow's runs in one call): what it raises stops it.
    """
    import numpy as np
    from PIL import Image

    from processor_geometry.resample import aa_bicubic_resize
    from processor_geometry.rgb import to_rgb

    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, geometry.factor, geometry.min_pixels, geometry.max_pixels)
    if geometry.resize == "torchvision":

        def rows(start: int, stop: int) -> npt.NDArray[np.uint8]:
            return np.asarray(rgb.crop((0, start, rgb.width, stop)))

        return aa_bicubic_resize(rows, (rgb.height, rgb.width), 3, h, w, between=between)
    if (h, w) != (rgb.height, rgb.width):
        rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    return np.array(rgb, dtype=np.uint8)  # a writable copy the caller owns


# Pillow's resize: its resized RGB image (4 bytes a pixel) and the uint8 array kept (3).
_PIL_RESIZED_BYTES_PER_PIXEL = 4 + 3


def resized_peak_bytes(size: tuple[int, int], resized: tuple[int, int], geometry: ProcessorGeometry) -> int:
    """What `resize_for_model` holds at its peak, its result included, resizing an RGB image of `size` (height,
    width) to `resized`."""
    if geometry.resize == "torchvision":
        from processor_geometry.resample import peak_bytes

        return peak_bytes(size, *resized)
    return resized[0] * resized[1] * _PIL_RESIZED_BYTES_PER_PIXEL
