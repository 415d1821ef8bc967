"""Gemma 3: transformers' Gemma3 image processor resizes every image to one square (896 x 896), float32; each
image is `image_seq_length` (256) tokens. Pan-and-scan (off in the published configs and by default in vLLM) adds
crops; a config that turns it on is refused. No video processor."""

from __future__ import annotations

from pathlib import Path

from gateway.processors.base import FLOAT32, INT64, Family, PeakModel, Processed, read_config, size_pair

IMAGE_PEAK = PeakModel(output=2.3, output_source=1.0, source=3.4, source_output=0.1, fixed=128 << 10)


class Gemma3(Family):
    name = "gemma3"
    image_peak = IMAGE_PEAK

    def __init__(self, side: tuple[int, int], tokens: int) -> None:
        self.side = side
        self.tokens = tokens

    @classmethod
    def from_config(cls, name: str, directory: Path) -> Gemma3:
        image = read_config(directory, "preprocessor_config.json") or {}
        processor = read_config(directory, "processor_config.json") or {}
        if image.get("do_pan_and_scan"):
            raise ValueError(f"{directory}: Gemma 3 with do_pan_and_scan is not modelled")
        tokens = processor.get("image_seq_length", image.get("image_seq_length", 256))
        return cls(size_pair(image.get("size") or {"height": 896, "width": 896}), int(tokens))

    def image(self, height: int, width: int) -> Processed:
        returned = 3 * self.side[0] * self.side[1] * FLOAT32 + INT64  # pixel_values and num_crops
        return self._image(height, width, self.tokens, returned)
