"""Budgeted FCFS scheduling of atomic encoder items into contiguous per-request buffers."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from encoder_scheduler.budget import EncoderBudget
from encoder_scheduler.buffers import RequestBuffer
from encoder_scheduler.cache import EncoderCache, EncoderCacheKey
from encoder_scheduler.errors import AdmissionError, UnknownRequestError
from encoder_scheduler.items import EncoderRequest
from encoder_scheduler.plan import SchedulePlan
from encoder_scheduler.policy import SchedulingPolicy
from encoder_scheduler.progress import RequestProgress

logger = logging.getLogger(__name__)

_UNBOUNDED = sys.maxsize


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's gauges and counters (for metrics and status pages)."""

    waiting_requests: int
    running_requests: int
    ready_requests: int
    taken_requests: int
    live_requests: int
    resident_bytes: int
    max_resident_bytes: int | None
    max_num_items: int
    max_num_tokens: int
    effective_max_num_tokens: int
    iterations: int
    items_scheduled: int
    items_recorded: int
    cache_hits: int
    cache_misses: int
    admission_rejections: int


class _Live:
    """Mutable progress of one admitted request; metadata comes precomputed from its EncoderRequest."""

    __slots__ = (
        "buffer",
        "charged",
        "keys",
        "nbytes",
        "next_item",
        "request",
        "request_id",
        "taken",
        "tokens",
    )

    def __init__(self, request: EncoderRequest, keys: tuple[EncoderCacheKey | None, ...] | None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.tokens = request.item_tokens
        self.keys = keys
        self.nbytes = request.footprint_bytes
        self.buffer: RequestBuffer | None = None
        self.charged = False
        self.taken = False
        # Items before next_item have been scheduled (encoding, recorded, or resolved from the cache).
        self.next_item = 0


class _Pass:
    """What one `schedule` call has selected so far and the budget it has left."""

    __slots__ = (
        "hits",
        "items_left",
        "num_tokens",
        "ready",
        "runs",
        "started",
        "token_budget",
        "tokens_left",
        "work",
    )

    def __init__(self, items_left: int, tokens_left: int, token_budget: int | None) -> None:
        self.items_left = items_left
        self.tokens_left = tokens_left
        self.token_budget = token_budget
        self.num_tokens = 0
        self.work: list[tuple[str, int]] = []
        self.runs: list[tuple[str, int, int]] = []
        self.hits: list[tuple[str, int]] = []
        self.started: list[str] = []
        self.ready: list[str] = []


class EncoderScheduler:
    """Selects, each iteration, which encoder items to run, and owns the requests' output buffers.

    Engine loop::

        plan = sched.schedule(max_new_requests=free_consumer_slots)
        # encode the items in `plan` (pack their inputs with batch_encoder_inputs), then per item:
        sched.record(request_id, item_index, output)      # True when the request became ready
        # hand off every request in sched.ready_requests() (plan.ready lists those completed by cache hits):
        buffer, offsets = sched.take(request_id)          # by reference, no copy
        sched.release(request_id)                         # when the consumer is done; frees the bytes

    Rules. Per iteration at most ``max_num_items`` items and ``max_num_tokens`` tokens are encoded, and an
    item is selected only if both budgets can pay its whole cost; an item above ``max_num_tokens`` runs alone
    in an iteration that has nothing else to encode (the token budget is raised to it, with one warning).
    Started requests continue first, oldest first, each in prompt order; waiting requests then start strictly
    FCFS: when the head cannot start (consumer capacity, resident bytes, or budget for its first item), the
    rest wait too. Starting a request allocates its whole buffer and charges all of its bytes, so a started
    request always finishes without new bytes, and resident bytes never exceed ``max_resident_bytes``.

    Cache. With an `EncoderCache`, each keyed item is looked up exactly once, when it is selected (the budget
    could pay for it): a hit is copied into the request's buffer during `schedule`, costs no item or token
    budget, appears in ``plan.cache_hits`` and never in the work list; a miss is encoded, and `record` stores
    a copy in the cache. Items without a content hash are never looked up. Counters: `cache_hits`,
    `cache_misses`.

    Not thread-safe: call it from one thread (the engine's event loop).
    """

    def __init__(
        self,
        budget: EncoderBudget,
        policy: SchedulingPolicy = SchedulingPolicy.DEFAULT,
        cache: EncoderCache | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self._budget = budget
        self._policy = SchedulingPolicy(policy)
        self._cache = cache
        self._device = device
        self._effective_max_num_tokens = budget.max_num_tokens
        # Insertion order is the order that matters: submit order, start order, readiness order.
        self._live: dict[str, _Live] = {}
        self._waiting: dict[str, _Live] = {}
        self._active: dict[str, _Live] = {}
        self._ready: dict[str, _Live] = {}
        self._resident_bytes = 0
        self._num_taken = 0
        self._iterations = 0
        self._items_scheduled = 0
        self._items_recorded = 0
        self._cache_hits = 0
        self._cache_misses = 0
        self._admission_rejections = 0

    # ------------------------------------------------------------------------------------------- properties

    @property
    def budget(self) -> EncoderBudget:
        return self._budget

    @property
    def policy(self) -> SchedulingPolicy:
        return self._policy

    @property
    def cache(self) -> EncoderCache | None:
        return self._cache

    @property
    def resident_bytes(self) -> int:
        """Bytes of the buffers of all started, not yet released requests (taken ones included)."""
        return self._resident_bytes

    @property
    def effective_max_num_tokens(self) -> int:
        """``max_num_tokens``, raised to the largest item admitted so far that exceeds it."""
        return self._effective_max_num_tokens

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not started (the queue)."""
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        """Requests admitted and not released, in any state."""
        return len(self._live)

    @property
    def cache_hits(self) -> int:
        return self._cache_hits

    @property
    def cache_misses(self) -> int:
        return self._cache_misses

    def stats(self) -> SchedulerStats:
        waiting = len(self._waiting)
        ready = len(self._ready)
        return SchedulerStats(
            waiting_requests=waiting,
            running_requests=len(self._live) - waiting - ready - self._num_taken,
            ready_requests=ready,
            taken_requests=self._num_taken,
            live_requests=len(self._live),
            resident_bytes=self._resident_bytes,
            max_resident_bytes=self._budget.max_resident_bytes,
            max_num_items=self._budget.max_num_items,
            max_num_tokens=self._budget.max_num_tokens,
            effective_max_num_tokens=self._effective_max_num_tokens,
            iterations=self._iterations,
            items_scheduled=self._items_scheduled,
            items_recorded=self._items_recorded,
            cache_hits=self._cache_hits,
            cache_misses=self._cache_misses,
            admission_rejections=self._admission_rejections,
        )

    # ---------------------------------------------------------------------------------------------- lookups

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def request(self, request_id: str) -> EncoderRequest:
        return self._get(request_id).request

    def progress(self, request_id: str) -> RequestProgress | None:
        """The request's progress, or None when it is not live."""
        live = self._live.get(request_id)
        if live is None:
            return None
        if live.taken:
            return RequestProgress.TAKEN
        if live.buffer is None:
            return RequestProgress.PENDING
        return RequestProgress.READY if live.buffer.complete else RequestProgress.PARTIAL

    def is_ready(self, request_id: str) -> bool:
        """True when every item is recorded and the buffer has not been taken yet."""
        return request_id in self._ready

    def ready_requests(self) -> tuple[str, ...]:
        """Ready, not yet taken requests, in the order they became ready."""
        return tuple(self._ready)

    def waiting_requests(self) -> tuple[str, ...]:
        """Requests not started yet, in FCFS order."""
        return tuple(self._waiting)

    # ------------------------------------------------------------------------------------------- lifecycle

    def submit(self, request: EncoderRequest) -> None:
        """Admit a request to the FCFS queue.

        Raises AdmissionError (naming ``encoder.max_resident_bytes``) when the request's buffer alone exceeds
        the resident budget, since it could never start; under DISABLED nothing is refused.
        """
        if not isinstance(request, EncoderRequest):
            raise TypeError(f"submit() takes an EncoderRequest, got {type(request).__name__}")
        request_id = request.request_id
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already live")
        if self._policy is not SchedulingPolicy.DISABLED:
            limit = self._budget.max_resident_bytes
            if limit is not None and request.footprint_bytes > limit:
                self._admission_rejections += 1
                raise AdmissionError(
                    f"request {request_id}: its encoder output needs {request.footprint_bytes:,} bytes "
                    f"({request.total_rows:,} rows x {request.embedding_width:,} x {request.dtype}), "
                    f"over encoder.max_resident_bytes={limit:,}",
                    knob="encoder.max_resident_bytes",
                    required=request.footprint_bytes,
                    limit=limit,
                )
            largest = max(request.item_tokens)
            if largest > self._effective_max_num_tokens:
                self._effective_max_num_tokens = largest
                logger.warning(
                    "encoder item of %d tokens (request %s) exceeds encoder.max_num_tokens=%d; "
                    "raising the effective token budget to %d so it can run alone in an iteration",
                    largest,
                    request_id,
                    self._budget.max_num_tokens,
                    largest,
                )
        live = _Live(request, request.cache_keys if self._cache is not None else None)
        self._live[request_id] = live
        self._waiting[request_id] = live

    def schedule(self, max_new_requests: int | None = None) -> SchedulePlan:
        """Select this iteration's items; see the class docstring for the rules.

        `max_new_requests` bounds how many waiting requests may start now (the hand-off consumer's free
        slots); None means no bound. EAGER ignores it.
        """
        if max_new_requests is not None and max_new_requests < 0:
            raise ValueError(f"max_new_requests must be >= 0 or None, got {max_new_requests}")
        self._iterations += 1
        policy = self._policy
        budget = self._budget
        if policy is SchedulingPolicy.DISABLED:
            run = _Pass(_UNBOUNDED, _UNBOUNDED, None)
            byte_limit = _UNBOUNDED
        else:
            run = _Pass(budget.max_num_items, budget.max_num_tokens, budget.max_num_tokens)
            byte_limit = _UNBOUNDED if budget.max_resident_bytes is None else budget.max_resident_bytes

        # Started requests continue first, oldest first.
        if self._active:
            finished: list[str] = []
            for request_id, live in self._active.items():
                if run.items_left == 0:
                    break
                self._advance(live, run)
                if live.next_item == len(live.tokens):
                    finished.append(request_id)
            for request_id in finished:
                del self._active[request_id]

        # Waiting requests start strictly FCFS: when the head cannot start, nobody behind it does.
        new_left = _UNBOUNDED if max_new_requests is None or policy is SchedulingPolicy.EAGER else max_new_requests
        waiting = self._waiting
        while waiting and new_left > 0 and run.items_left > 0:
            request_id = next(iter(waiting))
            live = waiting[request_id]
            if self._resident_bytes + live.nbytes > byte_limit:
                break
            # The first item must be payable now (an oversized one only into an otherwise empty iteration);
            # otherwise this request would hold bytes without making progress.
            if live.tokens[0] > run.tokens_left and run.work:
                break
            del waiting[request_id]
            request = live.request
            live.buffer = RequestBuffer(request.offsets, request.embedding_width, request.dtype, self._device)
            live.charged = True
            self._resident_bytes += live.nbytes
            run.started.append(request_id)
            new_left -= 1
            self._advance(live, run)
            if live.next_item < len(live.tokens):
                self._active[request_id] = live

        self._items_scheduled += len(run.work)
        return SchedulePlan(
            work=tuple(run.work),
            runs=tuple(run.runs),
            num_tokens=run.num_tokens,
            token_budget=run.token_budget,
            started=tuple(run.started),
            cache_hits=tuple(run.hits),
            ready=tuple(run.ready),
        )

    def _advance(self, live: _Live, run: _Pass) -> None:
        """Select `live`'s next items in prompt order while the budgets can pay for them."""
        tokens = live.tokens
        count = len(tokens)
        index = live.next_item
        keys = live.keys
        cache = self._cache
        buffer = live.buffer
        assert buffer is not None
        request_id = live.request_id
        offsets = live.request.offsets
        width = live.request.embedding_width
        work = run.work
        run_start = run_stop = -1
        while index < count and run.items_left > 0:
            cost = tokens[index]
            oversized = False
            if cost > run.tokens_left:
                if work:
                    break
                # Nothing is encoded yet this iteration, so the budget is still whole: the item exceeds
                # max_num_tokens itself and runs alone under the raised budget.
                oversized = True
            key = keys[index] if keys is not None else None
            if key is not None and cache is not None:
                cached = cache.get(key)
                if (
                    cached is not None
                    and cached.dtype == buffer.tensor.dtype
                    and tuple(cached.shape) == (offsets[index + 1] - offsets[index], width)
                ):
                    if buffer.write(index, cached):
                        self._ready[request_id] = live
                        run.ready.append(request_id)
                    run.hits.append((request_id, index))
                    self._cache_hits += 1
                    index += 1
                    continue
                self._cache_misses += 1
            if run_stop != index:
                if run_start >= 0:
                    run.runs.append((request_id, run_start, run_stop))
                run_start = index
            run_stop = index + 1
            work.append((request_id, index))
            run.num_tokens += cost
            run.items_left -= 1
            run.tokens_left -= cost
            index += 1
            if oversized:
                run.token_budget = cost
                run.items_left = 0
                run.tokens_left = 0
        if run_start >= 0:
            run.runs.append((request_id, run_start, run_stop))
        live.next_item = index

    def record(self, request_id: str, item_index: int, output: torch.Tensor) -> bool:
        """Copy one scheduled item's encoder output (``[num_embeddings, width]``, the request's dtype) into
        its rows of the request's buffer, and populate the cache with a copy when the item is keyed.

        Returns True when this completed the request (it is now ready). Raises UnknownRequestError when the
        request is not live (e.g. it was released while its items were encoding: drop such outputs),
        ValueError when the item was not scheduled or was already recorded, TypeError/ValueError on a
        dtype/shape mismatch.
        """
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(f"request {request_id!r} is not live (never submitted, or released)")
        buffer = live.buffer
        if buffer is None or item_index >= live.next_item:
            state = self.progress(request_id)
            raise ValueError(f"request {request_id}: item {item_index} is not scheduled (request is {state})")
        complete = buffer.write(item_index, output)
        self._items_recorded += 1
        keys = live.keys
        if keys is not None and self._cache is not None:
            key = keys[item_index]
            if key is not None:
                self._cache.put(key, buffer.rows(item_index))
        if complete:
            self._ready[request_id] = live
        return complete

    def take(self, request_id: str) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Hand out a ready request's buffer by reference (no copy) and its row offsets
        (``len(items) + 1`` entries: item ``i`` is ``buffer[offsets[i]:offsets[i + 1]]``).

        The scheduler drops its own reference; the bytes stay charged until `release`.
        """
        live = self._ready.pop(request_id, None)
        if live is None:
            self._get(request_id)  # UnknownRequestError when not live
            state = self.progress(request_id)
            raise ValueError(f"request {request_id} is not ready to take (request is {state})")
        buffer = live.buffer
        assert buffer is not None
        live.buffer = None
        live.taken = True
        self._num_taken += 1
        return buffer.tensor, buffer.offsets

    def release(self, request_id: str) -> int:
        """Forget a request in any state (waiting, partial, ready, taken) and uncharge its bytes at once.

        This is also cancellation. Idempotent: an unknown or already released id frees nothing. Returns the
        bytes freed. Outputs of its in-flight items can no longer be recorded (record raises
        UnknownRequestError).
        """
        live = self._live.pop(request_id, None)
        if live is None:
            return 0
        self._waiting.pop(request_id, None)
        self._active.pop(request_id, None)
        self._ready.pop(request_id, None)
        if live.taken:
            self._num_taken -= 1
        live.buffer = None
        if not live.charged:
            return 0
        live.charged = False
        self._resident_bytes -= live.nbytes
        return live.nbytes

    def _get(self, request_id: str) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(f"request {request_id!r} is not live (never submitted, or released)")
        return live
