"""The in-process media budget (one gateway worker), and the budget that is off."""

from __future__ import annotations

import asyncio
import time

from gateway.budget.base import (
    MEDIA_BUDGET,
    BudgetGauges,
    BudgetName,
    Reservation,
    TenantClasses,
    queue_full,
    retry_after_s,
    wait_timed_out,
)
from gateway.budget.fair_queue import BATCH, INTERACTIVE, FairQueue, TenantState, Waiter
from gateway.config import Band
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from gateway.tenants import DEFAULT_MAX_TENANTS, DEFAULT_TENANT, DEFAULT_WINDOW_S, Tenant


class UnlimitedBudget:
    """`limits.max_multimodal_cpu_bytes: null`: nothing is reserved, nobody waits."""

    capacity: int | None = None

    async def reserve(
        self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT, band: Band = Band.INTERACTIVE
    ) -> Reservation:
        return Reservation(None, nbytes)

    @property
    def in_use(self) -> int:
        return 0

    @property
    def waiting(self) -> int:
        return 0


class _Hold:
    """What one grant's `Reservation` gives its bytes back to: its tenant, and when it was granted."""

    __slots__ = ("budget", "granted", "state")

    def __init__(self, budget: LocalBudget, state: TenantState, granted: float) -> None:
        self.budget = budget
        self.state = state
        self.granted = granted

    def _give_back(self, nbytes: int) -> None:
        self.budget._release(self.state, nbytes, self.granted)


