"""What one modality's loader is: `probe` an item's header for the bytes it will count, `load` it counted.

`MediaLoader` (gateway/media_loader.py) holds one loader per modality and picks by `MediaRef.modality`; it gets
each item's encoded bytes (a data URL or base64 decoded, a URL downloaded with every byte counted) and hands them
to the modality's `load`. A loader that is also an `InlineReader` (video, audio: PyAV reads a file object) is
handed an inline item without them, and reads it through its base64.
Each loader reads the header first, charges what the header predicts before any decode, then decodes (or, with
`media.decode: header`, does not). Work on the bytes runs on the media threads through `Worker`, or on the
calling thread where it is smaller than the hop (gateway/media_workers.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from gateway.accounting import RequestAccount
from gateway.data_url import decode_base64, split_data_url
from gateway.media_parts import MediaRef, Modality, Source
from gateway.media_workers import run_here, run_on_worker

if TYPE_CHECKING:
    from engine_adapter.client import ImageGeometry, ProcessorGeometry
    from gateway.audio_decode import AudioHeader
    from gateway.image_loader import DecodeControl, ImageHeader
    from gateway.video_decode import VideoHeader

T = TypeVar("T")

# Base64 text decoded on the calling thread rather than on a media thread: pybase64 decodes 64 KiB in a few
# microseconds, less than a hop to a thread costs.
INLINE_BASE64_CHARS = 1 << 16

Keep = Callable[[Any], Any]
"""What a caller keeps of an item's decoded form (engine mode: the model-sized pixels of an image)."""


@runtime_checkable
class KeepResized(Protocol):
    """A `Keep` that resizes each image to a model's geometry (engine mode): the item's loader charges the
    resized pixels it will hold, not the float32 tensors an upstream processor would make. A video's loader
    resizes its sampled frames to the same geometry itself (one size for the clip) and keeps them as one
    uint8 `[t, h, w, 3]` array."""

    @property
    def geometry(self) -> ProcessorGeometry: ...

    def __call__(self, image: Any) -> Any: ...


def resized_to(keep: Keep | None) -> ProcessorGeometry | None:
    """The geometry a `KeepResized` resizes to; None for any other `keep` (or none)."""
    # isinstance against a runtime-checkable Protocol walks its members on every call: None is answered first.
    return keep.geometry if keep is not None and isinstance(keep, KeepResized) else None


@dataclass(slots=True)
class LoadedItem:
    """One item once loaded: what was read from its header and what was counted for it."""

    ref: MediaRef
    encoded_bytes: int
    header: ImageHeader | VideoHeader | AudioHeader | None = None
    predicted_bytes: int = 0
    """What the header predicted (decode plus processed tensors), charged before any decode."""
    processed: ImageGeometry | None = None
    sampled: list[int] = field(default_factory=list)
    """Video: the indices of the frames the model server samples (decoded unless `media.decode: header`)."""
    decoded: int = 0
    """Video: sampled frames decoded; audio: samples decoded (at `media.audio.sample_rate`)."""
    kept: Any = None
    """Engine mode: (uint8 pixels resized for the engine's model, their sha256): `[h, w, 3]` for an image,
    `[t, h, w, 3]` (the decoded sampled frames) for a video."""


class ModalityLoader(Protocol):
    """One modality's loader. Both methods raise the gateway's errors (400/413) naming `ref.locator`."""

    modality: Modality

    async def probe(self, ref: MediaRef, keep: Keep | None = None) -> int:
        """Bytes `load` will count for this inline item (data URL or base64), from its header alone: nothing is
        decoded but the base64 and the container header. `keep`: what `load` will be given."""
        ...

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, keep: Keep | None) -> None:
        """Check `data`'s header, charge what it predicts to `account`, decode as configured, and fill `item`."""
        ...


@runtime_checkable
class InlineReader(Protocol):
    """A loader that reads an inline item through its base64 (gateway/base64_input.py) instead of a decoded copy."""

    async def load_inline(self, item: LoadedItem, account: RequestAccount, keep: Keep | None) -> None:
        """`load` for an inline item (a data URL or base64), every character of it already checked
        (`base64_input.checked_size`): the decode reads only the ranges it needs, decoded as read, so no decoded
        copy of the item is made. `item.ref.value` (a view of the request body, or the parsed document's string)
        holds the text alive while the decode reads it."""
        ...


@dataclass(frozen=True, slots=True)
class Worker:
    """Runs calls on the media threads (`media.load_workers`); see gateway/media_workers.py."""

    executor: ThreadPoolExecutor

    async def run(self, locator: str, call: Callable[[], T], *, control: DecodeControl | None = None) -> T:
        return await run_on_worker(self.executor, locator, call, control=control)

    async def inline_bytes(self, ref: MediaRef) -> bytes:
        """The encoded bytes of an inline item (a data URL or bare base64), decoded on a media thread, or on the
        calling thread when its text is at most `INLINE_BASE64_CHARS` long."""
        if ref.source is Source.DATA_URL:
            decode = functools.partial(decode_data_url, ref.value, ref.locator)
        elif ref.source is Source.BASE64:
            decode = functools.partial(decode_base64, ref.value, ref.locator)
        else:
            raise ValueError(f"{ref.locator}: a {ref.source.value} item has no inline bytes")
        if len(ref.value) <= INLINE_BASE64_CHARS:
            return run_here(ref.locator, decode)
        return await self.run(ref.locator, decode)


class PrepaidCharge:
    """The per-frame charge of a decode running on a media thread, whose predicted bytes were charged to the
    request's account before it started: frames draw from that prepaid amount first; anything past it (a header
    that understated what the stream holds) is charged to the account on the event loop's thread, which owns the
    account, and the decode waits for the answer (so passing the cap stops it before the next frame)."""

    def __init__(self, account: RequestAccount, prepaid: int, what: str) -> None:
        self.account = account
        self.left = prepaid
        self.what = what
        self.extra = 0
        self._loop = asyncio.get_running_loop()

    def __call__(self, nbytes: int) -> None:
        drawn = min(nbytes, self.left)
        self.left -= drawn
        rest = nbytes - drawn
        if rest <= 0:
            return
        answer: Future[None] = Future()

        def charge() -> None:
            try:
                self.account.charge(rest, self.what)
            except BaseException as exc:  # handed to the decode's thread, which raises it
                answer.set_exception(exc)
            else:
                answer.set_result(None)

        self.extra += rest
        self._loop.call_soon_threadsafe(charge)
        answer.result()


def decode_data_url(value: str | memoryview, locator: str) -> bytes:
    _, payload = split_data_url(value, locator)
    return decode_base64(payload, locator)
