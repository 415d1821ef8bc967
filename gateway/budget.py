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


class Reservation:
    """Bytes held from a budget. `release()` is idempotent, so every exit path may call it."""

    __slots__ = ("_budget", "nbytes", "released")

    def __init__(self, budget: LocalBudget | None, nbytes: int) -> None:
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
    __slots__ = ("future", "nbytes")

    def __init__(self, nbytes: int, future: asyncio.Future[None]) -> None:
        self.nbytes = nbytes
        self.future = future


class LocalBudget:
    """FIFO byte budget for one event loop. The head of the queue is served first even when a later, smaller
    request would fit: no overtaking, so a large request is never starved."""

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
        waiter = _Waiter(nbytes, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._publish()
        started = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
        except TimeoutError:
            self._abandon(waiter)
            raise RateLimited(
                f"waited limits.admission_timeout_s={self.timeout_s:g} for {nbytes:,} bytes of the media budget "
                f"(limits.max_multimodal_cpu_bytes={self._capacity:,}, {self._in_use:,} in use, "
                f"{len(self._queue):,} waiting)",
                retry_after_s=self._retry_after_s(),
                reason="budget_timeout",
            ) from None
        except BaseException:
            # Cancelled (the client left): leave the queue at once.
            self._abandon(waiter)
            raise
        finally:
            self._observe_wait(time.perf_counter() - started)
        return Reservation(self, nbytes)

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            # Granted in the same instant it was given up: hand the bytes straight back.
            self._give_back(waiter.nbytes)
            return
        waiter.future.cancel()
        self._queue.remove(waiter)  # not granted, so still queued
        # The head may have been the one blocking the rest.
        self._grant()

    def _take(self, nbytes: int) -> None:
        self._in_use += nbytes
        self._publish()

    def _give_back(self, nbytes: int) -> None:
        self._in_use -= nbytes
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue and self._in_use + queue[0].nbytes <= self._capacity:
            waiter = queue.popleft()
            self._in_use += waiter.nbytes
            waiter.future.set_result(None)
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
