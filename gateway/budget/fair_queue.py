"""The order in which one process's media budget grants waiting requests: a fair queue on a virtual clock, in two
levels, and the per-tenant state it keeps, bounded in count.

Classes share the budget by weight: each tenant `limits.fairness.tenants` names is a class of its own, and every
other tenant together is the class `other` (its weight is `limits.fairness.default.weight`), so identities a client
mints share one class and buy no share from the configured tenants. Within a class its tenants share it equally.

Both levels order by virtual time, each band (interactive, batch) on clocks of its own. Between classes a request
costs its bytes times its class's expected hold of a grant (byte-seconds: an average of the holds of the class's
grants, from its first; until then every class's average); within a class, where every request has the same
expected hold, it costs its bytes. When a tenant's first waiting request of a band becomes its head, it starts at
the later of its class's virtual time and where its tenant's last grant finished, and finishes its bytes later: a
new tenant starts at the class's virtual time, where a tenant that was idle starts, never before what the class has
served. The class's head is its head with the least virtual finish (the earliest arrival on a tie) among its
tenants within their own `max_bytes_in_use`. A class starts waiting at the later of the band's virtual time and
where its last grant finished; the next grant goes to the class whose head would finish first (its start plus the
head's cost over the class weight). A grant moves the class's virtual time by its bytes over the number of the
class's waiting tenants (not behind the grant's start), and the band's by its cost over the waiting classes'
weights (not behind the earliest class start waiting on it). So a small request of an honest tenant goes before a
large one of a stranger, and a large one still goes once the clock passes it: nothing starves.

A tenant keeps a state while it holds or waits for bytes, and after that while its last grant finished ahead of its
class's virtual time (its lead), for at most `window_s`. When a class has nobody waiting in a band, its clock moves
past every finish it handed out, so no lead outlives contention. At most `max_tenants` states are kept: past it the
least recently active idle one is forgotten (counted in `evictions`); a tenant forgotten starts again as a new one.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from typing import Any

from gateway.budget.base import TenantSeries
from gateway.tenants import Tenant

INTERACTIVE, BATCH = 0, 1
BANDS = (INTERACTIVE, BATCH)
# What a grant is expected to hold its bytes for (seconds) before the first release of its class, and the weight of
# each release in the average.
INITIAL_HOLD_S = 1.0
HOLD_EWMA = 0.05
# Virtual finishes this close, relative to their size, are equal: they differ only by floating-point rounding.
FINISH_TIE = 1e-9
# Idle states looked at (and forgotten when their lead is gone or has run out) each time a state is made: the
# sweep keeps pace with the tenants that arrive.
_SWEEP_PER_STATE = 2


def finishes_first(finish: float, seq: int, other_finish: float, other_seq: int) -> bool:
    """Whether a head finishing at `finish` (arrived `seq`-th) goes before one finishing at `other_finish`. Finishes
    equal but for rounding (the same costs summed in another order, with a measured hold) are a tie, which goes to
    the earlier arrival; `lua/fair.lua` `next_head` decides alike."""
    if abs(finish - other_finish) <= FINISH_TIE * max(abs(finish), abs(other_finish)):
        return seq < other_seq
    return finish < other_finish


class TenantState:
    """One tenant: its queues (one per band, FIFO; made when it first waits), the bytes it holds, the requests it has
    waiting, where its last grant in each band finished, and when it was last active."""

    __slots__ = ("active_at", "cls", "finish", "in_use", "queues", "stats", "tenant", "waiting")

    def __init__(self, tenant: Tenant, cls: ClassState, stats: TenantSeries | None, now: float) -> None:
        self.tenant = tenant
        self.cls = cls
        self.stats = stats
        self.in_use = 0
        self.waiting = 0
        self.finish = [0.0, 0.0]
        self.queues: tuple[collections.deque[Waiter], collections.deque[Waiter]] | None = None
        self.active_at = now

    def fits_own_cap(self, nbytes: int) -> bool:
        cap = self.tenant.max_bytes_in_use
        return cap is None or self.in_use + nbytes <= cap

    def leads(self) -> bool:
        """Whether its last grant in a band finished ahead of its class's virtual time there."""
        cls = self.cls
        return self.finish[0] > cls.vtime[0] or self.finish[1] > cls.vtime[1]


