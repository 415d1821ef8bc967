"""What the media budget reports: `BudgetReporter` keeps the budget metrics (the cluster's view, the backend's round
trips, errors, lease renewals and expiries, fallbacks, tenant records) and the `/readyz` line up to date."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.budget.base import MediaBudget
from gateway.budget.redis import RedisBudget, RedisBudgetStats
from gateway.metrics import GatewayMetrics
from serving.settings_types import format_bytes

# How often the counters of a Redis budget are copied into the metrics (and at each scrape of this process).
SYNC_INTERVAL_S = 1.0


class BudgetReporter:
    """Copies the budget's state into the metrics: at once for the local backend (its own gauges), and every
    `SYNC_INTERVAL_S` (and on demand) for a Redis budget, whose counters grow in `RedisBudget.stats`."""

    def __init__(self, budget: MediaBudget, metrics: GatewayMetrics) -> None:
        self.budget = budget
        self.metrics = metrics
        self._seen = RedisBudgetStats()
        self._task: asyncio.Task[None] | None = None
        if budget.capacity is not None:
            metrics.budget_cluster_capacity_bytes.set(budget.capacity)
        metrics.budget_backend_degraded.set(0)
        self.sync()

    async def start(self) -> None:
        if isinstance(self.budget, RedisBudget):
            await self.budget.start()
            self.sync()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mmgate-budget-metrics")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if isinstance(self.budget, RedisBudget):
            await self.budget.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            self.sync()

    def sync(self) -> None:
        budget, metrics = self.budget, self.metrics
        if not isinstance(budget, RedisBudget):
            metrics.budget_cluster_in_use_bytes.set(budget.in_use)
            metrics.budget_cluster_waiting_requests.set(budget.waiting)
            return
        metrics.budget_cluster_in_use_bytes.set(budget.cluster_in_use)
        metrics.budget_cluster_waiting_requests.set(budget.cluster_waiting)
        metrics.budget_tenant_states.set(budget.cluster_tenants)
        metrics.budget_backend_degraded.set(1 if budget.backend_degraded else 0)
        stats, seen = budget.stats, self._seen
        for counter, now, before in (
            (metrics.budget_backend_errors, stats.backend_errors, seen.backend_errors),
            (metrics.budget_lease_renewals, stats.lease_renewals, seen.lease_renewals),
            (metrics.budget_leases_lost, stats.leases_lost, seen.leases_lost),
            (metrics.budget_backend_fallbacks, stats.fallbacks, seen.fallbacks),
            (metrics.budget_leases_reasserted, stats.leases_reasserted, seen.leases_reasserted),
            (metrics.budget_state_losses, stats.state_losses, seen.state_losses),
            (metrics.budget_tenant_evictions, stats.tenant_evictions, seen.tenant_evictions),
            (metrics.budget_lease_expiries.labels("lease"), stats.leases_reaped, seen.leases_reaped),
            (metrics.budget_lease_expiries.labels("ticket"), stats.tickets_reaped, seen.tickets_reaped),
        ):
            if now > before:
                counter.inc(now - before)
        self._seen = RedisBudgetStats(**vars(stats))

    async def readiness(self) -> tuple[bool, str, str | None]:
        """The `/readyz` line: (ready, how it went, the backend's address). Not ready only when this gateway's cap
        disagrees with the shared budget's: every replica shares an outage, and taking them all out of rotation at
        once when Redis fails would also stop the requests without media, which need no budget."""
        budget = self.budget
        if not isinstance(budget, RedisBudget):
            capacity = budget.capacity
            where = "off" if capacity is None else f"local {format_bytes(capacity)}"
            return True, f"{where}: {budget.in_use:,} bytes in use, {budget.waiting:,} waiting", None
        if not budget.backend_degraded:
            await budget.refresh()
        self.sync()
        url = f"redis {budget.safe_url}"
        if budget.misconfigured is not None:
            # Unlike an outage, which every replica shares, this gateway alone disagrees with the others.
            return False, f"misconfigured: {budget.misconfigured}", url
        if budget.backend_degraded:
            share = format_bytes(budget.fallback_capacity)
            return True, f"unavailable, degraded to a local share of {share} (redis.on_unavailable=local)", url
        if not budget.backend_ok:
            return True, "unavailable, media requests get 503 (redis.on_unavailable=reject)", url
        state = (
            f"{budget.cluster_in_use:,} of {budget.capacity or 0:,} bytes in use, {budget.cluster_waiting:,} waiting"
        )
        return True, f"redis ok, {state}", url
