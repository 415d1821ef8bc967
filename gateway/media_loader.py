"""Loading, decoding and counting a request's media items with bounded concurrency.

Each item: its encoded bytes (a data URL or bare base64 decoded on a worker thread, or a URL downloaded with
every byte counted as it arrives), then its header (format and pixel checks, the predicted decoded bytes and the
processed tensors charged before any decode), then the decode itself. Passing the per-request cap cancels the
items not started and the open downloads; decodes already running on a thread finish and are dropped. The
decoded pixels are dropped as soon as they are counted unless the caller asks to keep a derived form of them, so
the gateway's own memory stays bounded by `media.load_workers` items whatever the request holds.

Loaders are per modality: images are decoded here; video and audio are counted by their encoded bytes until
their decoders (PyAV) arrive.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from PIL import Image

from engine_adapter.client import ImageGeometry, ProcessorGeometry, get_geometry, image_geometry
from gateway.accounting import RequestAccount
from gateway.config import DecodeMode, GatewaySettings
from gateway.data_url import decode_base64, split_data_url
from gateway.errors import BadRequest
from gateway.fetch import MediaFetcher
from gateway.image_loader import DecodeControl, ImageHeader, decode_rgb, pil_formats, read_header
from gateway.media_parts import MediaRef, Modality, Source
from gateway.media_workers import run_on_worker
from gateway.metrics import GatewayMetrics

T = TypeVar("T")

KeepPixels = Callable[[Image.Image], Any]


@dataclass(slots=True)
class LoadedItem:
    ref: MediaRef
    encoded_bytes: int
    header: ImageHeader | None = None
    processed: ImageGeometry | None = None
    kept: Any = None


class MediaLoader:
    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.metrics = metrics
        self.fetcher = fetcher
        self.executor = executor
        self.workers = settings.media.load_workers
        self.formats = pil_formats(settings.media.formats)
        self.max_pixels = settings.limits.max_image_pixels
        self.decode_full = settings.media.decode is DecodeMode.FULL
        self.decode_timeout_s = settings.media.decode_timeout_s
        self.max_jpeg_scans = settings.media.max_jpeg_scans
        self.geometry: ProcessorGeometry | None = (
            get_geometry(settings.media.processor) if settings.media.processor else None
        )

    async def load(
        self, refs: list[MediaRef], account: RequestAccount, *, keep: KeepPixels | None = None
    ) -> list[LoadedItem]:
        """Load every item, at most `media.load_workers` at a time, in order of appearance."""
        slots = asyncio.Semaphore(self.workers)
        tasks = [asyncio.ensure_future(self._load_one(ref, account, slots, keep)) for ref in refs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:  # report the first failure in request order
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def predict(self, refs: list[MediaRef]) -> int | None:
        """Bytes the items will count, from their headers alone; None when an item cannot be predicted
        before it is downloaded (a URL) or decoded (video, audio)."""
        if any(ref.source is Source.URL or ref.modality is not Modality.IMAGE for ref in refs):
            return None
        slots = asyncio.Semaphore(self.workers)

        async def one(ref: MediaRef) -> int:
            async with slots:
                header = await self._run(
                    ref.locator, functools.partial(_header_from_prefix, ref, self.formats, self.max_pixels)
                )
            processed = 0
            if self.geometry is not None:
                processed = self._processed(header, ref.locator).processed_bytes
            return header.decode_bytes + processed

        return sum(await asyncio.gather(*(one(ref) for ref in refs)))

    async def _load_one(
        self, ref: MediaRef, account: RequestAccount, slots: asyncio.Semaphore, keep: KeepPixels | None
    ) -> LoadedItem:
        async with slots:
            self.metrics.media_items.labels(ref.modality.value, ref.source.value).inc()
            data = await self._encoded(ref, account)
            item = LoadedItem(ref=ref, encoded_bytes=len(data))
            if ref.modality is Modality.IMAGE:
                await self._image(item, data, account, keep)
            else:
                # No decoder for this modality yet: its encoded bytes are what the gateway can count.
                account.charge(len(data), f"{ref.modality.value} data")
            return item

    async def _encoded(self, ref: MediaRef, account: RequestAccount) -> bytes:
        if ref.source is Source.URL:
            url = ref.value if isinstance(ref.value, str) else bytes(ref.value).decode("latin-1")
            return await self.fetcher.fetch(
                url, locator=ref.locator, on_bytes=lambda n: account.charge(n, "downloaded media")
            )
        if ref.source is Source.DATA_URL:
            return await self._run(ref.locator, functools.partial(_decode_data_url, ref.value, ref.locator))
        return await self._run(ref.locator, functools.partial(decode_base64, ref.value, ref.locator))

    async def _image(self, item: LoadedItem, data: bytes, account: RequestAccount, keep: KeepPixels | None) -> None:
        locator = item.ref.locator
        header = await self._run(
            locator,
            functools.partial(read_header, data, formats=self.formats, max_pixels=self.max_pixels, locator=locator),
        )
        item.header = header
        # Charged before the decode starts: an item that would pass the cap is refused undecoded.
        account.charge(header.decode_bytes, "decoded media")
        if self.geometry is not None:
            item.processed = self._processed(header, locator)
            account.charge(item.processed.processed_bytes, f"processed tensors (media.processor={self.geometry.name})")
        if not (self.decode_full or keep is not None):
            return
        control = DecodeControl(self.decode_timeout_s)
        decode = functools.partial(
            _decode_and_keep, data, self.formats, locator, keep, control=control, max_jpeg_scans=self.max_jpeg_scans
        )
        started = time.perf_counter()
        image, kept = await self._run(locator, decode, control=control)
        self.metrics.media_decode_seconds.labels("image").observe(time.perf_counter() - started)
        account.settle(header.decode_bytes, image)
        if kept is not None:
            account.count_storage(kept)
            item.kept = kept

    def _processed(self, header: ImageHeader, locator: str) -> ImageGeometry:
        assert self.geometry is not None
        try:
            return image_geometry(header.height, header.width, self.geometry)
        except ValueError as exc:  # AspectRatioError among them
            raise BadRequest(
                f"{locator}: {exc} (media.processor={self.geometry.name})", reason="bad_media_geometry"
            ) from None

    async def _run(self, locator: str, call: Callable[[], T], *, control: DecodeControl | None = None) -> T:
        return await run_on_worker(self.executor, locator, call, control=control)


def _decode_data_url(value: str | memoryview, locator: str) -> bytes:
    _, payload = split_data_url(value, locator)
    return decode_base64(payload, locator)


# Base64 characters decoded to read a header without decoding the whole item (a multiple of 4).
_HEADER_PREFIX_CHARS = 1 << 16


def _header_from_prefix(ref: MediaRef, formats: tuple[str, ...], max_pixels: int | None) -> ImageHeader:
    payload = split_data_url(ref.value, ref.locator)[1] if ref.source is Source.DATA_URL else ref.value
    if len(payload) > _HEADER_PREFIX_CHARS:
        try:
            prefix = decode_base64(payload[:_HEADER_PREFIX_CHARS], ref.locator)
            return read_header(prefix, formats=formats, max_pixels=max_pixels, locator=ref.locator)
        except BadRequest:
            pass  # the header runs past the prefix (a large EXIF block, say): read the whole item
    data = decode_base64(payload, ref.locator)
    return read_header(data, formats=formats, max_pixels=max_pixels, locator=ref.locator)


def _decode_and_keep(
    data: bytes,
    formats: tuple[str, ...],
    locator: str,
    keep: KeepPixels | None,
    *,
    control: DecodeControl,
    max_jpeg_scans: int | None,
) -> tuple[Image.Image, Any]:
    image = decode_rgb(data, formats=formats, locator=locator, control=control, max_jpeg_scans=max_jpeg_scans)
    return image, keep(image) if keep is not None else None