class ClassState:
    """One class: its weight and expected hold, and in each band where it starts while it waits (None: nobody
    waits), where its last grant finished, its own virtual time, the latest finish it handed out, how many of its
    tenants wait, and their heads."""

    __slots__ = ("finish", "fmax", "heads", "hold_s", "label", "start", "tenants", "vtime", "weight")

    def __init__(self, label: str, weight: float) -> None:
        self.label = label
        self.weight = weight
        self.hold_s: float | None = None  # until its first release
        self.start: list[float | None] = [None, None]
        self.finish = [0.0, 0.0]
        self.vtime = [0.0, 0.0]
        self.fmax = [0.0, 0.0]
        self.tenants = [0, 0]
        # (virtual finish, arrival, waiter) of each waiting tenant's head; entries of heads that left are skipped.
        self.heads: tuple[list[tuple[float, int, Waiter]], list[tuple[float, int, Waiter]]] = ([], [])


class Waiter:
    """A request waiting for bytes: `future` gets its reservation. `start` and `finish` are its virtual times, set
    when it becomes its tenant's head."""

    __slots__ = ("band", "finish", "future", "nbytes", "seq", "start", "state", "timer")

    def __init__(self, nbytes: int, future: asyncio.Future[Any], state: TenantState, band: int, seq: int) -> None:
        self.nbytes = nbytes
        self.future = future
        self.state = state
        self.band = band
        self.seq = seq
        self.start = 0.0
        self.finish = 0.0
        self.timer: asyncio.TimerHandle | None = None


