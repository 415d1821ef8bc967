"""Engine-side image processor: uint8 pixels at the smart-resized size -> `pixel_values` rows and grid_thw.

The gateway decodes and resizes (`processor_geometry.resize_for_model`) and sends uint8 pixels;
this module does the rest of what the Qwen2-VL image processor does: rescale by 1/255 and normalize with the
model's mean/std, and cut the frames into rows of channels * temporal_patch_size * patch_size**2 values,
ordered so that the merge_size x merge_size patches of one LLM token are adjacent (what the towers expect).

The normalization is that of transformers' processors of `geometry.resize`, bit for bit. Its PIL image processor
rescales (float64 x * (1/255), cast to float32: for every byte value the float32 x / 255) and then computes
(x - mean) / std in float32. Its torchvision processors (the image processor and every video processor) fuse the
two: (x - mean * 255) / (std * 255) in float32, with the float32 mean and std multiplied by 255 in float32. The
two differ in the last bit for about half of the byte values. Every constant is a tensor on the pixels' device,
so that each division is a true division there (CUDA multiplies by the reciprocal of a Python scalar divisor).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from processor_geometry import ProcessorGeometry

__all__ = [
    "Normalization",
    "ProcessedVisual",
    "normalization",
    "normalize_frames",
    "patchify",
    "process_image",
    "process_video",
]

PixelArray = npt.NDArray[np.uint8] | torch.Tensor


@dataclass(frozen=True, slots=True)
class ProcessedVisual:
    """One item's encoder input."""

    pixel_values: torch.Tensor
    """[grid_t * grid_h * grid_w, row_width] rows."""
    grid_thw: torch.Tensor
    """[1, 3] int64 on the CPU (grid metadata stays on the host so nobody waits on a device to read it)."""

    @property
    def rows(self) -> int:
        return int(self.pixel_values.shape[0])


def _as_uint8(pixels: PixelArray, what: str) -> torch.Tensor:
    tensor = torch.from_numpy(pixels) if isinstance(pixels, np.ndarray) else pixels
    if tensor.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8 pixels, got {tensor.dtype}")
    return tensor


def _check_frames(frames: torch.Tensor, geometry: ProcessorGeometry) -> None:
    if frames.ndim != 4 or frames.shape[-1] != geometry.channels:
        raise ValueError(f"expected frames of shape [t, height, width, {geometry.channels}], got {tuple(frames.shape)}")
    _, height, width, _ = frames.shape
    factor = geometry.factor
    if height % factor or width % factor or height == 0 or width == 0:
        raise ValueError(
            f"pixels of {width}x{height} are not at a smart-resized size: both sides must be positive "
            f"multiples of {factor} for {geometry.name} (resize with geometry.resize_for_model first)"
        )


@dataclass(frozen=True, slots=True)
class Normalization:
    """float32 constants on one device: `scale` (None when fused) divides first, then `mean` is subtracted and
    `std` divides. Each broadcasts over the channel axis it was shaped for."""

    scale: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize float32 `x` in place and return it."""
        if self.scale is not None:
            x.div_(self.scale)
        return x.sub_(self.mean).div_(self.std)


def normalization(
    geometry: ProcessorGeometry, device: torch.device | str | None, *, repeat: int = 1, shape: tuple[int, ...] = (-1,)
) -> Normalization:
    """The normalization of transformers' processors of `geometry.resize`: each channel's constants repeated
    `repeat` times (one per row column of that channel) and viewed as `shape`."""
    mean = torch.tensor(geometry.image_mean, dtype=torch.float32)
    std = torch.tensor(geometry.image_std, dtype=torch.float32)
    scale: torch.Tensor | None = None
    if geometry.resize == "torchvision":
        # transformers' TorchvisionBackend._fuse_mean_std_and_rescale_factor: float32 constants times
        # 1 / rescale_factor, a float32 product on the CPU.
        rescale_factor = 1 / 255
        mean = mean * (1.0 / rescale_factor)
        std = std * (1.0 / rescale_factor)
    else:
        scale = torch.tensor(255.0, dtype=torch.float32, device=device)

    def placed(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(repeat).view(shape).to(device)

    return Normalization(scale, placed(mean), placed(std))


def normalize_frames(frames: torch.Tensor, geometry: ProcessorGeometry) -> torch.Tensor:
    """uint8 [t, h, w, c] -> float32 [t, c, h, w], rescaled and normalized as transformers' processors of
    `geometry.resize` do."""
    x = frames.permute(0, 3, 1, 2).to(torch.float32)
    return normalization(geometry, x.device, shape=(1, -1, 1, 1)).apply(x)


def patchify(frames: torch.Tensor, geometry: ProcessorGeometry) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Cut normalized frames [t, c, h, w] into rows [grid_t * grid_h * grid_w, row_width] and return grid_thw.

    A clip whose frame count is not a multiple of temporal_patch_size is padded by repeating its last frame.
    Rows run over (grid_t, h / merge, w / merge, merge_h, merge_w); a row holds (c, temporal, patch, patch).
    """
    num_frames, channels, height, width = frames.shape
    temporal, patch, merge = geometry.temporal_patch_size, geometry.patch_size, geometry.merge_size
    if pad := -num_frames % temporal:
        last = frames[-1:].expand(pad, -1, -1, -1)
        # A single frame (an image) is repeated as a stride-0 view; the reshape below makes the only copy.
        frames = last.expand(temporal, -1, -1, -1) if num_frames == 1 else torch.cat([frames, last], dim=0)
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    blocks = frames.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # -> grid_t, block_h, block_w, merge_h, merge_w, channel, temporal, patch_h, patch_w
    rows = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(
        grid_t * grid_h * grid_w, channels * temporal * patch * patch
    )
    return rows, (grid_t, grid_h, grid_w)


def _process(
    frames: torch.Tensor,
    geometry: ProcessorGeometry,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> ProcessedVisual:
    _check_frames(frames, geometry)
    if device is not None:
        frames = frames.to(device)  # move the uint8 pixels: a quarter of the float32 bytes
    rows, grid = patchify(normalize_frames(frames, geometry), geometry)
    return ProcessedVisual(pixel_values=rows.to(dtype), grid_thw=torch.tensor([grid], dtype=torch.int64))


def process_image(
    pixels: PixelArray,
    geometry: ProcessorGeometry,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ProcessedVisual:
    """Process one image given as uint8 [h, w, 3] at its smart-resized size.

    Like the Qwen2-VL processor, the image becomes one temporal patch: the frame is repeated
    temporal_patch_size times inside each row, so grid_thw is (1, h / patch, w / patch).
    """
    image = _as_uint8(pixels, "image")
    if image.ndim != 3:
        raise ValueError(f"expected an image of shape [height, width, 3], got {tuple(image.shape)}")
    return _process(image.unsqueeze(0), geometry, dtype, device)


def process_video(
    frames: PixelArray,
    geometry: ProcessorGeometry,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> ProcessedVisual:
    """Process a clip given as uint8 [t, h, w, 3] frames of one smart-resized size (already sampled)."""
    return _process(_as_uint8(frames, "video"), geometry, dtype, device)
