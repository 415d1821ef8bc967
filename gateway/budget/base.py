"""The media budget's interface: `MediaBudget` and the `Reservation` it hands out, and what every backend shares
(its gauges, its wait histogram, its one `Retry-After` rule).

A request with media reserves bytes before any of its media loads and gives them back when the upstream accepts
it, or on any error. Waiting is bounded in time and in length; a reservation names its tenant and band, which
both backends queue fairly by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from gateway.config import Band
from gateway.errors import RateLimited
from gateway.metric_buffer import BufferedGauge, BufferedHistogram
from gateway.metrics import GatewayMetrics
from gateway.tenants import DEFAULT_TENANT, Tenant


class TenantSeries:
    """One tenant class's series (a configured tenant, or `other` for every other tenant) as one process sees
    them: the bytes its requests hold, how many wait, the bytes granted, bytes x seconds held, and wait times."""

    __slots__ = ("byte_seconds", "granted", "in_use", "in_use_gauge", "wait", "waiting", "waiting_gauge")

    def __init__(self, metrics: GatewayMetrics, label: str) -> None:
        self.in_use = 0
        self.waiting = 0
        self.in_use_gauge: Gauge = metrics.tenant_budget_in_use_bytes.labels(label)
        self.waiting_gauge: Gauge = metrics.tenant_budget_waiting_requests.labels(label)
        self.granted: Counter = metrics.tenant_budget_granted_bytes.labels(label)
        self.byte_seconds: Counter = metrics.tenant_budget_byte_seconds.labels(label)
        self.wait: Histogram = metrics.tenant_budget_wait_seconds.labels(label)

    def add_waiting(self, delta: int) -> None:
        self.waiting += delta
        self.waiting_gauge.set(self.waiting)

    def take(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.in_use_gauge.set(self.in_use)
        self.granted.inc(nbytes)

    def give_back(self, nbytes: int, held_s: float) -> None:
        self.in_use -= nbytes
        self.in_use_gauge.set(self.in_use)
        self.byte_seconds.inc(nbytes * held_s)


class TenantClasses:
    """Each tenant class's `TenantSeries`, made on first use, and the count of tenant states; none without
    metrics."""

    def __init__(self, metrics: GatewayMetrics | None) -> None:
        self._metrics = metrics
        self._series: dict[str, TenantSeries] = {}
        self._states: BufferedGauge | None = None
        if metrics is not None:
            self._states = metrics.buffer.gauge(metrics.budget_tenant_states)

    def tenant_states(self, count: int) -> None:
        if self._states is not None:
            self._states.set(count)

    def tenant_evictions(self, count: int) -> None:
        if self._metrics is not None:
            self._metrics.budget_tenant_evictions.inc(count)

    def get(self, label: str) -> TenantSeries | None:
        if self._metrics is None:
            return None
        series = self._series.get(label)
        if series is None:
            series = self._series[label] = TenantSeries(self._metrics, label)
        return series


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

    async def reserve(
        self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT, band: Band = Band.INTERACTIVE
    ) -> Reservation:
        """Wait until `nbytes` are free and take them for `tenant` in `band`; `RateLimited` when the wait cannot be
        had."""
        ...

    @property
    def in_use(self) -> int: ...

    @property
    def waiting(self) -> int: ...


def retry_after_s(timeout_s: float | None) -> float:
    """What a 429 for the budget tells the client to wait: the admission timeout rounded up, 1 s without one."""
    return float(math.ceil(timeout_s)) if timeout_s is not None else 1.0


@dataclass(frozen=True, slots=True)
class BudgetName:
    """What a byte budget's refusals say it is: its subject, the key of its capacity, the reason a timed-out
    wait is counted under."""

    subject: str
    knob: str
    timeout_reason: str


MEDIA_BUDGET = BudgetName("the media budget", "limits.max_multimodal_cpu_bytes", "budget_timeout")
SHARED_MEDIA_BUDGET = BudgetName(
    "the media budget shared by every gateway", "limits.max_multimodal_cpu_bytes", "budget_timeout"
)
BODY_BUFFER = BudgetName("the bound on buffered request bodies", "limits.max_buffered_body_bytes", "body_timeout")


def queue_full(waiting: int, max_queued: int | None, timeout_s: float | None, name: BudgetName) -> RateLimited:
    """The 429 for a request that finds `limits.max_queued_requests` already waiting."""
    return RateLimited(
        f"{waiting:,} requests are already waiting for {name.subject} (limits.max_queued_requests={max_queued:,})",
        retry_after_s=retry_after_s(timeout_s),
        reason="queue_full",
    )


def wait_timed_out(
    nbytes: int, timeout_s: float | None, name: BudgetName, *, capacity: int, in_use: int, waiting: int
) -> RateLimited:
    """The 429 for a request that waited `limits.admission_timeout_s` without its bytes."""
    return RateLimited(
        f"waited limits.admission_timeout_s={timeout_s:g} for {nbytes:,} bytes of {name.subject} "
        f"({name.knob}={capacity:,}, {in_use:,} in use, {waiting:,} waiting)",
        retry_after_s=retry_after_s(timeout_s),
        reason=name.timeout_reason,
    )


class BudgetGauges:
    """A budget's gauges in this process (capacity, in use, waiting) and its wait histogram; `None` (a backend's
    internal fallback) records nothing. What changes with every request goes through the metrics' buffer."""

    __slots__ = ("_capacity", "_in_use", "_wait", "_waiting")

    def __init__(
        self,
        capacity: Gauge | None,
        in_use: BufferedGauge | None,
        waiting: BufferedGauge | None,
        wait: BufferedHistogram | None,
    ) -> None:
        self._capacity, self._in_use, self._waiting, self._wait = capacity, in_use, waiting, wait

    @classmethod
    def media(cls, metrics: GatewayMetrics | None) -> BudgetGauges:
        """`mmgate_budget_capacity_bytes`, `_in_use_bytes`, `_waiting_requests`, `mmgate_budget_wait_seconds`."""
        if metrics is None:
            return cls(None, None, None, None)
        buffer = metrics.buffer
        return cls(
            metrics.budget_capacity_bytes,
            buffer.gauge(metrics.budget_in_use_bytes),
            buffer.gauge(metrics.budget_waiting_requests),
            buffer.histogram(metrics.budget_wait_seconds),
        )

    @classmethod
    def bodies(cls, metrics: GatewayMetrics) -> BudgetGauges:
        """`mmgate_body_buffer_capacity_bytes`, `_bytes`, `_waiting_requests`, `mmgate_body_buffer_wait_seconds`."""
        buffer = metrics.buffer
        return cls(
            metrics.body_buffer_capacity_bytes,
            buffer.gauge(metrics.body_buffer_bytes),
            buffer.gauge(metrics.body_buffer_waiting_requests),
            buffer.histogram(metrics.body_buffer_wait_seconds),
        )

    def capacity(self, nbytes: int) -> None:
        if self._capacity is not None:
            self._capacity.set(nbytes)

    def publish(self, in_use: int, waiting: int) -> None:
        if self._in_use is not None and self._waiting is not None:
            self._in_use.set(in_use)
            self._waiting.set(waiting)

    def observe_wait(self, seconds: float) -> None:
        if self._wait is not None:
            self._wait.observe(seconds)
