"""The lease keeper: renews this process's leases and tickets every `lease_ttl_s / 3`, so those of a process that
dies come back once its last renewal runs out; wakes when the earliest lease or ticket in Redis is due to expire
while this process has waiters (a lost grant message, a dead process's bytes); queues again a ticket Redis lost;
probes Redis while the budget serves from its local fallback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.budget.base import retry_after_s
from gateway.budget.redis.background import Background
from gateway.budget.redis.client import BudgetMisconfigured, ScriptClient, Unavailable
from gateway.budget.redis.fallback import Fallback
from gateway.budget.redis.leases import Holdings, Waiter
from gateway.budget.redis.members import Members
from gateway.budget.redis.releases import Releases
from gateway.budget.redis.scripts import GRANTED, OWN, QUEUED, TENANT_FULL
from gateway.errors import RateLimited

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Keeps what this process holds and waits for alive in Redis; `wake` makes it look again at once. A requeued
    ticket that finds the queue full is refused with `max_queued` and `timeout_s` (`limits.max_queued_requests`,
    `limits.admission_timeout_s`)."""

    __slots__ = (
        "_background",
        "_client",
        "_fallback",
        "_holdings",
        "_members",
        "_redis",
        "_releases",
        "interval_s",
        "last_beat",
        "lease_ttl_s",
        "max_queued",
        "probe_interval_s",
        "timeout_s",
        "wake",
    )

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        client: ScriptClient,
        holdings: Holdings,
        releases: Releases,
        fallback: Fallback,
        members: Members,
        background: Background,
        lease_ttl_s: float,
        max_queued: int | None,
        timeout_s: float | None,
    ) -> None:
        self._redis = redis
        self._client = client
        self._holdings = holdings
        self._releases = releases
        self._fallback = fallback
        self._members = members
        self._background = background
        self.lease_ttl_s = lease_ttl_s
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.interval_s = lease_ttl_s / 3
        self.probe_interval_s = min(1.0, self.interval_s)
        self.wake = asyncio.Event()
        self.last_beat = -math.inf

    async def run(self) -> None:
        """Renew, or probe while degraded, each time it is due."""
        loop = asyncio.get_running_loop()
        background, fallback = self._background, self._fallback
        while not background.closed:  # also ends a loop whose cancellation a redis-py call lost
            if fallback.degraded:
                due = self.last_beat + self.probe_interval_s
            else:
                due = self.last_beat + self.interval_s
                next_expiry_at = self._client.next_expiry_at
                if self._holdings.waiters and next_expiry_at is not None:
                    due = min(due, next_expiry_at)
            delay = due - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), timeout=delay)
                self.wake.clear()
                continue
            self.last_beat = loop.time()
            if fallback.degraded:
                await self.probe()
            else:
                await self.beat()
                with contextlib.suppress(RedisError, OSError):
                    await self._members.register()
            self._holdings.publish()

    async def probe(self) -> None:
        try:
            started = time.perf_counter()
            await self._redis.ping()
            self._client.meters.round_trip("ping", time.perf_counter() - started)
        except (RedisError, OSError):
            self._client.meters.stats.backend_errors += 1
            return
        self._client.backend_ok = True
        self._fallback.recover()
        self.last_beat = -math.inf  # renew at once

    async def beat(self) -> None:
        """Renew the leases (re-asserting them when Redis lost the state) and refresh the queued tickets; hand over
        what Redis granted, queue again what it lost, and retry the releases it did not answer."""
        holdings, client = self._holdings, self._client
        leases = [lease for lease in holdings.leases.values() if not lease.lost]
        held = [part for lease in leases for part in (lease.lease_id, lease.nbytes, lease.tenant_id)]
        tickets = [waiter.ticket for waiter in holdings.waiters.values() if waiter.queued]
        try:
            reply = await client.call("heartbeat", len(leases), *held, *tickets)
        except Unavailable as exc:
            self.backend_failed(exc)
            return
        except BudgetMisconfigured:
            return  # logged; every call keeps failing until the caps agree
        # The leases named the epoch this process knew; Redis re-asserted them under the one it has now.
        client.reasserted(str(reply[5]))
        renewed, reasserted, lost, granted, missing = reply[OWN : OWN + 5]
        stats = client.meters.stats
        stats.lease_renewals += int(renewed)
        stats.leases_reasserted += int(reasserted)
        for lease_id in lost:
            lease = holdings.leases.get(lease_id)
            if lease is not None and not lease.lost:
                lease.lost = True
                stats.leases_lost += 1
        for ticket in granted:
            waiter = holdings.waiters.get(ticket)
            if waiter is not None:
                holdings.hand_over(waiter, by_message=False)
        for ticket in missing:
            waiter = holdings.waiters.get(ticket)
            if waiter is not None and not waiter.future.done():
                self._background.spawn(self.requeue(waiter))
        if self._releases.unreleased:
            await self._releases.retry()

    async def requeue(self, waiter: Waiter) -> None:
        """The waiter's ticket expired in Redis (this process stalled past the TTL, or Redis lost its data): queue
        it again at the back under a new id."""
        holdings = self._holdings
        old = waiter.ticket
        holdings.waiters.pop(old, None)
        waiter.ticket = holdings.new_id()
        waiter.queued = False
        holdings.waiters[waiter.ticket] = waiter
        self._background.spawn(self._client.abandon(old))
        max_queued = -1 if self.max_queued is None else self.max_queued
        try:
            reply = await self._client.call("reserve", waiter.ticket, waiter.nbytes, max_queued, waiter.who)
        except Unavailable as exc:
            waiter.queued = True  # let the failure handling move or refuse it
            self.backend_failed(exc)
            return
        except BudgetMisconfigured as exc:
            holdings.waiters.pop(waiter.ticket, None)
            if not waiter.future.done():
                waiter.future.set_exception(exc)
            return
        status = int(reply[OWN])
        if status == GRANTED:
            holdings.hand_over(waiter, by_message=False)
        elif status == QUEUED:
            waiter.queued = True
        elif not waiter.future.done():
            holdings.waiters.pop(waiter.ticket, None)
            bound = (
                f"{waiter.tenant.settings_key}.max_waiting={waiter.tenant.max_waiting}"
                if status == TENANT_FULL
                else f"limits.max_queued_requests={self.max_queued}"
            )
            waiter.future.set_exception(
                RateLimited(
                    f"lost its place in the media budget's queue and the queue is full ({bound})",
                    retry_after_s=retry_after_s(self.timeout_s),
                    reason="tenant_cap" if status == TENANT_FULL else "queue_full",
                )
            )

    def backend_failed(self, exc: Unavailable) -> None:
        """Redis did not answer: move this process's waiters to the fallback, or refuse them."""
        if self._fallback.degrade(exc):
            self.wake.set()
        self._fallback.turn_away(exc, self._holdings.waiters)
        self._holdings.publish()

    def state_lost(self) -> None:
        """A reply named another epoch: Redis lost the state, so renew (and re-assert the leases) at once."""
        logger.warning(
            "the shared media budget's Redis at %s lost its state (a restart or a flush): re-asserting the "
            "%d leases this process holds; nothing is granted for redis.lease_ttl_s=%g s while every "
            "gateway does the same",
            self._client.safe_url,
            len(self._holdings.leases),
            self.lease_ttl_s,
        )
        self.last_beat = -math.inf
        self.wake.set()
