"""Loading, decoding and counting a request's media items with bounded concurrency.

Each item: its encoded bytes (a data URL or bare base64 decoded on a worker thread, or on the calling thread when
it is short, or a URL downloaded with every byte counted as it arrives), then its modality's loader
(gateway/modality_loader.py): the header first (format and size checks, the predicted decoded bytes and processed
tensors charged before any decode), then the decode itself. An inline video or audio is not decoded into a copy:
every character of its base64 is checked a piece at a time, and the loader reads the container through the base64
(gateway/base64_input.py). Passing the per-request cap cancels the items not started and the open downloads, and
stops the decodes running on a thread at their next chunk of input. Decoded media are dropped as soon as they are
counted unless the caller keeps a derived form of them, so the gateway's own memory stays bounded by
`media.load_workers` items whatever the request holds. A request with one item loads it in the request's own task,
where small work on it may stay on the event loop's thread (gateway/media_workers.py).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from engine_adapter.client import get_geometry
from gateway.accounting import RequestAccount
from gateway.audio_loader import AudioLoader
from gateway.base64_input import checked_size
from gateway.config import DecodeMode, GatewaySettings
from gateway.fetch import MediaFetcher
from gateway.image_item_loader import ImageLoader
from gateway.image_loader import DecodeControl
from gateway.media_parts import MediaRef, Modality, Source
from gateway.media_workers import sole_item
from gateway.metrics import Children, GatewayMetrics
from gateway.modality_loader import InlineReader, Keep, LoadedItem, ModalityLoader, Worker
from gateway.video_loader import VideoLoader, VideoSampling

__all__ = ["KeepPixels", "LoadedItem", "MediaLoader", "modality_loaders"]

KeepPixels = Keep


def modality_loaders(
    settings: GatewaySettings, metrics: GatewayMetrics, worker: Worker
) -> dict[Modality, ModalityLoader]:
    """One loader per modality, configured from `media` and `limits`."""
    media, limits = settings.media, settings.limits
    decode = media.decode is DecodeMode.FULL
    geometry = get_geometry(media.processor) if media.processor else None
    image = ImageLoader(
        worker=worker,
        metrics=metrics,
        formats=media.formats,
        max_pixels=limits.max_image_pixels,
        decode=decode,
        decode_timeout_s=media.decode_timeout_s,
        max_jpeg_scans=media.max_jpeg_scans,
        geometry=geometry,
    )
    video = VideoLoader(
        worker=worker,
        metrics=metrics,
        formats=media.video_formats,
        codecs=media.video_codecs,
        max_pixels=limits.max_video_pixels,
        max_seconds=limits.max_video_seconds,
        sampling=VideoSampling(
            num_frames=media.video.num_frames, fps=media.video.fps, max_frames=media.video.max_frames
        ),
        decode=decode,
        decode_timeout_s=media.video.decode_timeout_s,
        geometry=geometry,
    )
    audio = AudioLoader(
        worker=worker,
        metrics=metrics,
        formats=media.audio_formats,
        codecs=media.audio_codecs,
        max_seconds=limits.max_audio_seconds,
        sample_rate=media.audio.sample_rate,
        decode=decode,
        decode_timeout_s=media.audio.decode_timeout_s,
    )
    return {loader.modality: loader for loader in (image, video, audio)}


class MediaLoader:
    def __init__(
        self,
        *,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        executor: ThreadPoolExecutor,
        loaders: dict[Modality, ModalityLoader] | None = None,
    ) -> None:
        self.metrics = metrics
        self.fetcher = fetcher
        self.worker = Worker(executor)
        self.workers = settings.media.load_workers
        self.loaders = loaders if loaders is not None else modality_loaders(settings, metrics, self.worker)
        self.inline_readers = {
            modality: loader for modality, loader in self.loaders.items() if isinstance(loader, InlineReader)
        }
        self.media_items = Children(metrics.media_items)

    async def load(
        self, refs: list[MediaRef], account: RequestAccount, *, keep: KeepPixels | None = None
    ) -> list[LoadedItem]:
        """Load every item, at most `media.load_workers` at a time, in order of appearance."""
        if len(refs) == 1:
            # The only item: loaded in the caller's task (cancelling the caller cancels it), and small work on it
            # may run on the event loop's thread (gateway/media_workers.py).
            with sole_item():
                return [await self._load_one(refs[0], account, keep)]
        slots = asyncio.Semaphore(self.workers)

        async def one(ref: MediaRef) -> LoadedItem:
            async with slots:
                return await self._load_one(ref, account, keep)

        tasks = [asyncio.ensure_future(one(ref)) for ref in refs]
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

    async def predict(self, refs: list[MediaRef], *, keep: KeepPixels | None = None) -> int | None:
        """Bytes the items will count, from their headers alone (each modality's `probe`); None when an item
        cannot be predicted before it is downloaded (a URL)."""
        if any(ref.source is Source.URL for ref in refs):
            return None
        if len(refs) == 1:
            with sole_item():
                return await self.loaders[refs[0].modality].probe(refs[0], keep)
        slots = asyncio.Semaphore(self.workers)

        async def one(ref: MediaRef) -> int:
            async with slots:
                return await self.loaders[ref.modality].probe(ref, keep)

        tasks = [asyncio.ensure_future(one(ref)) for ref in refs]
        try:
            return sum(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _load_one(self, ref: MediaRef, account: RequestAccount, keep: KeepPixels | None) -> LoadedItem:
        self.media_items(ref.modality.value, ref.source.value).inc()
        reader = self.inline_readers.get(ref.modality) if ref.source is not Source.URL else None
        if reader is not None:
            # The base64 (a view of the request body, or the parsed document's string; the caller holds both
            # until the load ends) is checked whole a piece at a time, then read through, never decoded into
            # a copy of the item.
            control = DecodeControl(None)  # a client that leaves stops the check at its next piece
            size = await self.worker.run(ref.locator, functools.partial(checked_size, ref, control), control=control)
            item = LoadedItem(ref=ref, encoded_bytes=size)
            await reader.load_inline(item, account, keep)
            return item
        data = await self._encoded(ref, account)
        item = LoadedItem(ref=ref, encoded_bytes=len(data))
        await self.loaders[ref.modality].load(item, data, account, keep)
        return item

    async def _encoded(self, ref: MediaRef, account: RequestAccount) -> bytes:
        if ref.source is Source.URL:
            url = ref.value if isinstance(ref.value, str) else bytes(ref.value).decode("latin-1")
            return await self.fetcher.fetch(
                url, locator=ref.locator, on_bytes=lambda n: account.charge(n, "downloaded media")
            )
        return await self.worker.inline_bytes(ref)
