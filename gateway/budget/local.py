"""The in-process media budget (one gateway worker), and the budget that is off."""

from __future__ import annotations

import asyncio
import collections
import math
import time

from gateway.budget.base import (
    DEFAULT_TENANT,
    MEDIA_BUDGET,
    BudgetGauges,
    BudgetName,
    Reservation,
    Tenant,
    TenantClasses,
    TenantSeries,
    queue_full,
    retry_after_s,
    wait_timed_out,
)
from gateway.config import Band
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics

# Service (bytes x seconds held) older than this many seconds counts 1/e as much: least-attained service over a
# sliding window.
DEFAULT_WINDOW_S = 60.0
# Before the first release, what a grant is expected to hold its bytes for (seconds).
_INITIAL_HOLD_S = 1.0
_HOLD_EWMA = 0.05
# Idle tenants whose decayed service is below this (byte-seconds) are forgotten.
_FORGET_BELOW = 1.0
_SWEEP_AT = 1024
_INTERACTIVE, _BATCH = 0, 1


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


class _TenantState:
    """One tenant's queues (one per band, FIFO), the bytes it holds and its decayed service."""

    __slots__ = ("in_use", "queues", "service", "stamp", "stats", "tenant", "waiting")

    def __init__(self, tenant: Tenant, stats: TenantSeries | None, now: float) -> None:
        self.tenant = tenant
        self.stats = stats
        self.queues: tuple[collections.deque[_Waiter], collections.deque[_Waiter]] = (
            collections.deque(),
            collections.deque(),
        )
        self.in_use = 0
        self.waiting = 0
        self.service = 0.0
        self.stamp = now

    def settle(self, now: float, window_s: float) -> None:
        """Bring `service` to `now`: dS/dt = in_use - S / window, exactly, `in_use` being constant since `stamp`."""
        elapsed = now - self.stamp
        if elapsed > 0:
            decay = math.exp(-elapsed / window_s)
            self.service = self.service * decay + self.in_use * window_s * (1.0 - decay)
            self.stamp = now

    def fits_own_cap(self, nbytes: int) -> bool:
        cap = self.tenant.max_bytes_in_use
        return cap is None or self.in_use + nbytes <= cap


class _Waiter:
    __slots__ = ("band", "future", "nbytes", "state", "timer")

    def __init__(self, nbytes: int, future: asyncio.Future[Reservation], state: _TenantState, band: int) -> None:
        self.nbytes = nbytes
        self.future = future
        self.state = state
        self.band = band
        self.timer: asyncio.TimerHandle | None = None


class _Hold:
    """What one grant's `Reservation` gives its bytes back to: its tenant, and when it was granted."""

    __slots__ = ("budget", "granted", "state")

    def __init__(self, budget: LocalBudget, state: _TenantState, granted: float) -> None:
        self.budget = budget
        self.state = state
        self.granted = granted

    def _give_back(self, nbytes: int) -> None:
        self.budget._release(self.state, nbytes, self.granted)


