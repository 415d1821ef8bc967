"""What one modality's loader is (`ModalityLoader`), what it fills in for each item (`LoadedItem`), and what the video
and audio loaders share (`ContainerLoader`).

A loader plans an item's route before anything is reserved (`plan`), may predict its bytes from its header alone
(`predict`), then loads it as its plan says: reads its header, charges what the header predicts to the request's
account before any decode, then decodes (or, with `media.decode: header`, does not). `MediaLoader`
(gateway/media/loader.py) holds one loader per modality and picks by `MediaRef.modality`.
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
from gateway.media.plan import ItemPlan, Keep
from gateway.media.sources.inline import checked_inline_size, inline_input
from gateway.media.threads import DecodeControl, Worker
from gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.media.resize import ResizedPixels
    from gateway.processors.base import Processed

PlanT = TypeVar("PlanT", bound=ItemPlan)
ProbeT = TypeVar("ProbeT")
T = TypeVar("T")


class Header(Protocol):
    """What an item's header read says, whatever its modality."""

    @property
    def media_type(self) -> str:
        """The media type of the item's bytes, from what the read found (not from what a URL's server said)."""
        ...


@dataclass(slots=True)
class LoadedItem:
    """One item once loaded: what was read from its header and what was counted for it."""

    ref: MediaRef
    encoded_bytes: int = 0
    header: Header | None = None
    predicted_bytes: int = 0
    """What the header predicted (decode plus processed tensors), charged before any decode."""
    processed: Processed | None = None
    """With `media.processor`: what the model server's processor makes of it and holds (the largest candidate)."""
    sampled: list[int] = field(default_factory=list)
    """Video: the indices of the frames the model server samples (decoded unless `media.decode: header`)."""
    decoded: int = 0
    """Video: sampled frames decoded; audio: samples decoded (at `media.audio.sample_rate`)."""
    resized: ResizedPixels | None = None
    """Engine mode (`Keep.resize`): the item's pixels resized for the engine's model."""
    downloaded: bytes | None = None
    """A URL item's bytes as downloaded and checked, kept to be forwarded in place of its URL (`Keep.downloads`)."""


class ModalityLoader(Protocol[PlanT]):
    """One modality's loader. Every method raises the gateway's errors (400/413) naming `ref.locator`."""

    modality: Modality

    def plan(self, ref: MediaRef, keep: Keep, *, sole: bool) -> PlanT:
        """The item's route through its load, from what the request holds of it (no work on a media thread)."""
        ...

    async def predict(self, plan: PlanT) -> tuple[int, PlanT]:
        """Bytes `load_inline` will count for this inline item (data URL or base64), from its header alone
        (nothing is decoded but the base64 and the container header), and the plan with what was opened for it."""
        ...

    async def load(self, item: LoadedItem, plan: PlanT, data: bytes, account: RequestAccount) -> None:
        """Check the header of `data` (a downloaded item's bytes), charge what it predicts to `account`, decode
        as configured, and fill `item`."""
        ...

    async def load_inline(self, item: LoadedItem, plan: PlanT, account: RequestAccount) -> None:
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


class ContainerLoader(ABC, Generic[ProbeT]):
    """What the video and audio loaders share. PyAV reads the container through a file object over the item's
    bytes (a `MemoryInput` over a download's, a `Base64Input` over an inline item's base64, decoded range by range
    as it is read), a new one for each pass; the header is read (`probe`) and what it predicts charged before
    anything is decoded. Every pass runs on a media thread: an item's plan is its ref and what is kept."""

    modality: Modality

    def __init__(self, worker: Worker, metrics: GatewayMetrics, rules: ContainerRules) -> None:
        self.worker = worker
        self.rules = rules
        self._frames_decoded = metrics.media_frames_decoded.labels(self.modality.value)
        self._predicted_bytes = metrics.media_predicted_bytes.labels(self.modality.value)
        self._decode_seconds = metrics.media_decode_seconds.labels(self.modality.value)

    @abstractmethod
    def probe(self, source: MemoryInput, locator: str, control: DecodeControl | None, keep: Keep) -> ProbeT:
        """On a media thread: the header read from `source`, the limits' refusals, and what decoding it (and
        keeping what `keep` keeps) will cost."""

    @abstractmethod
    def predicted_bytes(self, probe: ProbeT) -> int: ...

    @abstractmethod
    async def charge_and_decode(
        self,
        item: LoadedItem,
        probe: ProbeT,
        open_input: Callable[[], MemoryInput],
        account: RequestAccount,
        control: DecodeControl,
        keep: Keep,
    ) -> None:
        """Charge what `probe` predicts, then decode as configured (`open_input()`: a new file object)."""

    def plan(self, ref: MediaRef, keep: Keep, *, sole: bool) -> ItemPlan:
        return ItemPlan(ref, keep, sole)

    async def predict(self, plan: ItemPlan) -> tuple[int, ItemPlan]:
        ref = plan.ref
        control = DecodeControl(self.rules.decode_timeout_s)

        def read() -> int:
            # The header is read from the base64 itself, as `load_inline` reads the container.
            return self.predicted_bytes(self.probe(inline_input(ref, control), ref.locator, control, plan.keep))

        return await self.worker.run(ref.locator, read, control=control), plan

    async def load(self, item: LoadedItem, plan: ItemPlan, data: bytes, account: RequestAccount) -> None:
        await self._load(item, plan, functools.partial(MemoryInput, data), account)

    async def load_inline(self, item: LoadedItem, plan: ItemPlan, account: RequestAccount) -> None:
        # Every character is checked before the container reads any (a range it never reads would pass unchecked).
        item.encoded_bytes = await checked_inline_size(item.ref, self.worker)
        await self._load(item, plan, functools.partial(inline_input, item.ref), account)

    async def _load(
        self,
        item: LoadedItem,
        plan: ItemPlan,
        open_input: Callable[[DecodeControl], MemoryInput],
        account: RequestAccount,
    ) -> None:
        locator = item.ref.locator
        control = DecodeControl(self.rules.decode_timeout_s)
        read = functools.partial(self.probe, open_input(control), locator, control, plan.keep)
        probe = await self.worker.run(locator, read, control=control)
        item.predicted_bytes = self.predicted_bytes(probe)
        self._predicted_bytes.observe(item.predicted_bytes)
        await self.charge_and_decode(item, probe, functools.partial(open_input, control), account, control, plan.keep)

    async def timed_decode(self, locator: str, decode: Callable[[], T], control: DecodeControl) -> T:
        """`decode()` on a media thread, its time observed in `mmgate_media_decode_seconds`."""
        started = time.perf_counter()
        result = await self.worker.run(locator, decode, control=control)
        self._decode_seconds.observe(time.perf_counter() - started)
        return result
