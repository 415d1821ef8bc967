"""The process-wide media byte budget (`limits.max_multimodal_cpu_bytes`).

A request with media reserves bytes before any of its media loads and gives them back when the upstream accepts
it, or on any error. Waiting is FIFO and bounded in time and in length. `MediaBudget` is the interface; this
module has the in-process implementation (one gateway worker). A budget shared by many workers and replicas
implements the same interface.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Protocol

from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics


class ReservationOwner(Protocol):
    """What a `Reservation` gives its bytes back to: a budget, or a lease of a shared budget."""

    def _give_back(self, nbytes: int) -> None: ...


class Reservation:
    """Bytes held from a budget. `release()` is idempotent, so every exit path may call it."""

    __slots__ = ("_budget", "nbytes", "released")

    def __init__(self, budget: ReservationOwner | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self._budget is not None:
                self._budget._give_back(self.nbytes)


class MediaBudget(Protocol):
    capacity: int | None

    async def reserve(self, nbytes: int) -> Reservation:
        """Wait (FIFO) until `nbytes` are free and take them; `RateLimited` when the wait cannot be had."""
        ...

    @property
    def in_use(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class UnlimitedBudget:
    """`limits.max_multimodal_cpu_bytes: null`: nothing is reserved, nobody waits."""

    capacity: int | None = None

    async def reserve(self, nbytes: int) -> Reservation:
        return Reservation(None, nbytes)

    @property
    def in_use(self) -> int:
        return 0

    @property
    def waiting(self) -> int:
        return 0


class _Waiter:
    __slots__ = ("future", "nbytes", "timer")

    def __init__(self, nbytes: int, future: asyncio.Future[Reservation]) -> None:
        self.nbytes = nbytes
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class LocalBudget:
    """FIFO byte budget for one event loop. The head of the queue is served first even when a later, smaller
    request would fit: no overtaking, so a large request is never starved.

    Granting bytes and handing their `Reservation` to the waiter is one step (the waiter's future carries the
    reservation), and a waiter that is cancelled or times out after its grant gives the bytes straight back, so
    capacity is conserved however a grant interleaves with a cancellation, a timeout or a release.
    """

    def __init__(
        self,
        capacity: int,
        *,
        timeout_s: float | None,
        max_queued: int | None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.capacity: int | None = capacity
        self._capacity = capacity
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.metrics = metrics
        self._in_use = 0
        self._queue: collections.deque[_Waiter] = collections.deque()
        if metrics is not None:
            metrics.budget_capacity_bytes.set(capacity)
            metrics.budget_in_use_bytes.set(0)
            metrics.budget_waiting_requests.set(0)

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def reserve(self, nbytes: int) -> Reservation:
        if nbytes > self._capacity:
            raise ValueError(f"reservation of {nbytes:,} bytes can never fit a budget of {self._capacity:,}")
        if not self._queue and self._in_use + nbytes <= self._capacity:
            self._take(nbytes)
            self._observe_wait(0.0)
            return Reservation(self, nbytes)
        if self.max_queued is not None and len(self._queue) >= self.max_queued:
            raise RateLimited(
                f"{len(self._queue):,} requests are already waiting for the media budget "
                f"(limits.max_queued_requests={self.max_queued:,})",
                retry_after_s=self._retry_after_s(),
                reason="queue_full",
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, loop.create_future())
        if self.timeout_s is not None:
            waiter.timer = loop.call_later(self.timeout_s, self._expire, waiter)
        self._queue.append(waiter)
        self._publish()
        started = time.perf_counter()
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result when a cancellation races it, and the
            # caller being cancelled would never see the reservation it was handed.
            return await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._observe_wait(time.perf_counter() - started)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._queue.remove(waiter)
        waiter.future.set_exception(
            RateLimited(
                f"waited limits.admission_timeout_s={self.timeout_s:g} for {waiter.nbytes:,} bytes of the media "
                f"budget (limits.max_multimodal_cpu_bytes={self._capacity:,}, {self._in_use:,} in use, "
                f"{len(self._queue):,} waiting)",
                retry_after_s=self._retry_after_s(),
                reason="budget_timeout",
            )
        )
        # The head may have been the one blocking the rest.
        self._grant()

    def _abandon(self, waiter: _Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                # Granted in the same turn as it was given up: hand the bytes straight back.
                future.result().release()
            return
        future.cancel()
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._grant()

    def _take(self, nbytes: int) -> None:
        self._in_use += nbytes
        self._publish()

    def _give_back(self, nbytes: int) -> None:
        self._in_use -= nbytes
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue:
            head = queue[0]
            if head.future.done():
                queue.popleft()  # cancelled in this turn; its owner has not run its clean-up yet
                continue
            if self._in_use + head.nbytes > self._capacity:
                break
            queue.popleft()
            self._in_use += head.nbytes
            head.future.set_result(Reservation(self, head.nbytes))
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.budget_in_use_bytes.set(self._in_use)
            self.metrics.budget_waiting_requests.set(len(self._queue))

    def _observe_wait(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.budget_wait_seconds.observe(seconds)

    def _retry_after_s(self) -> float:
        return float(math.ceil(self.timeout_s)) if self.timeout_s is not None else 1.0
