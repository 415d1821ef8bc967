"""What a Redis budget counts for the metrics: its counters (`RedisBudgetStats`, copied into Prometheus by
`gateway.budget.reporter`), its round trips, and this process's gauges and per-class series."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.budget.base import BudgetGauges, TenantClasses
from gateway.metrics import GatewayMetrics


@dataclass
class RedisBudgetStats:
    """Counters since construction, for metrics: each only grows."""

    round_trips: int = 0
    round_trip_seconds: float = 0.0
    backend_errors: int = 0
    lease_renewals: int = 0
    leases_lost: int = 0
    leases_reaped: int = 0
    tickets_reaped: int = 0
    grants_by_message: int = 0
    grants_by_recheck: int = 0
    fallbacks: int = 0
    leases_reasserted: int = 0
    state_losses: int = 0
    tenant_evictions: int = 0


class Meters:
    """The counters, the gauges of the media budget in this process (`gauges`), each tenant class's series
    (`classes`), and `on_round_trip(operation, seconds)`, called after each round trip to Redis."""

    __slots__ = ("classes", "gauges", "on_round_trip", "stats")

    def __init__(
        self, metrics: GatewayMetrics | None, capacity: int, on_round_trip: Callable[[str, float], None] | None
    ) -> None:
        self.stats = RedisBudgetStats()
        self.gauges = BudgetGauges.media(metrics)
        self.gauges.capacity(capacity)
        self.classes = TenantClasses(metrics)
        self.gauges.publish(0, 0)
        self.on_round_trip = on_round_trip

    def round_trip(self, name: str, seconds: float) -> None:
        self.stats.round_trips += 1
        self.stats.round_trip_seconds += seconds
        if self.on_round_trip is not None:
            self.on_round_trip(name, seconds)
