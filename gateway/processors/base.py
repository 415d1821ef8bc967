"""What a model server's processor makes of one image or clip (`Processed`), and the model of its peak every family
shares (`PeakModel`).

Each family's module (one per family, as vLLM keeps them) ports the arithmetic of transformers' processor for it:
the resize, the tiles and thumbnails, the patching, the dtype, so its token count and the bytes of the tensors it
returns are the processor's own. What the processor holds at its peak is more than it returns: the uint8 copy of
the input it resizes from, the resize's working buffers, the float32 image it normalizes, the patched copy. The
peak model (`PeakModel`) puts that in two stages, each a sum of the returned tensors' and the input's bytes times
factors fitted to transformers' torchvision processors (5.x, the ones vLLM runs), as
tests/gateway/processors/ measures them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLOAT32 = 4
BFLOAT16 = 2
INT64 = 8
HELD_PER_RETURNED = 2.5


@dataclass(frozen=True, slots=True)
class PeakModel:
    """The processor's peak for an item whose input is `source` bytes (uint8 RGB, h x w x 3 per frame) and whose
    returned tensors are `returned` bytes, whichever of two stages holds more, plus `fixed` bytes: the stage that
    makes the returned tensors (`output` x returned + `output_source` x source: the normalized and patched copies,
    and what of the input is still held) or the stage that reads and resizes the input (`source` x source +
    `source_output` x returned: the input's uint8 copies and the resize's buffers, and what it has made)."""

    output: float
    output_source: float
    source: float
    source_output: float
    fixed: int
    floor: int = 0
    """The least it holds for any item (the Python objects of a call, for an image of a few pixels)."""

    def peak(self, source: int, returned: int) -> int:
        making = returned * self.output + source * self.output_source
        reading = source * self.source + returned * self.source_output
        return max(int(max(making, reading)) + self.fixed, self.floor)


@dataclass(frozen=True, slots=True)
class Processed:
    """What a processor makes of one image or clip."""

    tokens: int
    """The LLM tokens (placeholders) the item becomes, as the model's processor counts them."""
    returned: int
    """Bytes of the tensors the processor returns for it."""
    peak: int
    """What the processor holds at its peak while it processes the item alone, the returned tensors included: the
    item's charge."""
    held: float
    """What the item keeps while the other items of its request are processed and the results concatenated: see
    `request_bytes`."""
    padded: bool = False
    """The processor pads every image of a call to the largest one and holds each one's working copies until the
    batch is stacked (Pixtral's)."""


def request_bytes(items: list[Processed]) -> int:
    """What the server's processor holds at once for a request's items: it takes them in one call, stage by stage,
    so each item keeps its `held` bytes while the others are processed (and concatenated), and the working memory
    on top of that is the largest one item needs. One item: its peak."""
    if not items:
        return 0
    if len(items) == 1:
        return items[0].peak
    if any(item.padded for item in items):
        # Each image padded to the largest and processed whole before the batch is stacked: measured, two
        # 1280x720 images hold twice one's peak, and 640x480 beside two of them as much as a third 1280x720.
        return len(items) * max(item.peak for item in items)
    return int(sum(item.held for item in items) + max(max(0.0, item.peak - item.held) for item in items))


def read_config(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / name
    if not path.is_file():
        return None
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def size_pair(size: dict[str, Any], key_h: str = "height", key_w: str = "width") -> tuple[int, int]:
    return int(size[key_h]), int(size[key_w])


class Family:
    """One model family's processors, configured from a model's config directory (the files the model server
    loads: preprocessor_config.json, video_preprocessor_config.json, processor_config.json, config.json)."""

    name: str = ""
    image_peak: PeakModel
    video_peak: PeakModel | None = None
    frame_factor: int = 1
    """Qwen's fps sampling rule rounds the frame count to whole temporal patches of this many frames."""
    whole_patches: bool = True

    def image(self, height: int, width: int) -> Processed:
        """What the image processor makes of an image of height x width; ValueError where it refuses it."""
        raise NotImplementedError

    def video(self, frames: int, height: int, width: int) -> Processed | None:
        """What the video processor makes of `frames` sampled frames of height x width; None where the family has
        no video processor (its server refuses video); ValueError where the processor refuses the clip."""
        return None

    def _image(self, height: int, width: int, tokens: int, returned: int) -> Processed:
        return _processed(self.image_peak, 3 * height * width, tokens, returned)

    def _video(self, frames: int, height: int, width: int, tokens: int, returned: int) -> Processed:
        assert self.video_peak is not None
        return _processed(self.video_peak, 3 * frames * height * width, tokens, returned)


def _processed(model: PeakModel, source: int, tokens: int, returned: int) -> Processed:
    # Held while a request's other items are processed: the uint8 copy of its input (every input is converted
    # before the first is resized), and its returned tensors twice over once they are concatenated into the batch,
    # with what the last stage still references (measured: 2.46x the returned tensors for three Qwen2-VL images).
    return Processed(tokens, returned, model.peak(source, returned), source + HELD_PER_RETURNED * returned)
