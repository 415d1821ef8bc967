"""The engine's runtime loop: schedule -> pack -> encode on the encoder thread -> record -> hand off ready requests.

Only this loop and the calls below touch the `EncoderScheduler`, all on the event loop's thread. Per iteration:

1. `plan = scheduler.schedule(max_new_requests=...)`: DEFAULT starts at most the hand-off consumer's free
   capacity (`handoff.max_concurrency` minus hand-offs in flight minus requests started but not handed off);
   EAGER starts ahead of it within the budgets; DISABLED (legacy) starts whole requests up to that capacity.
2. The plan's runs of adjacent items are packed with `batch_encoder_inputs` (one slice of each request-level
   tensor per run) and encoded in one forward pass, both on the encoder thread.
3. The output is split per item and recorded into each request's contiguous buffer; outputs of requests that
   were cancelled meanwhile are dropped.
4. Ready requests are taken (their buffers by reference) and handed to `on_ready`, oldest first, while the
   consumer has a free slot: at most `handoff.max_concurrency` requests are with the LLM server at once.

When a plan has nothing to do the loop sleeps on an event that `submit`, `release` and `wake` set; it never
polls. An encoder exception fails the requests of that batch (`on_failed`, after their buffers are freed)
and the loop keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from encoder_scheduler import (
    EncoderInputField,
    EncoderRequest,
    EncoderScheduler,
    ItemRange,
    RequestInputs,
    SchedulePlan,
    SchedulerStats,
    SchedulingPolicy,
    batch_encoder_inputs,
)
from engine_adapter.encoder import VisionEncoder
from engine_adapter.errors import EngineError, InternalError
from engine_adapter.intake import GRID_KEY, PIXEL_KEY
from engine_adapter.metrics import EngineMetrics

logger = logging.getLogger(__name__)

FIELDS = (EncoderInputField(PIXEL_KEY), EncoderInputField(GRID_KEY))


@dataclass(frozen=True, slots=True)
class IterationReport:
    """What one iteration did, for the invariant hook."""

    plan: SchedulePlan
    stats: SchedulerStats
    encoded_requests: tuple[str, ...]
    """Distinct requests whose items were encoded, in plan order."""
    seconds: float | None
    """Wall time of the pack + forward pass; None when nothing was encoded."""


ReadyCallback = Callable[[str, torch.Tensor, tuple[int, ...]], None]
FailedCallback = Callable[[str, EngineError], None]
IterationHook = Callable[[IterationReport], None]


class EncoderRuntime:
    def __init__(
        self,
        scheduler: EncoderScheduler,
        encoder: VisionEncoder,
        *,
        free_consumer_slots: Callable[[], int],
        on_ready: ReadyCallback,
        on_failed: FailedCallback,
        metrics: EngineMetrics,
        on_iteration: IterationHook | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.encoder = encoder
        self._free_consumer_slots = free_consumer_slots
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._metrics = metrics
        self._on_iteration = on_iteration
        self._inputs: dict[str, RequestInputs] = {}
        self._input_bytes: dict[str, int] = {}
        self._pending_input_bytes = 0
        # Started (buffer allocated) and not yet taken: consumer capacity they will need.
        self._started: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cache_hits = 0
        self._cache_misses = 0

    # ------------------------------------------------------------------------------------------ requests

    @property
    def pending_input_bytes(self) -> int:
        """Bytes of encoder inputs held for requests that are not fully encoded yet."""
        return self._pending_input_bytes

    @property
    def num_started(self) -> int:
        return len(self._started)

    def submit(self, request: EncoderRequest, inputs: RequestInputs, input_bytes: int) -> None:
        """Admit a request (AdmissionError when it can never fit) and wake the loop."""
        self.scheduler.submit(request)
        job_id = request.request_id
        self._inputs[job_id] = inputs
        self._input_bytes[job_id] = input_bytes
        self._pending_input_bytes += input_bytes
        self._wake.set()

    def release(self, job_id: str) -> int:
        """Free a request in any state: its buffer (returns the bytes uncharged) and its inputs."""
        self._drop_inputs(job_id)
        self._started.discard(job_id)
        freed = self.scheduler.release(job_id)
        self._wake.set()
        return freed

    def wake(self) -> None:
        """Consumer capacity was freed: schedule again."""
        self._wake.set()

    def _drop_inputs(self, job_id: str) -> None:
        self._inputs.pop(job_id, None)
        self._pending_input_bytes -= self._input_bytes.pop(job_id, 0)

    # ------------------------------------------------------------------------------------------ the loop

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="mmgate-encoder-runtime")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            # Cleared before scheduling, so a wake-up that arrives during the step is never lost.
            self._wake.clear()
            try:
                progressed = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in this loop must not stop every later request from being served.
                logger.exception("encoder runtime iteration failed")
                progressed = False
            if progressed:
                await asyncio.sleep(0)  # let HTTP handlers in between iterations
            else:
                await self._wake.wait()

    def _max_new_requests(self) -> int | None:
        if self.scheduler.policy is SchedulingPolicy.EAGER:
            return None
        return max(0, self._free_consumer_slots() - len(self._started))

    async def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        scheduler = self.scheduler
        plan = scheduler.schedule(max_new_requests=self._max_new_requests())
        self._started.update(plan.started)
        encoded: tuple[str, ...] = ()
        seconds: float | None = None
        if plan.work:
            encoded = tuple(dict.fromkeys(job_id for job_id, _, _ in plan.runs))
            seconds = await self._encode(plan, encoded)
        self._count_cache()
        # Ready requests go to the consumer only while it has a free slot; under EAGER the others wait here,
        # encoded ahead, their buffers charged.
        ready = scheduler.ready_requests()[: max(0, self._free_consumer_slots())]
        for job_id in ready:
            buffer, offsets = scheduler.take(job_id)
            self._started.discard(job_id)
            self._drop_inputs(job_id)
            self._on_ready(job_id, buffer, offsets)
        stats = scheduler.stats()
        if self._on_iteration is not None:
            self._on_iteration(IterationReport(plan, stats, encoded, seconds))
        return bool(plan.work or plan.started or plan.cache_hits or ready)

    async def _encode(self, plan: SchedulePlan, encoded: tuple[str, ...]) -> float | None:
        entries: list[ItemRange] = []
        for job_id, start, stop in plan.runs:
            inputs = self._inputs.get(job_id)
            if inputs is not None:
                entries.append(inputs.items(start, stop))
        scheduler = self.scheduler
        sizes = [scheduler.request(job_id).items[index].num_embeddings for job_id, index in plan.work]
        started = time.perf_counter()
        try:
            output = await self.encoder.run(partial(self._forward, entries))
            if output.shape[0] != sum(sizes):
                raise RuntimeError(f"the encoder returned {output.shape[0]} rows for items that need {sum(sizes)}")
        except Exception as exc:
            logger.exception("encoder failed on a batch of %d item(s) from %d request(s)", len(plan), len(encoded))
            error = InternalError(
                f"the encoder failed on a batch of {len(plan)} item(s): {type(exc).__name__}: {exc}",
                reason="encoder_error",
            )
            for job_id in encoded:
                if job_id in scheduler:
                    self.release(job_id)
                    self._on_failed(job_id, error)
            return None
        seconds = time.perf_counter() - started
        del entries
        recorded = 0
        for (job_id, index), rows in zip(plan.work, torch.split(output, sizes), strict=True):
            # A request released while its items were encoding: its outputs are dropped.
            if job_id in scheduler:
                scheduler.record(job_id, index, rows)
                recorded += 1
        del output
        metrics = self._metrics
        metrics.iterations.inc()
        metrics.items_encoded.inc(recorded)
        metrics.iteration_seconds.observe(seconds)
        metrics.iteration_tokens.observe(plan.num_tokens)
        return seconds

    def _forward(self, entries: list[ItemRange]) -> torch.Tensor:
        """On the encoder thread: pack the selected runs and encode them in one pass."""
        packed = batch_encoder_inputs(FIELDS, entries)
        return self.encoder.forward(packed[PIXEL_KEY], packed[GRID_KEY])

    def _count_cache(self) -> None:
        hits, misses = self.scheduler.cache_hits, self.scheduler.cache_misses
        if hits > self._cache_hits:
            self._metrics.cache_hits.inc(hits - self._cache_hits)
        if misses > self._cache_misses:
            self._metrics.cache_misses.inc(misses - self._cache_misses)
        self._cache_hits, self._cache_misses = hits, misses