class LocalBudget:
    """Byte budget for one event loop, queued fairly between tenants (`gateway.budget.fair_queue`).

    With one tenant in one band it is FIFO: the head of the queue is served first even when a later, smaller
    request would fit (no overtaking, so a large request is never starved). With several, the next grant goes to
    the request the fair queue puts first, and nothing overtakes it when it does not fit; a tenant at its own
    `max_bytes_in_use` is passed over, never blocking the others. A waiting interactive request is served before
    any batch one, and a batch request is never granted while an interactive head waits for room.

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
        batch_timeout_s: float | None = None,
        window_s: float = DEFAULT_WINDOW_S,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        one_tenant: bool = False,
    ) -> None:
        """`metrics`: the media budget's gauges and per-tenant series; `gauges` another budget's (`name` says which
        budget it is). `batch_timeout_s`: the admission timeout of the batch band. `window_s` and `max_tenants`:
        how long an idle tenant's lead is kept, and how many tenant states. `one_tenant`: every reservation is the
        default tenant's (a FIFO queue)."""
        self.capacity: int | None = capacity
        self._capacity = capacity
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.max_queued = max_queued
        self.name = name
        self.window_s = window_s
        self._gauges = gauges if gauges is not None else BudgetGauges.media(metrics)
        self._gauges.capacity(capacity)
        self._gauges.publish(0, 0)
        self._in_use = 0
        self._waiting = 0
        self._classes = TenantClasses(metrics)
        self._queue = FairQueue(max_tenants=1 if one_tenant else max_tenants, window_s=window_s)
        self._evictions = 0
        # One tenant in one band is FIFO whatever the expected hold: it is not kept.
        self._keeps_hold = not one_tenant

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def tenant_states(self) -> int:
        """Tenant states the budget keeps now."""
        return len(self._queue.tenants)

    @property
    def tenant_evictions(self) -> int:
        """Tenant states forgotten at `max_tenants` so far."""
        return self._queue.evictions

    def tenant_in_use(self, tenant_id: str) -> int:
        state = self._queue.get(tenant_id)
        return 0 if state is None else state.in_use

    async def reserve(
        self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT, band: Band = Band.INTERACTIVE
    ) -> Reservation:
        if nbytes > self._capacity:
            raise ValueError(f"reservation of {nbytes:,} bytes can never fit a budget of {self._capacity:,}")
        cap = tenant.max_bytes_in_use
        if cap is not None and nbytes > cap:
            raise RateLimited(
                f"{nbytes:,} bytes of {self.name.subject} can never fit {tenant.settings_key}.max_bytes_in_use={cap:,}",
                retry_after_s=retry_after_s(self.timeout_s),
                reason="tenant_cap",
            )
        # Granted at once when free and nobody waits: the bounds below count only the requests that wait (so a
        # bound of 0 still admits), as the Redis reserve script does.
        reservation = self.try_reserve(nbytes, tenant=tenant)
        if reservation is not None:
            return reservation
        if self.max_queued is not None and self._waiting >= self.max_queued:
            raise queue_full(self._waiting, self.max_queued, self.timeout_s, self.name)
        known = self._queue.get(tenant.id)
        if tenant.max_waiting is not None and known is not None and known.waiting >= tenant.max_waiting:
            raise RateLimited(
                f"{known.waiting:,} requests of this tenant are already waiting for {self.name.subject} "
                f"({tenant.settings_key}.max_waiting={tenant.max_waiting:,})",
                retry_after_s=retry_after_s(self.timeout_s),
                reason="tenant_cap",
            )
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        state = self._state(tenant, known, started)
        index = BATCH if band is Band.BATCH else INTERACTIVE
        waiter = self._queue.push(nbytes, loop.create_future(), state, index)
        self._entered(state)
        timeout_s = self.batch_timeout_s if index == BATCH else self.timeout_s
        if timeout_s is not None:
            waiter.timer = loop.call_later(timeout_s, self._expire, waiter, timeout_s)
        self._grant()
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result when a cancellation races it, and the
            # caller being cancelled would never see the reservation it was handed.
            granted: Reservation = await waiter.future
            return granted
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            waited = time.perf_counter() - started
            self._gauges.observe_wait(waited)
            if state.stats is not None:
                state.stats.wait.observe(waited)

    def try_reserve(self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT) -> Reservation | None:
        """`nbytes` taken for `tenant` at once when they are free and nobody waits (a wait of zero); else None, and
        nothing is taken. Without an await: a caller that would not wait skips the machinery of `reserve`."""
        if self._waiting or self._in_use + nbytes > self._capacity:
            return None
        known = self._queue.get(tenant.id)
        if known is not None and not known.fits_own_cap(nbytes):
            return None
        now = time.perf_counter()
        state = self._state(tenant, known, now)
        reservation = self._take(state, nbytes, now)
        self._gauges.observe_wait(0.0)
        if state.stats is not None:
            state.stats.wait.observe(0.0)
        return reservation

    # -- tenants ------------------------------------------------------------------------------------------------

    def _state(self, tenant: Tenant, known: TenantState | None, now: float) -> TenantState:
        """The tenant's state (`known`, when it has one), active now."""
        queue = self._queue
        if known is not None:
            queue.touch(known, now)
            return known
        state = queue.add(tenant, self._classes.get(tenant.label), now)
        self._classes.tenant_states(len(queue.tenants))
        if queue.evictions != self._evictions:
            self._classes.tenant_evictions(queue.evictions - self._evictions)
            self._evictions = queue.evictions
        return state

    # -- the queue ----------------------------------------------------------------------------------------------

    def _entered(self, state: TenantState) -> None:
        state.waiting += 1
        self._waiting += 1
        stats = state.stats
        if stats is not None:
            stats.add_waiting(1)
        self._publish()

    def _left(self, state: TenantState) -> None:
        state.waiting -= 1
        self._waiting -= 1
        stats = state.stats
        if stats is not None:
            stats.add_waiting(-1)

    def _dequeue(self, waiter: Waiter) -> bool:
        """Take `waiter` out of the queue; false when it was not in it."""
        if not self._queue.remove(waiter):
            return False
        self._left(waiter.state)
        return True

    def _expire(self, waiter: Waiter, timeout_s: float) -> None:
        if waiter.future.done() or not self._dequeue(waiter):
            return
        state = waiter.state
        if not state.fits_own_cap(waiter.nbytes):
            error = RateLimited(
                f"waited {timeout_s:g} s for {waiter.nbytes:,} bytes of {self.name.subject} with this tenant at "
                f"{state.tenant.settings_key}.max_bytes_in_use={state.tenant.max_bytes_in_use:,} "
                f"({state.in_use:,} in use)",
                retry_after_s=retry_after_s(timeout_s),
                reason="tenant_cap",
            )
        else:
            error = wait_timed_out(
                waiter.nbytes,
                timeout_s,
                self.name,
                capacity=self._capacity,
                in_use=self._in_use,
                waiting=self._waiting,
            )
        waiter.future.set_exception(error)
        # The head may have been the one blocking the rest.
        self._grant()

    def _abandon(self, waiter: Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                # Granted in the same turn as it was given up: hand the bytes straight back.
                future.result().release()
            return
        future.cancel()
        if self._dequeue(waiter):
            self._grant()

    def _take(self, state: TenantState, nbytes: int, now: float) -> Reservation:
        state.in_use += nbytes
        self._in_use += nbytes
        stats = state.stats
        if stats is not None:
            stats.take(nbytes)
        self._publish()
        return Reservation(_Hold(self, state, now), nbytes)

    def _release(self, state: TenantState, nbytes: int, granted: float) -> None:
        stats = state.stats
        if self._keeps_hold or stats is not None:
            held = time.perf_counter() - granted
            if self._keeps_hold:
                self._queue.held(state, held)
            if stats is not None:
                stats.give_back(nbytes, held)
        state.in_use -= nbytes
        self._in_use -= nbytes
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while self._waiting:
            head = queue.next()
            if head is None:
                break
            if head.future.done():
                # Cancelled in this turn: its owner has not run its clean-up yet.
                self._dequeue(head)
                continue
            if self._in_use + head.nbytes > self._capacity:
                break
            queue.granted(head)
            state = head.state
            self._left(state)
            head.future.set_result(self._take(state, head.nbytes, time.perf_counter()))
        self._publish()

    def _publish(self) -> None:
        self._gauges.publish(self._in_use, self._waiting)
