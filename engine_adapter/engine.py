"""The engine: admission, the request table, the runtime loop and the hand-off, behind the internal HTTP API.

Buffer lifetime. A request's embedding buffer is allocated (and charged to `encoder.max_resident_bytes`) when
its first item is scheduled, and released on exactly one of these paths, whichever comes first:
the hand-off backend's first response byte; a failure (encoder error, backend unreachable); a cancel
(`DELETE`, the `/response` caller disconnecting, nobody claiming the response within
`server.response_claim_timeout_s`, shut-down). Its encoder inputs (uint8 patch rows, bounded by
`encoder.max_pending_input_bytes`) are freed when it is fully encoded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from encoder_scheduler import AdmissionError, EncoderBudget, EncoderCache, EncoderScheduler, SchedulingPolicy
from engine_adapter.config import BackendKind, EmbedsFormat, EngineSettings
from engine_adapter.encoder import VisionEncoder
from engine_adapter.errors import (
    BadRequest,
    Conflict,
    EngineError,
    Gone,
    InternalError,
    NotFound,
    TooLarge,
    TooManyRequests,
    Unavailable,
)
from engine_adapter.handoff import BackendResponse, Handoff, HandoffBackend, check_handoff, dtype_name
from engine_adapter.intake import Intake, read_submit
from engine_adapter.jobs import Job, JobState, Tombstones
from engine_adapter.metrics import EngineMetrics
from engine_adapter.openai_backend import OpenAIBackend, pixel_parts
from engine_adapter.reference import ReferenceBackend
from engine_adapter.runtime import EncoderRuntime, IterationHook

logger = logging.getLogger("mmgate.engine")

INTAKE_WORKERS = min(4, os.cpu_count() or 1)


# Why each hand-off form carries no video embeddings.
_NO_VIDEO_EMBEDS = {
    EmbedsFormat.VLLM: (
        "the vLLM releases this form is built for take no video embeddings part in their chat API (a video_embeds "
        "part exists only in vLLM's newest sources, untested with mmgate)"
    ),
    EmbedsFormat.TRTLLM: "trtllm-serve's chat API takes no video embeddings part (it has image_embeds only)",
}


def make_backend(settings: EngineSettings, deepstack_layers: int = 0) -> HandoffBackend:
    if settings.handoff.backend is BackendKind.OPENAI:
        return OpenAIBackend(settings.handoff)
    return ReferenceBackend(deepstack_layers)


class Engine:
    def __init__(self, settings: EngineSettings, *, on_iteration: IterationHook | None = None) -> None:
        self.settings = settings
        self.metrics = EngineMetrics()
        self.encoder = VisionEncoder(settings.model)
        encoder = settings.encoder
        limit = encoder.max_resident_bytes
        budget = EncoderBudget(encoder.max_num_items, encoder.max_num_tokens, None if limit is None else int(limit))
        cache = EncoderCache(int(encoder.cache_max_bytes)) if encoder.cache_max_bytes else None
        self.scheduler = EncoderScheduler(budget, encoder.scheduling_policy, cache, device=self.encoder.device)
        encoded = self.encoder
        check_handoff(settings.handoff, encoded.width, encoded.dtype, encoded.geometry.name, encoded.config.name)
        self.backend = make_backend(settings, len(encoded.config.deepstack_visual_indexes))
        self.runtime = EncoderRuntime(
            self.scheduler,
            self.encoder,
            free_consumer_slots=self._free_consumer_slots,
            on_ready=self._on_ready,
            on_failed=self._on_failed,
            metrics=self.metrics,
            on_iteration=on_iteration,
        )
        self.metrics.bind(
            resident=lambda: self.scheduler.resident_bytes,
            budget=self._enforced_budget,
            queued=lambda: self.scheduler.num_waiting,
            pending_inputs=lambda: self.runtime.pending_input_bytes,
        )
        self.jobs: dict[str, Job] = {}
        self.tombstones = Tombstones()
        # Hand-offs in flight: from take until the response is relayed, fails or is dropped.
        self._inflight: set[str] = set()
        # Requests the backend gets as pixels: job id -> one PNG data URL per item, until the hand-off.
        self._images: dict[str, tuple[str, ...]] = {}
        self.pixel_fallbacks = 0
        self._background: set[asyncio.Task[None]] = set()
        self._intake = ThreadPoolExecutor(INTAKE_WORKERS, thread_name_prefix="mmgate-intake")
        self.draining = False

    # ----------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.runtime.start()
        settings = self.settings
        encoder = settings.encoder
        logger.info(
            "engine: policy %s, %d items / %d tokens per iteration, resident budget %s, hand-off %s%s "
            "(max_concurrency %d)",
            encoder.scheduling_policy.value,
            encoder.max_num_items,
            encoder.max_num_tokens,
            "off" if encoder.max_resident_bytes is None else f"{encoder.max_resident_bytes:,} bytes",
            settings.handoff.backend.value,
            f" {settings.handoff.base_url} ({settings.handoff.format.value})" if settings.handoff.url else "",
            settings.handoff.max_concurrency,
        )

    def start_draining(self) -> None:
        """From now on submits get 503; admitted requests still finish."""
        self.draining = True

    async def aclose(self) -> None:
        self.draining = True
        await self.runtime.stop()
        jobs = list(self.jobs.values())
        for job in jobs:
            self.cancel(job, "the engine is shutting down")
        pending = [job.handoff_task for job in jobs if job.handoff_task is not None]
        await asyncio.gather(*pending, *self._background, return_exceptions=True)
        await self.backend.aclose()
        self._intake.shutdown(wait=False, cancel_futures=True)
        self.encoder.close()

    # ---------------------------------------------------------------------------------------- admission

    def count_rejection(self, reason: str) -> None:
        """Count a refused submit under `reason` (mmgate_engine_admission_rejections_total); refuses nothing itself."""
        self.metrics.admission_rejections.labels(reason).inc()

    async def submit(self, body: bytes) -> Job:
        """Admit a submit file; returns its job as soon as the scheduler accepted it."""
        if self.draining:
            self.count_rejection("draining")
            raise Unavailable("the engine is draining (shutting down) and admits no new requests")
        loop = asyncio.get_running_loop()
        try:
            intake = await loop.run_in_executor(self._intake, read_submit, body, self.encoder)
        except BadRequest as error:
            self.count_rejection(error.reason)
            raise
        if self.draining:
            self.count_rejection("draining")
            raise Unavailable("the engine is draining (shutting down) and admits no new requests")
        self._check_supported(intake)
        self._check_pending_inputs(intake)
        images = None
        if self.backend.sends_pixels(intake.items, self.encoder.geometry.merge_size):
            images = await loop.run_in_executor(self._intake, pixel_parts, body)
        job_id = uuid.uuid4().hex
        request = intake.encoder_request(job_id, self.encoder.width, self.encoder.dtype)
        try:
            self.runtime.submit(request, intake.inputs, intake.input_bytes)
        except AdmissionError as exc:
            self.count_rejection("max_resident_bytes")
            raise TooLarge(
                f"request {intake.request_id}: its embeddings need {exc.required:,} bytes ({request.total_rows:,} rows "
                f"x {request.embedding_width:,} x {_dtype_name(request.dtype)}), over "
                f"{exc.knob}={exc.limit:,}: it could never be encoded",
                reason="max_resident_bytes",
            ) from None
        job = Job(job_id, intake.request_id, intake.document, intake.items)
        self.jobs[job_id] = job
        if images is not None:
            self._images[job_id] = images
            self.pixel_fallbacks += 1
            self.metrics.handoff_pixel_fallbacks.inc()
        timeout = self.settings.server.response_claim_timeout_s
        job.claim_timer = loop.call_later(timeout, self._claim_expired, job)
        return job

    def _check_supported(self, intake: Intake) -> None:
        """The `openai` hand-off sends image embeddings only: a request with a video is refused here, before its
        items are encoded."""
        handoff = self.settings.handoff
        if handoff.backend is not BackendKind.OPENAI:
            return
        for index, item in enumerate(intake.items):
            if item.modality != "image":
                self.count_rejection("unsupported")
                raise BadRequest(
                    f"request {intake.request_id}: item {index} ({item.locator}) is a {item.modality}, but "
                    f"handoff.backend=openai with handoff.format={handoff.format.value} forwards image embeddings "
                    f"only: {_NO_VIDEO_EMBEDS[handoff.format]}",
                    reason="unsupported",
                )

    def _check_pending_inputs(self, intake: Intake) -> None:
        cap = self.settings.encoder.max_pending_input_bytes
        if cap is None:
            return
        pending = self.runtime.pending_input_bytes
        if intake.input_bytes > cap:
            self.count_rejection("max_pending_input_bytes")
            raise TooLarge(
                f"request {intake.request_id}: its encoder inputs take {intake.input_bytes:,} bytes, over "
                f"encoder.max_pending_input_bytes={cap:,}: it could never be queued",
                reason="max_pending_input_bytes",
            )
        if pending + intake.input_bytes > cap:
            self.count_rejection("max_pending_input_bytes")
            raise TooManyRequests(
                f"request {intake.request_id}: queued requests hold {pending:,} bytes of encoder inputs; its "
                f"{intake.input_bytes:,} more would pass encoder.max_pending_input_bytes={cap:,}",
                reason="max_pending_input_bytes",
            )

    # ------------------------------------------------------------------------------------------ hand-off

    def _free_consumer_slots(self) -> int:
        return self.settings.handoff.max_concurrency - len(self._inflight)

    def _on_ready(self, job_id: str, buffer: torch.Tensor, offsets: tuple[int, ...]) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.finished:
            self.runtime.release(job_id)
            return
        job.embeddings, job.offsets = buffer, offsets
        job.state = JobState.HANDING_OFF
        job.settled.set()
        self._inflight.add(job_id)
        job.handoff_task = asyncio.create_task(self._handoff(job), name=f"mmgate-handoff-{job_id}")

    def _on_failed(self, job_id: str, error: EngineError) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            self._settle(job, error)

    async def _handoff(self, job: Job) -> None:
        assert job.embeddings is not None
        images = self._images.pop(job.id, None)
        handoff = Handoff(job.id, job.request_id, job.document, job.items, job.embeddings, job.offsets, images)
        result: BackendResponse | EngineError
        try:
            result = await self.backend.start(handoff)
        except EngineError as error:
            logger.warning("request %s (%s): hand-off failed: %s", job.request_id, job.id, error.message)
            result = error
        except Exception as exc:
            logger.exception("request %s (%s): hand-off failed", job.request_id, job.id)
            result = InternalError(f"hand-off of request {job.request_id} failed: {type(exc).__name__}: {exc}")
        finally:
            # The backend's first response byte (or its failure): the buffer's job is done.
            del handoff
            self._release_buffer(job)
        if job.finished:  # cancelled while the backend was answering
            if isinstance(result, BackendResponse):
                await result.aclose()
            return
        self._settle(job, result)

    def _release_buffer(self, job: Job) -> None:
        job.embeddings = None
        self.runtime.release(job.id)

    def _settle(self, job: Job, result: BackendResponse | EngineError) -> None:
        job.state = JobState.ANSWERED
        job.settled.set()
        if not job.outcome.done():
            job.outcome.set_result(result)
        if isinstance(result, EngineError):
            # No answer will stream: the consumer slot is free now.
            self._inflight.discard(job.id)
            self.runtime.wake()

    # ---------------------------------------------------------------------------------------- the calls

    def lookup(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        why = self.tombstones.get(job_id)
        if why is not None:
            # A caller that comes after the cancel learns the same reason as one that was already waiting.
            raise Gone(
                f"request {job_id} is gone: {why}", reason="cancelled" if why.startswith("cancelled") else "gone"
            )
        raise NotFound(f"no request {job_id} on this engine")

    def claim(self, job_id: str) -> Job:
        """Take the one right to read a request's response."""
        job = self.lookup(job_id)
        if job.claimed:
            raise Conflict(f"the response of request {job_id} is already claimed; only one caller may read it")
        job.claimed = True
        if job.claim_timer is not None:
            job.claim_timer.cancel()
            job.claim_timer = None
        return job

    async def embeddings(self, job: Job) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The request's buffer once ready, while it exists (Gone after its release)."""
        await job.settled.wait()
        tensor = job.embeddings
        if tensor is None:
            why = "cancelled" if job.finished else "released at the hand-off backend's first response byte, or failed"
            raise Gone(f"request {job.id}: its embedding buffer no longer exists ({why})")
        return tensor, job.offsets

    def cancel(self, job: Job, reason: str) -> int:
        """Cancel a request in any state and free its buffer now; returns the bytes freed. Idempotent."""
        if job.finished:
            return 0
        freed = self.runtime.release(job.id)
        job.embeddings = None
        task = job.handoff_task
        if task is not None and not task.done():
            task.cancel()
        if not job.outcome.done():
            message = f"request {job.request_id} ({job.id}) was cancelled: {reason}"
            job.outcome.set_result(Gone(message, reason="cancelled"))
        else:
            result = job.outcome.result()
            if isinstance(result, BackendResponse):
                self._spawn(result.aclose())
        job.settled.set()
        self._finish(job, f"cancelled: {reason}")
        logger.info("request %s (%s) cancelled (%s); %s bytes freed", job.request_id, job.id, reason, f"{freed:,}")
        return freed

    def finish(self, job: Job, outcome: str) -> None:
        """The response was relayed (or its error answered): forget the request."""
        self._finish(job, outcome)

    def _finish(self, job: Job, outcome: str) -> None:
        if job.finished:
            return
        job.finished = True
        if job.claim_timer is not None:
            job.claim_timer.cancel()
            job.claim_timer = None
        self.jobs.pop(job.id, None)
        self._images.pop(job.id, None)
        self.tombstones.add(job.id, outcome)
        self._inflight.discard(job.id)
        self.runtime.wake()

    def _claim_expired(self, job: Job) -> None:
        if not job.claimed and not job.finished:
            timeout = self.settings.server.response_claim_timeout_s
            self.cancel(job, f"nobody claimed its response within server.response_claim_timeout_s={timeout:g}")

    def _spawn(self, coroutine: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -------------------------------------------------------------------------------------------- status

    def _enforced_budget(self) -> float:
        limit = self.scheduler.budget.max_resident_bytes
        if limit is None or self.scheduler.policy is SchedulingPolicy.DISABLED:
            return math.inf
        return float(limit)

    def status(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        settings = self.settings
        encoder = self.encoder
        cache = self.scheduler.cache
        return {
            "draining": self.draining,
            "policy": self.scheduler.policy.value,
            "budgets": {
                "max_num_items": stats.max_num_items,
                "max_num_tokens": stats.max_num_tokens,
                "effective_max_num_tokens": stats.effective_max_num_tokens,
                "max_resident_bytes": stats.max_resident_bytes,
                "max_resident_bytes_enforced": self.scheduler.policy is not SchedulingPolicy.DISABLED,
                "max_pending_input_bytes": settings.encoder.max_pending_input_bytes,
            },
            "resident_bytes": stats.resident_bytes,
            "pending_input_bytes": self.runtime.pending_input_bytes,
            "queue": {
                "waiting": stats.waiting_requests,
                "running": stats.running_requests,
                "ready": stats.ready_requests,
                "taken": stats.taken_requests,
                "live": stats.live_requests,
                "started_not_handed_off": self.runtime.num_started,
            },
            "requests": len(self.jobs),
            "iterations": stats.iterations,
            "items_recorded": stats.items_recorded,
            "model": {
                "preset": encoder.config.name,
                "arch": encoder.config.arch,
                "device": str(encoder.device),
                "dtype": _dtype_name(encoder.dtype),
                "weights": encoder.weights,
                "from_checkpoint": encoder.from_checkpoint,
                "embedding_width": encoder.width,
                "deepstack_visual_indexes": list(encoder.config.deepstack_visual_indexes),
            },
            "processor": {
                "geometry": encoder.geometry.name,
                "min_pixels": encoder.geometry.min_pixels,
                "max_pixels": encoder.geometry.max_pixels,
                "factor": encoder.geometry.factor,
                "patch_size": encoder.geometry.patch_size,
                "merge_size": encoder.geometry.merge_size,
                "temporal_patch_size": encoder.geometry.temporal_patch_size,
                "channels": encoder.geometry.channels,
                "resize": encoder.geometry.resize,
                "video_bounds": encoder.geometry.video_bounds,
                "video_min_pixels": encoder.geometry.video_pixels[0],
                "video_max_pixels": encoder.geometry.video_pixels[1],
            },
            "handoff": {
                "backend": self.backend.name,
                "url": settings.handoff.base_url or None,
                "format": settings.handoff.format.value,
                "max_concurrency": settings.handoff.max_concurrency,
                "in_flight": len(self._inflight),
                "embedding_width": encoder.width,
                "embedding_dtype": _dtype_name(encoder.dtype),
                "expected_hidden_size": settings.handoff.expected_hidden_size,
                "expected_dtype": settings.handoff.expected_dtype,
                "pixel_fallbacks": self.pixel_fallbacks,
            },
            "cache": None
            if cache is None
            else {
                "max_bytes": cache.max_bytes,
                "bytes_used": cache.bytes_used,
                "entries": len(cache),
                "hits": stats.cache_hits,
                "misses": stats.cache_misses,
                "evictions": cache.evictions,
            },
        }


_dtype_name = dtype_name
