"""transformers' Qwen3-VL processors as test oracles: its video processor's smart_resize and frame sampling, and the
tensors its image and video processors return.

The installed transformers has no torchvision beside it, and its video processor resizes and normalizes with
torchvision; the oracle processor resizes with torch's bilinear interpolation and rescales by 1/255 instead. Neither
changes a shape or a dtype: everything else (its smart_resize, frame padding, patchify, grids) is transformers' own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from processor_geometry import QWEN3_VL

__all__ = ["image_processor", "sample_frames", "video_processor", "video_smart_resize"]


class _InterpolatingBackend(TorchvisionBackend):
    def resize(self, image: torch.Tensor, size: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        lead = image.shape[:-3]
        flat = image.reshape(-1, *image.shape[-3:]).to(torch.float32)
        resized = F.interpolate(flat, size=(size.height, size.width), mode="bilinear")
        return resized.reshape(*lead, *resized.shape[-3:]).to(image.dtype)


class _OracleVideoProcessor(Qwen3VLVideoProcessor, _InterpolatingBackend):  # type: ignore[misc]
    def rescale_and_normalize(self, images: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return images.to(torch.float32) / 255


def video_processor() -> Qwen3VLVideoProcessor:
    """transformers' Qwen3-VL video processor with the published checkpoints' video bounds."""
    low, high = QWEN3_VL.video_pixels
    return _OracleVideoProcessor(size={"shortest_edge": low, "longest_edge": high})


def process_video(frames: npt.NDArray[np.uint8]) -> dict[str, torch.Tensor]:
    """`pixel_values_videos` and `video_grid_thw` of one clip of uint8 [t, h, w, 3] frames, sampled already."""
    out = video_processor()(
        videos=[frames], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False, do_convert_rgb=False
    )
    return {key: out[key] for key in ("pixel_values_videos", "video_grid_thw")}


def video_smart_resize(frames: int, height: int, width: int) -> tuple[int, int]:
    low, high = QWEN3_VL.video_pixels
    h, w = smart_resize(frames, height, width, QWEN3_VL.temporal_patch_size, QWEN3_VL.factor, low, high)
    return int(h), int(w)


def sample_frames(total: int, rate: float, fps: float) -> list[int]:
    """The frame indices the Qwen3-VL video processor samples at `fps` from `total` frames at `rate`."""
    indices = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=total, fps=rate), fps=fps)
    return [int(i) for i in indices]


def image_processor() -> Qwen2VLImageProcessorPil:
    """The image processor a Qwen3-VL checkpoint loads (transformers maps qwen3_vl to the Qwen2-VL image processor),
    with its published preprocessor_config.json: patch 16, merge 2, temporal 2, 65,536..16,777,216 pixels, mean and
    std 0.5."""
    return Qwen2VLImageProcessorPil(
        patch_size=QWEN3_VL.patch_size,
        temporal_patch_size=QWEN3_VL.temporal_patch_size,
        merge_size=QWEN3_VL.merge_size,
        min_pixels=QWEN3_VL.min_pixels,
        max_pixels=QWEN3_VL.max_pixels,
        image_mean=list(QWEN3_VL.image_mean),
        image_std=list(QWEN3_VL.image_std),
    )
