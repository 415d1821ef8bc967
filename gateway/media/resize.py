"""Engine mode's resize: what the media loaders keep of an item for the engine, the pixels resized to the engine
model's geometry.

An image is resized by `ModelResize.image`; a video's loader resizes its sampled frames to one size for the whole
clip itself (`video_frame_size`) and keeps them as one uint8 `[t, h, w, 3]` array. Either is kept as
`ResizedPixels`, hashed as the engine hashes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from PIL import Image

from engine_adapter.client import content_hash
from gateway.media.threads import DecodeControl
from processor_geometry import ProcessorGeometry, resize_for_model


class ResizedPixels(NamedTuple):
    """uint8 pixels resized for the engine's model (`[h, w, 3]` for an image, `[t, h, w, 3]` for a video) and
    their hash."""

    pixels: npt.NDArray[np.uint8]
    sha256: str

    @classmethod
    def of(cls, pixels: npt.NDArray[np.uint8]) -> ResizedPixels:
        return cls(pixels, content_hash(pixels))


@dataclass(frozen=True, slots=True)
class ModelResize:
    """Resizes each item for the engine model's `geometry`."""

    geometry: ProcessorGeometry

    def image(self, image: Image.Image, *, control: DecodeControl | None = None) -> ResizedPixels:
        """`control`, when given, is checked between the resize's strips: a request gone stops it there."""
        between = control.check if control is not None else None
        return ResizedPixels.of(resize_for_model(image, self.geometry, between=between))
