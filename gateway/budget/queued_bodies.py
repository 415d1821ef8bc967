"""The bound on raw bodies held by requests that wait for the media budget (`limits.max_queued_body_bytes`).

A request with media has its whole raw body in memory before it asks for the budget, and the budget counts it
only once granted. Without this bound the bodies of waiting requests could reach `limits.max_queued_requests`
× `limits.max_request_body_bytes`; with it they never pass `limits.max_queued_body_bytes`, and one more is a 429.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.budget.base import retry_after_s
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics


class QueuedBodies:
    def __init__(self, max_bytes: int | None, *, timeout_s: float | None, metrics: GatewayMetrics) -> None:
        self.max_bytes = max_bytes
        self.retry_after_s = retry_after_s(timeout_s)
        self.metrics = metrics
        self.total = 0

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Count `nbytes` while the block waits for the budget; 429 when they would pass the bound."""
        # A body alone over the bound (possible only with limits.max_request_body_bytes off) may still wait alone.
        if self.max_bytes is not None and self.total and self.total + nbytes > self.max_bytes:
            raise RateLimited(
                f"raw bodies of requests waiting for the media budget would reach {self.total + nbytes:,} bytes "
                f"with this one's {nbytes:,}, over limits.max_queued_body_bytes={self.max_bytes:,}",
                retry_after_s=self.retry_after_s,
                reason="queued_bodies_full",
            )
        self._add(nbytes)
        try:
            yield
        finally:
            self._add(-nbytes)

    def _add(self, nbytes: int) -> None:
        self.total += nbytes
        self.metrics.budget_queued_body_bytes.set(self.total)
