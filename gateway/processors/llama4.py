"""Llama 4: transformers' Llama4 image processor fits the image, without distortion, on the canvas of tiles
(336 x 336, at most `max_patches`) that needs the least scaling, pads it, cuts it into tiles and adds a global
thumbnail tile when there are several, in bfloat16; each tile is (336 / 14)^2 x pixel_shuffle_ratio^2 tokens. No
video processor."""

from __future__ import annotations

from pathlib import Path

from gateway.processors.base import BFLOAT16, INT64, Family, PeakModel, Processed, read_config, size_pair

IMAGE_PEAK = PeakModel(output=2.68, output_source=0.0, source=3.35, source_output=1.3, fixed=0)


def supported_resolutions(max_chunks: int, tile: int) -> list[tuple[int, int]]:
    """transformers' `find_supported_resolutions`: every rows x columns of at most `max_chunks` tiles."""
    ratios: dict[float, list[tuple[int, int]]] = {}
    for chunks in range(max_chunks, 0, -1):
        factors = sorted({f for i in range(1, int(chunks**0.5) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for rows in factors:
            ratios.setdefault(rows / (chunks // rows), []).append((rows, chunks // rows))
    return [(rows * tile, columns * tile) for value in ratios.values() for rows, columns in value]


def best_fit(height: int, width: int, resolutions: list[tuple[int, int]], to_max: bool) -> tuple[int, int]:
    """transformers' `get_best_fit` (float32 scales, as its torch tensors compute them)."""
    import numpy as np

    heights = np.array([r[0] for r in resolutions], dtype=np.float32)
    widths = np.array([r[1] for r in resolutions], dtype=np.float32)
    scale_w = widths / np.float32(width)
    scale_h = heights / np.float32(height)
    scales = np.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    selected = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    chosen = [resolutions[i] for i in np.nonzero(scales == selected)[0]]
    return min(chosen, key=lambda r: r[0] * r[1]) if len(chosen) > 1 else chosen[0]


class Llama4(Family):
    name = "llama4"
    image_peak = IMAGE_PEAK

    def __init__(self, tile: int, max_patches: int, to_max: bool, tile_tokens: int) -> None:
        self.tile = tile
        self.resolutions = supported_resolutions(max_patches, tile)
        self.to_max = to_max
        self.tile_tokens = tile_tokens

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Llama4:
        image = read_config(directory, "preprocessor_config.json") or {}
        vision = (read_config(directory, "config.json") or {}).get("vision_config") or {}
        height, width = size_pair(image.get("size") or {"height": 336, "width": 336})
        if height != width:
            raise ValueError(f"{directory}: Llama 4 tiles must be square")
        patch = int(vision.get("patch_size", 14))
        shuffle = float(vision.get("pixel_shuffle_ratio", 0.5))
        tile_tokens = int((height // patch) ** 2 * shuffle**2)
        return cls(height, int(image.get("max_patches", 16)), bool(image.get("resize_to_max_canvas")), tile_tokens)

    def image(self, height: int, width: int) -> Processed:
        canvas = best_fit(height, width, self.resolutions, self.to_max)
        tiles = (canvas[0] // self.tile) * (canvas[1] // self.tile)
        count = tiles + 1 if tiles > 1 else 1
        returned = count * 3 * self.tile * self.tile * BFLOAT16 + 2 * INT64  # pixel_values, aspect_ratios
        return self._image(height, width, count * self.tile_tokens, returned)