class LocalBudget:
    """Byte budget for one event loop, queued fairly between tenants.

    With one tenant in one band it is FIFO: the head of the queue is served first even when a later, smaller
    request would fit (no overtaking, so a large request is never starved). With several, when requests wait the
    next grant goes to the head of the tenant with the least weighted service, service being the bytes it held
    times the seconds it held them, decayed over `window_s` (plus what its current grants are expected to hold),
    divided by its weight; within a tenant FIFO. Nothing overtakes that head (as in FIFO, so it is never starved),
    except requests of tenants it has less service than, which it is ahead of anyway. A tenant at its own
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
        one_tenant: bool = False,
    ) -> None:
        """`metrics`: the media budget's gauges and per-tenant series; `gauges` another budget's (`name` says which
        budget it is). `batch_timeout_s`: the admission timeout of the batch band. `one_tenant`: every reservation
        is the default tenant's (a FIFO queue), so no service is kept for sharing."""
        self.capacity: int | None = capacity
        self._capacity = capacity
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.max_queued = max_queued
        self.name = name
        self.window_s = window_s
        self._keeps_service = not one_tenant
        self._gauges = gauges if gauges is not None else BudgetGauges.media(metrics)
        self._gauges.capacity(capacity)
        self._gauges.publish(0, 0)
        self._in_use = 0
        self._waiting = 0
        self._hold_s = _INITIAL_HOLD_S
        self._tenants: dict[str, _TenantState] = {}
        self._classes = TenantClasses(metrics)
        # Tenants with a waiter in each band.
        self._queued: tuple[dict[str, _TenantState], dict[str, _TenantState]] = ({}, {})
        self._sweep_at = _SWEEP_AT

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return self._waiting

    def tenant_in_use(self, tenant_id: str) -> int:
        state = self._tenants.get(tenant_id)
        return 0 if state is None else state.in_use

    def tenant_service(self, tenant_id: str) -> float:
        """The tenant's decayed bytes x seconds, now."""
        state = self._tenants.get(tenant_id)
        if state is None:
            return 0.0
        state.settle(time.perf_counter(), self.window_s)
        return state.service

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
        reservation = self.try_reserve(nbytes, tenant=tenant)
        if reservation is not None:
            return reservation
        now = time.perf_counter()
        state = self._state(tenant, now)
        if self.max_queued is not None and self._waiting >= self.max_queued:
            raise queue_full(self._waiting, self.max_queued, self.timeout_s, self.name)
        if tenant.max_waiting is not None and state.waiting >= tenant.max_waiting:
            raise RateLimited(
                f"{state.waiting:,} requests of this tenant are already waiting for {self.name.subject} "
                f"({tenant.settings_key}.max_waiting={tenant.max_waiting:,})",
                retry_after_s=retry_after_s(self.timeout_s),
                reason="tenant_cap",
            )
        loop = asyncio.get_running_loop()
        index = _BATCH if band is Band.BATCH else _INTERACTIVE
        waiter = _Waiter(nbytes, loop.create_future(), state, index)
        timeout_s = self.batch_timeout_s if index == _BATCH else self.timeout_s
        if timeout_s is not None:
            waiter.timer = loop.call_later(timeout_s, self._expire, waiter, timeout_s)
        self._enqueue(waiter)
        self._grant()
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
            waited = time.perf_counter() - started
            self._gauges.observe_wait(waited)
            if state.stats is not None:
                state.stats.wait.observe(waited)

    def try_reserve(self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT) -> Reservation | None:
        """`nbytes` taken for `tenant` at once when they are free and nobody waits (a wait of zero); else None, and
        nothing is taken. Without an await: a caller that would not wait skips the machinery of `reserve`."""
        if self._waiting or self._in_use + nbytes > self._capacity:
            return None
        now = time.perf_counter()
        state = self._state(tenant, now)
        if not state.fits_own_cap(nbytes):
            return None
        reservation = self._take(state, nbytes, now)
        self._gauges.observe_wait(0.0)
        if state.stats is not None:
            state.stats.wait.observe(0.0)
        return reservation

    # -- tenants ------------------------------------------------------------------------------------------------

    def _state(self, tenant: Tenant, now: float) -> _TenantState:
        state = self._tenants.get(tenant.id)
        if state is None:
            if len(self._tenants) >= self._sweep_at:
                self._sweep(now)
            state = self._tenants[tenant.id] = _TenantState(tenant, self._classes.get(tenant.label), now)
        return state

    def _sweep(self, now: float) -> None:
        """Forget idle tenants whose service has decayed away (a tenant seen again starts from none)."""
        for tenant_id, state in list(self._tenants.items()):
            if state.in_use == 0 and state.waiting == 0:
                state.settle(now, self.window_s)
                if state.service < _FORGET_BELOW:
                    del self._tenants[tenant_id]
        self._sweep_at = max(_SWEEP_AT, 2 * len(self._tenants))

    # -- the queue ----------------------------------------------------------------------------------------------

    def _enqueue(self, waiter: _Waiter) -> None:
        state = waiter.state
        state.queues[waiter.band].append(waiter)
        self._queued[waiter.band][state.tenant.id] = state
        state.waiting += 1
        self._waiting += 1
        stats = state.stats
        if stats is not None:
            stats.add_waiting(1)
        self._publish()

    def _dequeue(self, waiter: _Waiter) -> bool:
        """Take `waiter` out of its queue; false when it was not in it."""
        state = waiter.state
        queue = state.queues[waiter.band]
        if queue and queue[0] is waiter:
            queue.popleft()
        else:
            try:
                queue.remove(waiter)
            except ValueError:
                return False
        self._left_queue(state, waiter.band)
        return True

    def _left_queue(self, state: _TenantState, band: int) -> None:
        if not state.queues[band]:
            del self._queued[band][state.tenant.id]
        state.waiting -= 1
        self._waiting -= 1
        stats = state.stats
        if stats is not None:
            stats.add_waiting(-1)

    def _expire(self, waiter: _Waiter, timeout_s: float) -> None:
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

    def _abandon(self, waiter: _Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                # Granted in the same turn as it was given up: hand the bytes straight back.
                future.result().release()
            return
        future.cancel()
        if self._dequeue(waiter):
            self._grant()

    def _take(self, state: _TenantState, nbytes: int, now: float) -> Reservation:
        if self._keeps_service:
            state.settle(now, self.window_s)
        state.in_use += nbytes
        self._in_use += nbytes
        stats = state.stats
        if stats is not None:
            stats.take(nbytes)
        self._publish()
        return Reservation(_Hold(self, state, now), nbytes)

    def _release(self, state: _TenantState, nbytes: int, granted: float) -> None:
        stats = state.stats
        if self._keeps_service or stats is not None:
            now = time.perf_counter()
            held = now - granted
            if self._keeps_service:
                self._hold_s += _HOLD_EWMA * (held - self._hold_s)
                state.settle(now, self.window_s)
            if stats is not None:
                stats.give_back(nbytes, held)
        state.in_use -= nbytes
        self._in_use -= nbytes
        self._grant()

    def _head(self, state: _TenantState, band: int) -> _Waiter | None:
        """The tenant's first live waiter in `band`; waiters cancelled in this turn (their owner has not run its
        clean-up yet) leave the queue here."""
        queue = state.queues[band]
        while queue:
            head = queue[0]
            if not head.future.done():
                return head
            queue.popleft()
            self._left_queue(state, band)
        return None

    def _next(self, now: float) -> _Waiter | None:
        """The request the next grant goes to, or None: the band first, then the tenant with the least weighted
        service among those whose head is within their own cap."""
        for band in (_INTERACTIVE, _BATCH):
            queued = self._queued[band]
            if not queued:
                continue
            if len(queued) == 1:
                (state,) = queued.values()
                head = self._head(state, band)
                if head is not None and state.fits_own_cap(head.nbytes):
                    return head
                continue
            best: _Waiter | None = None
            best_key = math.inf
            for state in list(queued.values()):
                head = self._head(state, band)
                if head is None or not state.fits_own_cap(head.nbytes):
                    continue
                state.settle(now, self.window_s)
                key = (state.service + state.in_use * self._hold_s) / state.tenant.weight
                if key < best_key:
                    best, best_key = head, key
            if best is not None:
                return best
        return None

    def _grant(self) -> None:
        if self._waiting:
            now = time.perf_counter()
            while self._waiting:
                head = self._next(now)
                if head is None or self._in_use + head.nbytes > self._capacity:
                    break
                state = head.state
                state.queues[head.band].popleft()
                self._left_queue(state, head.band)
                head.future.set_result(self._take(state, head.nbytes, now))
        self._publish()

    def _publish(self) -> None:
        self._gauges.publish(self._in_use, self._waiting)
