"""The media budget's interface: `MediaBudget` and the `Reservation` it hands out, and what every backend shares
(its gauges, its wait histogram, its one `Retry-After` rule).

A request with media reserves bytes before any of its media loads and gives them back when the upstream accepts
it, or on any error. Waiting is FIFO and bounded in time and in length.
"""

from __future__ import annotations

import math
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


def retry_after_s(timeout_s: float | None) -> float:
    """What a 429 for the budget tells the client to wait: the admission timeout rounded up, 1 s without one."""
    return float(math.ceil(timeout_s)) if timeout_s is not None else 1.0


def queue_full(waiting: int, max_queued: int | None, timeout_s: float | None, *, shared: bool) -> RateLimited:
    """The 429 for a request that finds `limits.max_queued_requests` already waiting."""
    whose = "the media budget shared by every gateway" if shared else "the media budget"
    return RateLimited(
        f"{waiting:,} requests are already waiting for {whose} (limits.max_queued_requests={max_queued:,})",
        retry_after_s=retry_after_s(timeout_s),
        reason="queue_full",
    )


def wait_timed_out(
    nbytes: int, timeout_s: float | None, *, capacity: int, in_use: int, waiting: int, shared: bool
) -> RateLimited:
    """The 429 for a request that waited `limits.admission_timeout_s` without its bytes."""
    whose = "budget shared by every gateway" if shared else "budget"
    return RateLimited(
        f"waited limits.admission_timeout_s={timeout_s:g} for {nbytes:,} bytes of the media {whose} "
        f"(limits.max_multimodal_cpu_bytes={capacity:,}, {in_use:,} in use, {waiting:,} waiting)",
        retry_after_s=retry_after_s(timeout_s),
        reason="budget_timeout",
    )


class BudgetGauges:
    """This process's budget gauges (`mmgate_budget_capacity_bytes`, `_in_use_bytes`, `_waiting_requests`) and its
    wait histogram; without metrics (a backend's internal fallback) it records nothing."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: GatewayMetrics | None, capacity: int) -> None:
        self.metrics = metrics
        self.capacity(capacity)
        self.publish(0, 0)

    def capacity(self, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.budget_capacity_bytes.set(nbytes)

    def publish(self, in_use: int, waiting: int) -> None:
        if self.metrics is not None:
            self.metrics.budget_in_use_bytes.set(in_use)
            self.metrics.budget_waiting_requests.set(waiting)

    def observe_wait(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.budget_wait_seconds.observe(seconds)
