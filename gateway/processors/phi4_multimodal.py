"""Phi-4-multimodal: transformers' Phi4Multimodal image processor resizes the image, aspect kept, onto a grid of
448 x 448 crops (as many as cover it, or past `dynamic_hd` crops the grid of closest aspect), pads it, and returns
the crops with a global 448 x 448 view, float32, with a float32 attention mask per crop; the token count follows
the mask's unpadded cells."""

from __future__ import annotations

import math
from pathlib import Path

from gateway.processors.base import FLOAT32, INT64, Family, PeakModel, Processed, read_config, size_pair

IMAGE_PEAK = PeakModel(output=3.22, output_source=1.7, source=3.0, source_output=1.9, fixed=0)


class Phi4Multimodal(Family):
    name = "phi4_multimodal"
    image_peak = IMAGE_PEAK

    def __init__(self, crop: int, patch: int, max_crops: int) -> None:
        self.crop = crop
        self.patch = patch
        self.max_crops = max_crops

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Phi4Multimodal:
        image = read_config(directory, "preprocessor_config.json") or {}
        height, width = size_pair(image.get("size") or {"height": 448, "width": 448})
        if height != width:
            raise ValueError(f"{directory}: Phi-4-multimodal crops must be square")
        return cls(height, int(image.get("patch_size", 14)), int(image.get("dynamic_hd", 36)))

    def layout(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """transformers' `_get_crop_layout`: the (columns, rows) grid and the (width, height) padding."""
        size = self.crop
        columns, rows = math.ceil(width / float(size)), math.ceil(height / float(size))
        if columns * rows > self.max_crops:
            aspect = width / height
            ratios = sorted(
                {
                    (i, j)
                    for n in range(1, self.max_crops + 1)
                    for i in range(1, n + 1)
                    for j in range(1, n + 1)
                    if 1 <= i * j <= self.max_crops
                },
                key=lambda r: r[0] * r[1],
            )
            best_diff, best = float("inf"), (1, 1)
            for ratio in ratios:
                diff = abs(aspect - ratio[0] / ratio[1])
                if diff < best_diff:
                    best_diff, best = diff, ratio
                elif diff == best_diff and width * height > 0.5 * size * size * ratio[0] * ratio[1]:
                    best = ratio
            columns, rows = best
        target_w, target_h = size * columns, size * rows
        if target_w / width < target_h / height:
            new_w, new_h = target_w, int(height * (target_w / width))
        else:
            new_w, new_h = int(width * (target_h / height)), target_h
        if min(new_h, target_h) < 10 or min(new_w, target_w) < 10:
            raise ValueError(f"an image of {width}x{height} pixels is too elongated for Phi-4-multimodal's crops")
        return (columns, rows), (target_w - new_w, target_h - new_h)

    def image(self, height: int, width: int) -> Processed:
        (columns, rows), (pad_w, pad_h) = self.layout(height, width)
        mask = self.crop // self.patch
        mask_w, mask_h = mask * columns, mask * rows
        cut_w = math.floor(pad_w / self.patch) if pad_w >= self.patch else 0
        cut_h = math.floor(pad_h / self.patch) if pad_h >= self.patch else 0
        # transformers' `_get_num_image_tokens`: the mask's cells kept by its 2x downsampling within each crop,
        # and its first column.
        kept_w = sum(1 for x in range(mask_w) if x % mask % 2 == 0 and x < mask_w - cut_w)
        kept_h = sum(1 for y in range(mask_h) if y % mask % 2 == 0 and y < mask_h - cut_h)
        tokens = 256 + 1 + kept_w * kept_h + (kept_h if kept_w else 0) + 16
        crops = columns * rows + 1
        returned = crops * 3 * self.crop * self.crop * FLOAT32 + crops * mask * mask * FLOAT32 + 2 * INT64 + INT64
        return self._image(height, width, tokens, returned)
