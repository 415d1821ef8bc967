"""Pixtral and Mistral Small 3.1 (Mistral 3): transformers' Pixtral image processor scales the image down to fit
longest_edge (never up) and then up to whole patches, float32, one image at its own size; the tokens are rows of
(patch x spatial_merge) cells, each row ended by a break token. No video processor."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from gateway.processors.base import FLOAT32, INT64, Family, PeakModel, Processed, read_config

IMAGE_PEAK = PeakModel(output=3.3, output_source=1.0, source=3.4, source_output=0.0, fixed=0, floor=72 << 10)


class Pixtral(Family):
    image_peak = IMAGE_PEAK

    def __init__(self, name: str, longest: int, patch: int, merge: int) -> None:
        self.name = name
        self.longest = longest
        self.patch = patch
        self.merge = merge

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Pixtral:
        image = read_config(directory, "preprocessor_config.json") or {}
        processor = read_config(directory, "processor_config.json") or {}
        patch = image.get("patch_size", 16)
        patch = int(patch["height"]) if isinstance(patch, dict) else int(patch)
        longest = int((image.get("size") or {}).get("longest_edge", 1024))
        return cls(name, longest, patch, int(processor.get("spatial_merge_size", 1)))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' Pixtral `get_resize_output_image_size`."""
        ratio = max(height / self.longest, width / self.longest)
        if ratio > 1:
            height = math.floor(height / ratio)
            width = math.floor(width / ratio)
        return ((height - 1) // self.patch + 1) * self.patch, ((width - 1) // self.patch + 1) * self.patch

    def image(self, height: int, width: int) -> Processed:
        h, w = self.resized(height, width)
        cell = self.patch * self.merge
        tokens = (h // cell) * (w // cell + 1)
        returned = 3 * h * w * FLOAT32 + 2 * INT64  # pixel_values, image_sizes
        return replace(self._image(height, width, tokens, returned), padded=True)
