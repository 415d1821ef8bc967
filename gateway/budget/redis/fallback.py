"""What a Redis budget does while Redis does not answer (`redis.on_unavailable`): `reject` refuses with
`BudgetBackendUnavailable` (503), `local` serves from a per-process `LocalBudget` of
`capacity // expected_replicas` until Redis answers again."""

from __future__ import annotations

import logging

from gateway.budget.base import Reservation
from gateway.budget.local import LocalBudget
from gateway.budget.redis.client import BudgetBackendUnavailable, Unavailable
from gateway.budget.redis.leases import Waiter
from gateway.budget.redis.metrics import Meters
from gateway.config import Band, OnUnavailable
from gateway.tenants import Tenant

logger = logging.getLogger(__name__)


class BackendLost(Exception):
    """Set on a waiter when Redis went away and the budget falls back to the local share."""


class Fallback:
    """The policy (`policy`), the local share (`budget`, of `capacity` bytes), and whether this process serves from
    it now (`degraded`)."""

    __slots__ = ("_meters", "_safe_url", "budget", "capacity", "degraded", "expected_replicas", "full", "policy")

    def __init__(
        self,
        policy: OnUnavailable,
        *,
        capacity: int,
        expected_replicas: int,
        timeout_s: float | None,
        max_queued: int | None,
        batch_timeout_s: float | None,
        window_s: float,
        max_tenants: int,
        safe_url: str,
        meters: Meters,
    ) -> None:
        self.policy = OnUnavailable(policy)
        self.expected_replicas = expected_replicas
        self.full = capacity
        self.capacity = max(1, capacity // expected_replicas)
        self.budget = LocalBudget(
            self.capacity,
            timeout_s=timeout_s,
            max_queued=max_queued,
            batch_timeout_s=batch_timeout_s,
            window_s=window_s,
            max_tenants=max_tenants,
        )
        self.degraded = False
        self._safe_url = safe_url
        self._meters = meters

    async def reserve(self, nbytes: int, tenant: Tenant, band: Band) -> Reservation:
        # A request larger than the local share takes the whole share: it runs alone in this process.
        return await self.budget.reserve(min(nbytes, self.capacity), tenant=tenant, band=band)

    def unavailable_error(self, exc: BaseException) -> BudgetBackendUnavailable:
        return BudgetBackendUnavailable(
            f"the shared media budget's Redis at {self._safe_url} does not answer ({exc}); "
            "nothing is admitted that the budget has not counted (redis.on_unavailable=reject)"
        )

    def degrade(self, exc: Unavailable) -> bool:
        """Redis did not answer: serve from the local share (`local`); true when this starts it."""
        if self.policy is not OnUnavailable.LOCAL or self.degraded:
            return False
        self.degraded = True
        self._meters.stats.fallbacks += 1
        self._meters.gauges.capacity(self.capacity)
        logger.warning(
            "the shared media budget's Redis at %s does not answer (%s): admitting from a local share of "
            "%s bytes (limits.max_multimodal_cpu_bytes // redis.expected_replicas=%d) until it answers again",
            self._safe_url,
            exc,
            f"{self.capacity:,}",
            self.expected_replicas,
        )
        return True

    def turn_away(self, exc: Unavailable, waiters: dict[str, Waiter]) -> None:
        """Move the queued `waiters` to the local share (`BackendLost`), or refuse them."""
        for waiter in list(waiters.values()):
            if waiter.queued and not waiter.future.done():
                waiters.pop(waiter.ticket, None)
                if waiter.timer is not None:
                    waiter.timer.cancel()
                if self.policy is OnUnavailable.LOCAL:
                    waiter.future.set_exception(BackendLost())
                else:
                    waiter.future.set_exception(self.unavailable_error(exc))

    def recover(self) -> None:
        """Redis answers again: admit from it."""
        self.degraded = False
        self._meters.gauges.capacity(self.full)
        logger.warning("the shared media budget's Redis at %s answers again: admitting from it", self._safe_url)
