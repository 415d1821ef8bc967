"""LLaVA-OneVision: transformers' LlavaOnevision image processor picks the grid pinpoint that keeps the most of the
image (anyres), resizes the image onto it, aspect kept, pads it, cuts it into 384 x 384 patches and adds the whole
image resized to one patch, float32; the tokens are the base patch's plus the unpadded features of the grid (with
a newline per row), scaled down past anyres_max_9. Its video processor resizes every frame to one patch, pooled to
14 x 14 tokens a frame."""

from __future__ import annotations

import math
from pathlib import Path

from gateway.processors.base import FLOAT32, INT64, Family, PeakModel, Processed, read_config, size_pair

IMAGE_PEAK = PeakModel(output=4.5, output_source=0.75, source=3.4, source_output=0.0, fixed=0)
VIDEO_PEAK = PeakModel(output=2.3, output_source=1.03, source=0.5, source_output=0.0, fixed=0)


def best_resolution(height: int, width: int, pinpoints: list[tuple[int, int]]) -> tuple[int, int]:
    """transformers' `select_best_resolution`."""
    best = pinpoints[0]
    most, least_wasted = 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least_wasted):
            most, least_wasted, best = effective, wasted, (h, w)
    return best


class LlavaOnevision(Family):
    name = "llava_onevision"
    image_peak = IMAGE_PEAK
    video_peak = VIDEO_PEAK

    def __init__(self, side: int, pinpoints: list[tuple[int, int]], base_tokens: int, max_patches: int) -> None:
        self.side = side
        self.pinpoints = pinpoints
        self.base_tokens = base_tokens
        self.max_patches = max_patches

    @classmethod
    def from_config(cls, name: str, directory: Path) -> LlavaOnevision:
        image = read_config(directory, "preprocessor_config.json") or {}
        processor = read_config(directory, "processor_config.json") or {}
        height, width = size_pair(image.get("size") or {"height": 384, "width": 384})
        if height != width:
            raise ValueError(f"{directory}: LLaVA-OneVision patches must be square")
        pinpoints = [(int(h), int(w)) for h, w in image["image_grid_pinpoints"]]
        aspect = str(processor.get("vision_aspect_ratio", "anyres_max_9"))
        return cls(
            height, pinpoints, int(processor.get("num_image_tokens", 729)), int(aspect.removeprefix("anyres_max_"))
        )

    def tokens(self, height: int, width: int, best: tuple[int, int]) -> int:
        """transformers' LlavaOnevisionProcessor `_get_number_of_features`."""
        side = int(math.sqrt(self.base_tokens))
        current_h, current_w = side * (best[0] // self.side), side * (best[1] // self.side)
        if width / height > current_w / current_h:
            new_h = int(round(height * (current_w / width), 7))
            current_h -= (current_h - new_h) // 2 * 2
        else:
            new_w = int(round(width * (current_h / height), 7))
            current_w -= (current_w - new_w) // 2 * 2
        features, newlines = current_h * current_w, current_h
        ratio = math.sqrt(current_h * current_w / (self.max_patches * side**2))
        if ratio > 1.1:
            features = int(current_h // ratio) * int(current_w // ratio)
            newlines = int(current_h // ratio)
        return features + newlines + self.base_tokens

    def image(self, height: int, width: int) -> Processed:
        best = best_resolution(height, width, self.pinpoints)
        patches = (best[0] // self.side) * (best[1] // self.side) + 1
        returned = patches * 3 * self.side * self.side * FLOAT32 + 2 * INT64 + INT64
        return self._image(height, width, self.tokens(height, width, best), returned)

    def video(self, frames: int, height: int, width: int) -> Processed:
        pooled = math.ceil(int(math.sqrt(self.base_tokens)) / 2)
        returned = frames * 3 * self.side * self.side * FLOAT32
        return self._video(frames, height, width, frames * pooled * pooled + 1, returned)
