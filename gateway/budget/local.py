"""The in-process media budget (one gateway worker), and the budget that is off."""

from __future__ import annotations

import asyncio
import collections
import time

from gateway.budget.base import MEDIA_BUDGET, BudgetGauges, BudgetName, Reservation, queue_full, wait_timed_out
from gateway.metrics import GatewayMetrics


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
        name: BudgetName = MEDIA_BUDGET,
        gauges: BudgetGauges | None = None,
    ) -> None:
        """`metrics`: the media budget's gauges; `gauges` another budget's (`name` says which budget it is)."""
        self.capacity: int | None = capacity
        self._capacity = capacity
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.name = name
        self._gauges = gauges if gauges is not None else BudgetGauges.media(metrics)
        self._gauges.capacity(capacity)
        self._gauges.publish(0, 0)
        self._in_use = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

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
            self._gauges.observe_wait(0.0)
            return Reservation(self, nbytes)
        if self.max_queued is not None and len(self._queue) >= self.max_queued:
            raise queue_full(len(self._queue), self.max_queued, self.timeout_s, self.name)
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
            self._gauges.observe_wait(time.perf_counter() - started)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._queue.remove(waiter)
        waiter.future.set_exception(
            wait_timed_out(
                waiter.nbytes,
                self.timeout_s,
                self.name,
                capacity=self._capacity,
                in_use=self._in_use,
                waiting=len(self._queue),
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
        self._gauges.publish(self._in_use, len(self._queue))
