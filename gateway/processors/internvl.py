"""InternVL 3: transformers' GotOcr2 image processor (crop_to_patches) resizes the image to the grid of
448 x 448 tiles (between min_patches and max_patches) whose aspect ratio is closest to it, cuts the tiles and adds
a thumbnail when there are several, float32; each tile is `image_seq_length` (256) tokens. The InternVL video
processor resizes every frame to one tile."""

from __future__ import annotations

from pathlib import Path

from gateway.processors.base import FLOAT32, INT64, Family, PeakModel, Processed, read_config, size_pair

IMAGE_PEAK = PeakModel(output=2.32, output_source=1.0, source=3.4, source_output=0.1, fixed=0)
VIDEO_PEAK = PeakModel(output=2.3, output_source=1.0, source=0.5, source_output=0.0, fixed=2 << 20)


def tiled_canvas(height: int, width: int, tile: tuple[int, int], low: int, high: int) -> tuple[int, int]:
    """transformers' `get_optimal_tiled_canvas`: (columns, rows)."""
    grids = sorted(
        ((w, h) for w in range(1, high + 1) for h in range(1, high + 1) if low <= w * h <= high),
        key=lambda grid: grid[0] * grid[1],
    )
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff = diff
            best = grid
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * grid[0] * grid[1]:
            best = grid
    return best


class InternVL(Family):
    name = "internvl3"
    image_peak = IMAGE_PEAK
    video_peak = VIDEO_PEAK

    def __init__(self, tile: tuple[int, int], low: int, high: int, crop: bool, tokens: int, frame: tuple[int, int]):
        self.tile = tile
        self.low = low
        self.high = high
        self.crop = crop
        self.tokens = tokens
        self.frame = frame

    @classmethod
    def from_config(cls, name: str, directory: Path) -> InternVL:
        image = read_config(directory, "preprocessor_config.json") or {}
        video = read_config(directory, "video_preprocessor_config.json") or image
        processor = read_config(directory, "processor_config.json") or {}
        tile = size_pair(image.get("size") or {"height": 448, "width": 448})
        return cls(
            tile,
            int(image.get("min_patches", 1)),
            int(image.get("max_patches", 12)),
            bool(image.get("crop_to_patches", True)),
            int(processor.get("image_seq_length", 256)),
            size_pair(video.get("size") or {"height": tile[0], "width": tile[1]}),
        )

    def image(self, height: int, width: int) -> Processed:
        count = 1
        if self.crop:
            columns, rows = tiled_canvas(height, width, self.tile, self.low, self.high)
            count = columns * rows + (1 if columns * rows > 1 else 0)
        returned = count * 3 * self.tile[0] * self.tile[1] * FLOAT32 + INT64  # pixel_values, num_patches
        return self._image(height, width, count * self.tokens, returned)

    def video(self, frames: int, height: int, width: int) -> Processed:
        returned = frames * 3 * self.frame[0] * self.frame[1] * FLOAT32
        return self._video(frames, height, width, frames * self.tokens, returned)
