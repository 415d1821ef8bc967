"""GLM-4.1V and GLM-4.5V: transformers' Glm4v processors, Qwen2-VL's patching with GLM's smart_resize, which
bounds temporal patch x height x width (an image is one temporal patch of two frames) and scales up a side under
patch x merge first: the arithmetic of processor_geometry's clip-bounded video resize."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gateway.processors.base import INT64, Family, PeakModel, Processed, read_config
from gateway.processors.qwen import geometry_from
from processor_geometry import ProcessorGeometry, video_geometry

IMAGE_PEAK = PeakModel(output=1.72, output_source=0.9, source=3.0, source_output=0.6, fixed=0)
VIDEO_PEAK = PeakModel(output=3.32, output_source=1.0, source=3.0, source_output=0.0, fixed=32 << 10)
_GRID_BYTES = 3 * INT64


class Glm4v(Family):
    name = "glm4v"
    image_peak = IMAGE_PEAK
    video_peak = VIDEO_PEAK

    def __init__(self, image: ProcessorGeometry, video: ProcessorGeometry) -> None:
        self.image_geometry = image
        self.video_geometry = video
        self.frame_factor = image.temporal_patch_size
        self.whole_patches = False

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Glm4v:
        image_config = read_config(directory, "preprocessor_config.json") or {}
        video_config = read_config(directory, "video_preprocessor_config.json") or image_config
        image = replace(geometry_from(name, image_config, None), video_bounds="clip")
        image = image.with_video_pixels(image.min_pixels, image.max_pixels)
        video = replace(geometry_from(name, video_config, None), video_bounds="clip")
        return cls(image, video.with_video_pixels(video.min_pixels, video.max_pixels))

    def image(self, height: int, width: int) -> Processed:
        made = video_geometry(self.image_geometry.temporal_patch_size, height, width, self.image_geometry)
        return self._image(height, width, made.llm_tokens, made.processed_bytes + _GRID_BYTES)

    def video(self, frames: int, height: int, width: int) -> Processed:
        made = video_geometry(frames, height, width, self.video_geometry)
        return self._video(frames, height, width, made.llm_tokens, made.processed_bytes + _GRID_BYTES)
