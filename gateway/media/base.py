"""What one modality's loader is (`ModalityLoader`), and what it fills in for each item (`LoadedItem`).

A loader reads an item's header first, charges what the header predicts to the request's account before any
decode, then decodes (or, with `media.decode: header`, does not). `MediaLoader` (gateway/media/loader.py) holds
one loader per modality and picks by `MediaRef.modality`.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from gateway.media.accounting import RequestAccount
from gateway.media.container import MemoryInput
from gateway.media.parts import MediaRef, Modality
from gateway.media.resize import ModelResize
from gateway.media.sources.inline import checked_inline_size, inline_input
from gateway.media.threads import DecodeControl, Worker
from gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.media.audio.decode import AudioHeader
    from gateway.media.image.decode import ImageHeader
    from gateway.media.resize import ResizedPixels
    from gateway.media.video.decode import VideoHeader
    from gateway.processors.base import Processed
    from processor_geometry import ProcessorGeometry

PlanT = TypeVar("PlanT")
T = TypeVar("T")


@dataclass(slots=True)
class LoadedItem:
    """One item once loaded: what was read from its header and what was counted for it."""

    ref: MediaRef
    encoded_bytes: int = 0
    header: ImageHeader | VideoHeader | AudioHeader | None = None
    predicted_bytes: int = 0
    """What the header predicted (decode plus processed tensors), charged before any decode."""
    processed: Processed | None = None
    """With `media.processor`: what the model server's processor makes of it and holds (the largest candidate)."""
    sampled: list[int] = field(default_factory=list)
    """Video: the indices of the frames the model server samples (decoded unless `media.decode: header`)."""
    decoded: int = 0
    """Video: sampled frames decoded; audio: samples decoded (at `media.audio.sample_rate`)."""
    resized: ResizedPixels | None = None
    """Engine mode: the item's pixels resized for the engine's model (`ModelResize`)."""
    downloaded: bytes | None = None
    """A URL item's bytes as downloaded and checked, kept to be forwarded in place of its URL
    (`media.fetch.forward: inline`)."""


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


@dataclass(frozen=True, slots=True)
class ContainerRules:
    """One modality's container rules, from `media` and `limits`."""

    formats: tuple[str, ...]
    """Container names (`media.video_formats`, `media.audio_formats`)."""
    codecs: tuple[str, ...]
    max_seconds: float | None
    decode: bool
    """False with `media.decode: header`: the header is read and charged, nothing is decoded."""
    decode_timeout_s: float | None


class ContainerLoader(ABC, Generic[PlanT]):
    """What the video and audio loaders share. PyAV reads the container through a file object over the item's
    bytes (a `MemoryInput` over a download's, a `Base64Input` over an inline item's base64, decoded range by range
    as it is read), a new one for each pass; the header is read (`plan`) and what it predicts charged before
    anything is decoded."""

    modality: Modality

    def __init__(self, worker: Worker, metrics: GatewayMetrics, rules: ContainerRules) -> None:
        self.worker = worker
        self.rules = rules
        self._frames_decoded = metrics.media_frames_decoded.labels(self.modality.value)
        self._predicted_bytes = metrics.media_predicted_bytes.labels(self.modality.value)
        self._decode_seconds = metrics.media_decode_seconds.labels(self.modality.value)

    @abstractmethod
    def plan(
        self, source: MemoryInput, locator: str, control: DecodeControl | None, resize: ProcessorGeometry | None
    ) -> PlanT:
        """On a media thread: the header read from `source`, the limits' refusals, and what decoding will cost.
        `resize` (engine mode): the geometry the item is resized to and kept in."""

    @abstractmethod
    def predicted_bytes(self, plan: PlanT) -> int: ...

    @abstractmethod
    async def charge_and_decode(
        self,
        item: LoadedItem,
        plan: PlanT,
        open_input: Callable[[], MemoryInput],
        account: RequestAccount,
        control: DecodeControl,
        resize: ProcessorGeometry | None,
    ) -> None:
        """Charge what `plan` predicts, then decode as configured (`open_input()`: a new file object)."""

    async def probe(self, ref: MediaRef, resize: ModelResize | None = None) -> int:
        control = DecodeControl(self.rules.decode_timeout_s)
        geometry = resize.geometry if resize is not None else None

        def read() -> int:
            # The header is read from the base64 itself, as `load_inline` reads the container.
            return self.predicted_bytes(self.plan(inline_input(ref, control), ref.locator, control, geometry))

        return await self.worker.run(ref.locator, read, control=control)

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, resize: ModelResize | None) -> None:
        await self._load(item, functools.partial(MemoryInput, data), account, resize)

    async def load_inline(self, item: LoadedItem, account: RequestAccount, resize: ModelResize | None) -> None:
        # Every character is checked before the container reads any (a range it never reads would pass unchecked).
        item.encoded_bytes = await checked_inline_size(item.ref, self.worker)
        await self._load(item, functools.partial(inline_input, item.ref), account, resize)

    async def _load(
        self,
        item: LoadedItem,
        open_input: Callable[[DecodeControl], MemoryInput],
        account: RequestAccount,
        resize: ModelResize | None,
    ) -> None:
        locator = item.ref.locator
        control = DecodeControl(self.rules.decode_timeout_s)
        geometry = resize.geometry if resize is not None else None
        read = functools.partial(self.plan, open_input(control), locator, control, geometry)
        plan = await self.worker.run(locator, read, control=control)
        item.predicted_bytes = self.predicted_bytes(plan)
        self._predicted_bytes.observe(item.predicted_bytes)
        await self.charge_and_decode(item, plan, functools.partial(open_input, control), account, control, geometry)

    async def timed_decode(self, locator: str, decode: Callable[[], T], control: DecodeControl) -> T:
        """`decode()` on a media thread, its time observed in `mmgate_media_decode_seconds`."""
        started = time.perf_counter()
        result = await self.worker.run(locator, decode, control=control)
        self._decode_seconds.observe(time.perf_counter() - started)
        return result
