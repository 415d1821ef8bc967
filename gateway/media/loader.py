"""Loading, decoding and counting a request's media items with bounded concurrency (`media.load_workers`).

Each item's route is planned before anything is reserved (`plan`, gateway/media/plan.py), its bytes may be
predicted from its header for the reservation (`predict`), and it is loaded as its plan says by its modality's
loader (`load`): an inline item (a data URL or base64) from the request body, a URL from its download, every byte
counted as it arrives. Passing the per-request cap cancels the items not started and
the open downloads, and stops the decodes running on a thread at their next chunk of input. Decoded media are
dropped as soon as they are counted unless engine mode keeps them resized, so the gateway's own memory stays
bounded by `media.load_workers` items whatever the request holds. A request with one item loads it in the
request's own task, where small work on it may stay on the event loop's thread (gateway/media/threads.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.config import DecodeMode, FetchForward, GatewaySettings
from gateway.errors import BadRequest
from gateway.media.accounting import RequestAccount
from gateway.media.audio.loader import AudioLoader
from gateway.media.base import ContainerRules, LoadedItem, ModalityLoader
from gateway.media.image.loader import ImageLoader
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.plan import ItemPlan, Keep
from gateway.media.sources.fetch import URL_BLOCKED, MediaFetcher
from gateway.media.threads import Worker
from gateway.media.video.loader import VideoLoader, VideoSampling
from gateway.metrics import Children, GatewayMetrics
from gateway.processors import Processors
from serving.errors import drop_tracebacks

__all__ = ["ItemPlan", "Keep", "LoadedItem", "MediaLoader", "modality_loaders"]

T = TypeVar("T")


def modality_loaders(
    settings: GatewaySettings, metrics: GatewayMetrics, worker: Worker, processors: Processors
) -> dict[Modality, ModalityLoader[Any]]:
    """One loader per modality, configured from `media` and `limits`."""
    media, limits = settings.media, settings.limits
    decode = media.decode is not DecodeMode.HEADER  # video and audio: decoded in check mode as in full
    image = ImageLoader(
        worker=worker,
        metrics=metrics,
        formats=media.formats,
        max_pixels=limits.max_image_pixels,
        decode=media.decode,
        decode_timeout_s=media.decode_timeout_s,
        max_jpeg_scans=media.max_jpeg_scans,
        processors=processors,
        max_metadata_bytes=limits.max_image_metadata_bytes,
    )
    video_rules = ContainerRules(
        media.video_formats, media.video_codecs, limits.max_video_seconds, decode, media.video.decode_timeout_s
    )
    video = VideoLoader(
        worker,
        metrics,
        video_rules,
        max_pixels=limits.max_video_pixels,
        sampling=VideoSampling(
            num_frames=media.video.num_frames, fps=media.video.fps, max_frames=media.video.max_frames
        ),
        processors=processors,
    )
    audio_rules = ContainerRules(
        media.audio_formats, media.audio_codecs, limits.max_audio_seconds, decode, media.audio.decode_timeout_s
    )
    audio = AudioLoader(worker, metrics, audio_rules, sample_rate=media.audio.sample_rate)
    return {loader.modality: loader for loader in (image, video, audio)}


# `mmgate_media_items_total`'s source for a URL item refused before any fetch (scheme, host, SSRF rules).
REFUSED_URL_SOURCE = "url_refused"


class MediaLoader:
    def __init__(
        self,
        *,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        executor: ThreadPoolExecutor,
        processors: Processors | None = None,
        loaders: dict[Modality, ModalityLoader[Any]] | None = None,
    ) -> None:
        """`processors`: whose tensors are charged (default: what `media.processor` names)."""
        self.metrics = metrics
        self.fetcher = fetcher
        self.worker = Worker(executor)
        self.workers = settings.media.load_workers
        self.processors = processors if processors is not None else Processors(settings.media.processor)
        self.loaders = (
            loaders if loaders is not None else modality_loaders(settings, metrics, self.worker, self.processors)
        )
        self.keep = Keep(downloads=settings.media.fetch.forward is FetchForward.INLINE)
        """What a request keeps of its items without an engine (engine mode's: `EngineMode.admit`)."""
        self.media_items = Children(metrics.media_items.labels)

    def plan(self, refs: list[MediaRef], keep: Keep) -> list[ItemPlan]:
        """Each item's route through its load, before anything is reserved; `keep`: what the request keeps."""
        sole = len(refs) == 1
        return [self.loaders[ref.modality].plan(ref, keep, sole=sole) for ref in refs]

    async def predict(self, plans: list[ItemPlan]) -> tuple[int | None, list[ItemPlan]]:
        """Bytes the items will count, from their headers alone (each modality's `predict`), and their plans with
        what the prediction opened for the load to read on; None, and the plans as they were, when an item cannot
        be predicted before it is downloaded (a URL)."""
        if any(plan.ref.source is Source.URL for plan in plans):
            return None, plans
        predicted = await self._each(plans, lambda plan: self.loaders[plan.ref.modality].predict(plan))
        return sum(nbytes for nbytes, _ in predicted), [plan for _, plan in predicted]

    async def load(self, plans: list[ItemPlan], account: RequestAccount) -> list[LoadedItem]:
        """Load every item as its plan says, at most `media.load_workers` at a time, in order of appearance. The
        plans are spent: what a prediction opened has read its whole file, and goes with them."""
        return await self._each(plans, lambda plan: self._load_one(plan, account))

    async def _each(self, plans: list[ItemPlan], call: Callable[[ItemPlan], Awaitable[T]]) -> list[T]:
        """`call(plan)` for every item, at most `media.load_workers` at a time; the results in request order, or
        the first failure in request order, with the other calls cancelled."""
        if len(plans) == 1:
            # The only item: in the caller's task (cancelling the caller cancels it), where its plan may run small
            # work on the event loop's thread (`ItemPlan.sole`).
            return [await call(plans[0])]
        slots = asyncio.Semaphore(self.workers)

        async def one(plan: ItemPlan) -> T:
            async with slots:
                return await call(plan)

        tasks = [asyncio.ensure_future(one(plan)) for plan in plans]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            # The other items' errors are not raised: without their tracebacks, what their frames held (each
            # failed task keeps its error) is freed with the request, not left for the cyclic collector.
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    drop_tracebacks(outcome)

    async def _load_one(self, plan: ItemPlan, account: RequestAccount) -> LoadedItem:
        ref = plan.ref
        loader = self.loaders[ref.modality]
        if ref.source is not Source.URL:
            self.media_items(ref.modality.value, ref.source.value).inc()
            # The caller holds the request body (and the parsed document) until the load ends: the item's text
            # stays alive while the loader reads it.
            item = LoadedItem(ref=ref)
            await loader.load_inline(item, plan, account)
            return item
        url = ref.value if isinstance(ref.value, str) else bytes(ref.value).decode("latin-1")
        source = ref.source.value
        try:
            data = await self.fetcher.fetch(
                url, locator=ref.locator, on_bytes=lambda n: account.charge(n, "downloaded media")
            )
        except BadRequest as exc:
            if exc.reason == URL_BLOCKED:
                source = REFUSED_URL_SOURCE  # never fetched: the URL's checks refused it
            raise
        finally:
            self.media_items(ref.modality.value, source).inc()
        item = LoadedItem(ref=ref, encoded_bytes=len(data))
        await loader.load(item, plan, data, account)
        if plan.keep.downloads:
            # Counted as it downloaded; forwarded in place of the URL.
            item.downloaded = data
        return item
