"""What this process holds of the shared budget and waits for: its leases, its waiters, and the step that turns a
grant into a waiter's reservation."""

from __future__ import annotations

import asyncio
import itertools
import time

from gateway.budget.base import Reservation, TenantSeries
from gateway.budget.local import LocalBudget
from gateway.budget.redis.metrics import Meters
from gateway.budget.redis.releases import Releases
from gateway.budget.redis.scripts import who
from gateway.config import Band
from gateway.tenants import Tenant


class Lease:
    """One lease of the shared budget, as the `Reservation` handed to the caller sees it.

    `Reservation.release()` (also called unbound, as `Reservation.release(r)`, by the admission path) gives the bytes
    back through `_give_back(nbytes)` on the object it was built with; a lease provides that method, so the caller
    gets a plain `Reservation` and the lease is released once, in the background, whichever way it is called.
    """

    __slots__ = ("_holdings", "granted", "lease_id", "lost", "nbytes", "released", "series", "tenant_id")

    def __init__(
        self, holdings: Holdings, lease_id: str, nbytes: int, tenant_id: str, series: TenantSeries | None
    ) -> None:
        self._holdings = holdings
        self.lease_id = lease_id
        self.nbytes = nbytes
        self.tenant_id = tenant_id
        self.series = series
        self.granted = time.perf_counter()
        self.lost = False  # a renewal found it gone from Redis: no longer renewed
        self.released = False

    def _give_back(self, nbytes: int) -> None:
        if not self.released:
            self.released = True
            self._holdings.release(self)

    def reservation(self) -> Reservation:
        return Reservation(self, self.nbytes)


class Waiter:
    """A reserve call of this process: its ticket (the id its lease takes when granted), and `future`, which gets
    its reservation."""

    __slots__ = ("band", "future", "nbytes", "queued", "tenant", "ticket", "timeout_s", "timer", "who")

    def __init__(
        self,
        ticket: str,
        nbytes: int,
        future: asyncio.Future[Reservation],
        tenant: Tenant,
        band: Band,
        timeout_s: float | None,
    ) -> None:
        self.ticket = ticket
        self.nbytes = nbytes
        self.future = future
        self.tenant = tenant
        self.band = band
        self.timeout_s = timeout_s
        self.who = who(tenant, band)
        self.queued = False  # the reserve script answered "queued": heartbeats may refresh the ticket
        self.timer: asyncio.TimerHandle | None = None


class Holdings:
    """This process's leases and waiters by id, and the bytes its leases hold (`held`); `in_use` and `waiting`
    count the local fallback's too. Ids are `process:n`, unique across the processes sharing the budget."""

    __slots__ = ("_fallback", "_ids", "_meters", "_process", "_releases", "held", "leases", "waiters")

    def __init__(self, process: str, meters: Meters, releases: Releases, fallback: LocalBudget) -> None:
        self._process = process
        self._ids = itertools.count()
        self._meters = meters
        self._releases = releases
        self._fallback = fallback
        self.waiters: dict[str, Waiter] = {}
        self.leases: dict[str, Lease] = {}
        self.held = 0

    @property
    def in_use(self) -> int:
        return self.held + self._fallback.in_use

    @property
    def waiting(self) -> int:
        return len(self.waiters) + self._fallback.waiting

    def new_id(self) -> str:
        return f"{self._process}:{next(self._ids)}"

    def publish(self) -> None:
        self._meters.gauges.publish(self.in_use, self.waiting)

    def hand_over(self, waiter: Waiter, *, by_message: bool | None) -> None:
        """Turn a grant into the waiter's reservation, in one step; `by_message`: learnt from the grant channel
        (True), a renewal or a requeue (False), or the reserve call's own answer (None). A waiter that already gave
        up (its future is done) is left to its own abandon, which gives the lease back."""
        if waiter.future.done():
            return
        self.waiters.pop(waiter.ticket, None)
        if waiter.timer is not None:
            waiter.timer.cancel()
        series = self._meters.classes.get(waiter.tenant.label)
        lease = Lease(self, waiter.ticket, waiter.nbytes, waiter.tenant.id, series)
        self.leases[waiter.ticket] = lease
        self.held += waiter.nbytes
        if series is not None:
            series.take(waiter.nbytes)
        stats = self._meters.stats
        if by_message is True:
            stats.grants_by_message += 1
        elif by_message is False:
            stats.grants_by_recheck += 1
        waiter.future.set_result(lease.reservation())
        self.publish()

    def release(self, lease: Lease) -> None:
        if self.leases.pop(lease.lease_id, None) is not None:
            self.held -= lease.nbytes
            if lease.series is not None:
                lease.series.give_back(lease.nbytes, time.perf_counter() - lease.granted)
        self.publish()
        self._releases.send(lease.lease_id)
