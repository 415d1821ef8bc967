"""What one modality's loader is (`ModalityLoader`), and what it fills in for each item (`LoadedItem`).

A loader reads an item's header first, charges what the header predicts to the request's account before any
decode, then decodes (or, with `media.decode: header`, does not). `MediaLoader` (gateway/media/loader.py) holds
one loader per modality and picks by `MediaRef.modality`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.media.parts import MediaRef, Modality

if TYPE_CHECKING:
    from engine_adapter.client import ImageGeometry
    from gateway.media.accounting import RequestAccount
    from gateway.media.audio_decode import AudioHeader
    from gateway.media.image_decode import ImageHeader
    from gateway.media.resize import ModelResize, ResizedPixels
    from gateway.media.video_decode import VideoHeader


@dataclass(slots=True)
class LoadedItem:
    """One item once loaded: what was read from its header and what was counted for it."""

    ref: MediaRef
    encoded_bytes: int = 0
    header: ImageHeader | VideoHeader | AudioHeader | None = None
    predicted_bytes: int = 0
    """What the header predicted (decode plus processed tensors), charged before any decode."""
    processed: ImageGeometry | None = None
    sampled: list[int] = field(default_factory=list)
    """Video: the indices of the frames the model server samples (decoded unless `media.decode: header`)."""
    decoded: int = 0
    """Video: sampled frames decoded; audio: samples decoded (at `media.audio.sample_rate`)."""
    resized: ResizedPixels | None = None
    """Engine mode: the item's pixels resized for the engine's model (`ModelResize`)."""


class ModalityLoader(Protocol):
    """One modality's loader. Every method raises the gateway's errors (400/413) naming `ref.locator`.

    `resize` (engine mode): the item's pixels are resized for the engine's model and kept in `item.resized`; the
    loader charges those resized pixels, not the float32 tensors an upstream processor would make.
    """

    modality: Modality

    async def probe(self, ref: MediaRef, resize: ModelResize | None = None) -> int:
        """Bytes `load_inline` will count for this inline item (data URL or base64), from its header alone:
        nothing is decoded but the base64 and the container header."""
        ...

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, resize: ModelResize | None) -> None:
        """Check the header of `data` (a downloaded item's bytes), charge what it predicts to `account`, decode
        as configured, and fill `item`."""
        ...

    async def load_inline(self, item: LoadedItem, account: RequestAccount, resize: ModelResize | None) -> None:
        """`load` for an inline item (a data URL or base64, `item.ref.value`, which the caller holds alive until
        the load ends); `item.encoded_bytes` is set here."""
        ...
