"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: transformers' Qwen2-VL image processor (smart_resize to multiples of
patch x merge within the pixel bounds, the frame repeated to one temporal patch, float32 rows of channels x
temporal x patch^2) and their video processors (Qwen2-VL's for the first two, each frame bounded; Qwen3-VL's, the
clip's frames x pixels bounded). The geometry is processor_geometry's, which the engine shares."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway.processors.base import INT64, Family, PeakModel, Processed, read_config
from processor_geometry import ProcessorGeometry, image_geometry, video_geometry

# transformers 5's torchvision processors: the normalized float32 image and its patched copy beside the returned
# rows (1.75x them); a large input's uint8 copies and the resize's buffers (3.4x its bytes) beside the rows it
# becomes. A clip's frames are resized and normalized together, several copies of the returned rows at once.
PEAKS = {
    "qwen3_vl": (
        PeakModel(output=1.7, output_source=0.7, source=3.0, source_output=1.0, fixed=0),
        PeakModel(output=3.54, output_source=0.1, source=3.3, source_output=2.6, fixed=1 << 20),
    ),
    "qwen2_vl": (
        PeakModel(output=1.78, output_source=1.0, source=3.0, source_output=0.0, fixed=0),
        PeakModel(output=3.32, output_source=1.0, source=3.0, source_output=0.0, fixed=32 << 10),
    ),
}
_GRID_BYTES = 3 * INT64


def _pixels(config: dict[str, Any]) -> tuple[int | None, int | None]:
    size = config.get("size") or {}
    low = config.get("min_pixels", size.get("shortest_edge"))
    high = config.get("max_pixels", size.get("longest_edge"))
    return (int(low) if low is not None else None, int(high) if high is not None else None)


def geometry_from(name: str, image: dict[str, Any], video: dict[str, Any] | None) -> ProcessorGeometry:
    """The processor geometry a model directory's preprocessor configs fix."""
    low, high = _pixels(image)
    if low is None or high is None:
        raise ValueError(f"{name}: preprocessor_config.json gives no pixel bounds (size or min_pixels/max_pixels)")
    geometry = ProcessorGeometry(
        name=name,
        patch_size=int(image.get("patch_size", 14)),
        temporal_patch_size=int(image.get("temporal_patch_size", 2)),
        merge_size=int(image.get("merge_size", 2)),
        min_pixels=low,
        max_pixels=high,
        image_mean=tuple(image.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(image.get("image_std", (0.5, 0.5, 0.5))),
    )
    if video is not None:
        video_low, video_high = _pixels(video)
        clip = "Qwen3VL" in str(video.get("video_processor_type", ""))
        geometry = replace(geometry, video_bounds="clip" if clip else "frame").with_video_pixels(video_low, video_high)
    return geometry


class Qwen(Family):
    def __init__(self, geometry: ProcessorGeometry) -> None:
        self.name = geometry.name
        self.image_peak, self.video_peak = PEAKS["qwen3_vl" if geometry.patch_size == 16 else "qwen2_vl"]
        self.geometry = geometry
        self.frame_factor = geometry.temporal_patch_size
        self.whole_patches = geometry.video_bounds == "frame"

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Qwen:
        image = read_config(directory, "preprocessor_config.json") or {}
        return cls(geometry_from(name, image, read_config(directory, "video_preprocessor_config.json")))

    def image(self, height: int, width: int) -> Processed:
        made = image_geometry(height, width, self.geometry)
        return self._image(height, width, made.llm_tokens, made.processed_bytes + _GRID_BYTES)

    def video(self, frames: int, height: int, width: int) -> Processed:
        made = video_geometry(frames, height, width, self.geometry)
        return self._video(frames, height, width, made.llm_tokens, made.processed_bytes + _GRID_BYTES)