class FairQueue:
    """The waiting requests of one budget and the tenant states, as the module describes. `next()` answers the
    request the next grant goes to (or None); the budget decides whether it fits, and calls `granted` when it does."""

    def __init__(self, *, max_tenants: int, window_s: float) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self.window_s = window_s
        self.hold_s: float | None = None  # every class's grants together, until the first release
        self.evictions = 0
        # By last activity, the least recent first.
        self.tenants: dict[str, TenantState] = {}
        self._classes: dict[str, ClassState] = {}
        # The classes with someone waiting, per band.
        self._waiting: tuple[dict[str, ClassState], dict[str, ClassState]] = ({}, {})
        self._clock = [0.0, 0.0]
        self._fmax = [0.0, 0.0]
        self._seq = itertools.count()

    # -- tenant states ------------------------------------------------------------------------------------------

    def get(self, tenant_id: str) -> TenantState | None:
        return self.tenants.get(tenant_id)

    def add(self, tenant: Tenant, stats: TenantSeries | None, now: float) -> TenantState:
        """A state for a tenant that has none, active now (after a sweep, and an eviction at the cap)."""
        self._sweep(now)
        cls = self._classes.get(tenant.label)
        if cls is None:
            cls = self._classes[tenant.label] = ClassState(tenant.label, tenant.weight)
        state = self.tenants[tenant.id] = TenantState(tenant, cls, stats, now)
        return state

    def touch(self, state: TenantState, now: float) -> None:
        """The tenant is active now: the last to be forgotten."""
        state.active_at = now
        tenants, tenant_id = self.tenants, state.tenant.id
        if next(reversed(tenants)) != tenant_id:
            del tenants[tenant_id]
            tenants[tenant_id] = state

    def held(self, state: TenantState, held_s: float) -> None:
        """A grant of `state`'s tenant held its bytes `held_s` seconds: the expected holds follow."""
        cls = state.cls
        cls.hold_s = held_s if cls.hold_s is None else cls.hold_s + HOLD_EWMA * (held_s - cls.hold_s)
        self.hold_s = held_s if self.hold_s is None else self.hold_s + HOLD_EWMA * (held_s - self.hold_s)

    def _cost(self, cls: ClassState, nbytes: int) -> float:
        """What `nbytes` of the class cost between classes: bytes times its expected hold."""
        hold_s = cls.hold_s if cls.hold_s is not None else self.hold_s
        return nbytes * (hold_s if hold_s is not None else INITIAL_HOLD_S)

    def _sweep(self, now: float) -> None:
        """Forget the least recently active idle states whose lead is gone or older than `window_s` (a few), and
        then, at `max_tenants`, the least recently active idle ones. A busy state met on the way goes to the back:
        it is being used, and each one moves once a round however long it stays busy."""
        tenants = self.tenants
        looked, moved = 0, 0
        while looked < _SWEEP_PER_STATE and moved < len(tenants):
            tenant_id, state = next(iter(tenants.items()))
            if state.in_use or state.waiting:
                del tenants[tenant_id]
                tenants[tenant_id] = state
                moved += 1
                continue
            looked += 1
            if state.leads() and now - state.active_at < self.window_s:
                break
            del tenants[tenant_id]
        moved = 0
        while len(tenants) >= self.max_tenants and moved < len(tenants):
            tenant_id, state = next(iter(tenants.items()))
            del tenants[tenant_id]
            if state.in_use or state.waiting:
                tenants[tenant_id] = state
                moved += 1
            else:
                self.evictions += 1

    # -- the queue ----------------------------------------------------------------------------------------------

    def push(self, nbytes: int, future: asyncio.Future[Any], state: TenantState, band: int) -> Waiter:
        """Queue a request of `state`'s tenant in `band` (its class takes the weight its tenant says now)."""
        waiter = Waiter(nbytes, future, state, band, next(self._seq))
        if state.queues is None:
            state.queues = (collections.deque(), collections.deque())
        queue = state.queues[band]
        queue.append(waiter)
        state.cls.weight = state.tenant.weight
        if len(queue) == 1:
            self._make_head(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take a request that did not get its bytes out of the queue; false when it was not in it."""
        queues = waiter.state.queues
        if queues is None:
            return False
        queue = queues[waiter.band]
        if queue and queue[0] is waiter:
            queue.popleft()
            self._head_left(waiter)
            return True
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        return True

    def next(self) -> Waiter | None:
        """The request the next grant goes to: in the first band with a class whose head is within its tenant's
        cap, the head of the class that would finish first (the earliest arrival on a tie)."""
        for band in BANDS:
            waiting = self._waiting[band]
            if not waiting:
                continue
            earliest = min(cls.start[band] or 0.0 for cls in waiting.values())
            if earliest > self._clock[band]:
                self._clock[band] = earliest
            best: Waiter | None = None
            best_finish = 0.0
            for cls in list(waiting.values()):
                head = self._head(cls, band)
                start = cls.start[band]
                if head is None or start is None:
                    continue
                finish = start + self._cost(cls, head.nbytes) / cls.weight
                if best is None or finishes_first(finish, head.seq, best_finish, best.seq):
                    best, best_finish = head, finish
            if best is not None:
                return best
        return None

    def granted(self, waiter: Waiter) -> None:
        """`waiter`, the one `next()` answered, got its bytes: it leaves the queue and the clocks move."""
        state, band = waiter.state, waiter.band
        cls = state.cls
        start = cls.start[band]
        assert start is not None
        assert state.queues is not None
        state.finish[band] = waiter.finish
        cls.vtime[band] = max(cls.vtime[band] + waiter.nbytes / cls.tenants[band], waiter.start)
        weights = sum(each.weight for each in self._waiting[band].values())
        cost = self._cost(cls, waiter.nbytes)
        cls.finish[band] = start + cost / cls.weight
        self._fmax[band] = max(self._fmax[band], cls.finish[band])
        self._clock[band] += cost / weights
        state.queues[band].popleft()
        self._head_left(waiter)
        if cls.start[band] is not None:
            cls.start[band] = max(self._clock[band], cls.finish[band])

    def _make_head(self, waiter: Waiter) -> None:
        state, band = waiter.state, waiter.band
        cls = state.cls
        if cls.start[band] is None:
            cls.start[band] = max(self._clock[band], cls.finish[band])
            self._waiting[band][cls.label] = cls
        waiter.start = max(cls.vtime[band], state.finish[band])
        waiter.finish = waiter.start + waiter.nbytes
        cls.fmax[band] = max(cls.fmax[band], waiter.finish)
        cls.tenants[band] += 1
        heapq.heappush(cls.heads[band], (waiter.finish, waiter.seq, waiter))

    def _head_left(self, waiter: Waiter) -> None:
        """`waiter`, its tenant's head, has left the queue: the next request of the tenant becomes its head; with
        none in the class, the class stops waiting and its clock moves past every finish it handed out."""
        state, band = waiter.state, waiter.band
        cls = state.cls
        cls.tenants[band] -= 1
        assert state.queues is not None
        queue = state.queues[band]
        if queue:
            self._make_head(queue[0])
        elif not cls.tenants[band]:
            cls.start[band] = None
            cls.heads[band].clear()
            cls.vtime[band] = max(cls.vtime[band], cls.fmax[band])
            del self._waiting[band][cls.label]
            if not self._waiting[band]:
                self._clock[band] = max(self._clock[band], self._fmax[band])

    def _head(self, cls: ClassState, band: int) -> Waiter | None:
        """The class's head with the least virtual finish whose tenant is within its own cap."""
        heads = cls.heads[band]
        passed: list[tuple[float, int, Waiter]] = []
        found: Waiter | None = None
        while heads:
            entry = heads[0]
            waiter = entry[2]
            queues = waiter.state.queues
            if queues is None or not queues[band] or queues[band][0] is not waiter:
                heapq.heappop(heads)  # it left the queue
                continue
            if waiter.state.fits_own_cap(waiter.nbytes):
                found = waiter
                break
            passed.append(heapq.heappop(heads))
        for entry in passed:
            heapq.heappush(heads, entry)
        return found
