"""`RedisBudget`: the `MediaBudget` shared through Redis, made of the script client, the lease keeper, the grant
listener, the local fallback and the metrics of this package; what it does itself is reserve, wait and abandon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.budget.base import SHARED_MEDIA_BUDGET, Reservation, queue_full, retry_after_s, wait_timed_out
from gateway.budget.redis.background import Background
from gateway.budget.redis.client import BudgetBackendUnavailable, BudgetMisconfigured, ScriptClient, Unavailable
from gateway.budget.redis.fallback import BackendLost, Fallback
from gateway.budget.redis.keeper import LeaseKeeper
from gateway.budget.redis.leases import Holdings, Waiter
from gateway.budget.redis.listener import GrantListener
from gateway.budget.redis.members import Members
from gateway.budget.redis.metrics import Meters, RedisBudgetStats
from gateway.budget.redis.releases import Releases
from gateway.budget.redis.scripts import (
    BANDS,
    GONE,
    GRANTED,
    KEY_NAMES,
    OWN,
    QUEUE_FULL,
    SCRIPTS,
    TENANT_FULL,
    key_base,
)
from gateway.budget.redis_pipeline import ScriptRunner
from gateway.config import Band, OnUnavailable
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from gateway.tenants import DEFAULT_MAX_TENANTS, DEFAULT_TENANT, DEFAULT_WINDOW_S, Tenant


class _TimedOut(Exception):
    """Set on a waiter whose admission timeout passed: its abandon call says which 429 it gets."""


def _redact(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    netloc = f"{parts.username}:***@{netloc}" if parts.username else f":***@{netloc}"
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _pool(url: str, socket_timeout_s: float) -> aioredis.BlockingConnectionPool:
    """The connections of the grant listener and the pings; the scripts' connection is made like them."""
    return aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=2,  # the grant listener's, and one for a ping
        timeout=2 * socket_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), 1),
        decode_responses=True,
    )


class RedisBudget:
    """Media budget shared through Redis by every process with the same `key_prefix`, queued fairly between
    tenants.

    `in_use` and `waiting` are what this process holds and has waiting; `cluster_in_use` and `cluster_waiting`
    are the whole cluster's, as of this process's last round trip (`refresh()` makes one). `max_queued` bounds the
    cluster's queue, a tenant's `max_waiting` its tickets in the cluster, its `max_bytes_in_use` its leases in the
    cluster. `batch_timeout_s` is the batch band's admission timeout, `window_s` how long an idle tenant's lead is
    kept, `max_tenants` how many tenant records (every process of a prefix should have the same). All calls must
    come from the event loop that first used the budget.
    """

    def __init__(
        self,
        *,
        url: str,
        capacity: int,
        timeout_s: float | None,
        max_queued: int | None,
        key_prefix: str = "mmgate:budget",
        lease_ttl_s: float = 10.0,
        on_unavailable: OnUnavailable = OnUnavailable.REJECT,
        expected_replicas: int = 1,
        socket_timeout_s: float = 1.0,
        metrics: GatewayMetrics | None = None,
        on_round_trip: Callable[[str, float], None] | None = None,
        batch_timeout_s: float | None = None,
        window_s: float = DEFAULT_WINDOW_S,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        member: str = "",
        fronts: str = "",
    ) -> None:
        _check(capacity, lease_ttl_s, on_unavailable, expected_replicas, window_s, max_tenants)
        self.capacity: int | None = capacity
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.window_s = window_s
        self.max_tenants = max_tenants
        self.max_queued = max_queued
        self.url = url
        self.key_prefix = key_prefix
        self.lease_ttl_s = lease_ttl_s
        self.meters = Meters(metrics, capacity, on_round_trip)
        base = key_base(key_prefix)
        self.base = base
        self.keys = {name: f"{base}:{name}" for name in KEY_NAMES}
        safe_url = _redact(url)
        self._pool = _pool(url, socket_timeout_s)
        self._redis = aioredis.Redis(connection_pool=self._pool)
        # The scripts run pipelined on a connection of their own; the pool serves the grant listener and pings.
        self.client = ScriptClient(
            ScriptRunner(self._pool, SCRIPTS, base),
            capacity=capacity,
            key_prefix=key_prefix,
            safe_url=safe_url,
            lease_ttl_s=lease_ttl_s,
            socket_timeout_s=socket_timeout_s,
            window_s=window_s,
            max_tenants=max_tenants,
            meters=self.meters,
            on_state_lost=self._state_lost,
        )
        self.fallback = Fallback(
            on_unavailable,
            capacity=capacity,
            expected_replicas=expected_replicas,
            timeout_s=timeout_s,
            max_queued=max_queued,
            batch_timeout_s=batch_timeout_s,
            window_s=window_s,
            max_tenants=max_tenants,
            safe_url=safe_url,
            meters=self.meters,
        )
        self.background = Background()
        process = uuid.uuid4().hex[:12]
        releases = Releases(self.client, self.background)
        self.holdings = Holdings(process, self.meters, releases, self.fallback.budget)
        # What this process says of itself to the others sharing the budget (who it is, the model server it
        # fronts), and what they said at its last call.
        self.members = Members(
            self._redis,
            base,
            process,
            f"{member or f'pid {os.getpid()}'} -> {fronts or '?'}",
            self.client.ttl_ms,
            self.meters,
        )
        self.keeper = LeaseKeeper(
            redis=self._redis,
            client=self.client,
            holdings=self.holdings,
            releases=releases,
            fallback=self.fallback,
            members=self.members,
            background=self.background,
            lease_ttl_s=lease_ttl_s,
            max_queued=max_queued,
            timeout_s=timeout_s,
        )
        self.listener = GrantListener(
            self._redis,
            f"{base}:granted",
            holdings=self.holdings,
            background=self.background,
            stats=self.meters.stats,
            max_backoff_s=self.keeper.probe_interval_s,
        )
        self._running: tuple[asyncio.Task[None], asyncio.Task[None]] | None = None

    # -- what the reporter, /readyz and the tests read -------------------------------------------------------------

    @property
    def safe_url(self) -> str:
        """`url` without its password, for logs and `/readyz`."""
        return self.client.safe_url

    @property
    def stats(self) -> RedisBudgetStats:
        return self.meters.stats

    @property
    def fallback_capacity(self) -> int:
        return self.fallback.capacity

    @property
    def backend_degraded(self) -> bool:
        """Serving from the local fallback (`on_unavailable="local"`)."""
        return self.fallback.degraded

    @property
    def backend_ok(self) -> bool:
        """The last call to Redis answered."""
        return self.client.backend_ok

    @property
    def misconfigured(self) -> str | None:
        """The cap mismatch, while Redis reports one."""
        return self.client.misconfigured

    @property
    def cluster_in_use(self) -> int:
        return self.client.cluster_in_use

    @property
    def cluster_waiting(self) -> int:
        return self.client.cluster_waiting

    @property
    def cluster_tenants(self) -> int:
        """Tenant records in Redis."""
        return self.client.cluster_tenants

    @property
    def member(self) -> str:
        return self.members.member

    @property
    def sharing(self) -> list[str]:
        return self.members.sharing

    def tenant_queue_key(self, tenant_id: str, band: Band = Band.INTERACTIVE) -> str:
        """The name of the sorted set of `tenant_id`'s tickets in `band`."""
        return f"{self.base}:q:{BANDS[band]}:{tenant_id}"

    # -- the MediaBudget contract ------------------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        """Bytes this process holds (shared leases and, after a fallback, local reservations)."""
        return self.holdings.in_use

    @property
    def waiting(self) -> int:
        """Requests of this process waiting for the budget."""
        return self.holdings.waiting

    async def reserve(
        self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT, band: Band = Band.INTERACTIVE
    ) -> Reservation:
        """Queued fairly with every gateway's requests: by `tenant` (its id, weight and bounds) within `band`."""
        self._check_fits(nbytes, tenant)
        if self.background.closed:
            raise BudgetBackendUnavailable("the shared media budget is closed", reason="budget_unavailable")
        self._run_background()
        if self.fallback.degraded:
            return await self.fallback.reserve(nbytes, tenant, band)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        timeout_s = self.batch_timeout_s if band is Band.BATCH else self.timeout_s
        waiter = Waiter(self.holdings.new_id(), nbytes, loop.create_future(), tenant, band, timeout_s)
        series = self.meters.classes.get(tenant.label)
        counted = False
        # Registered before the script runs: a grant message may arrive before the script's answer.
        self.holdings.waiters[waiter.ticket] = waiter
        try:
            try:
                status, mine = await self._enqueue(waiter)
            except Unavailable as exc:
                self.holdings.waiters.pop(waiter.ticket, None)
                return await self._when_unavailable(exc, nbytes, tenant, band)
            if status != GRANTED:
                self._refuse(waiter, status, mine)
                waiter.queued = True
                if series is not None:
                    series.add_waiting(1)
                    counted = True
                if timeout_s is not None and not waiter.future.done():
                    remaining = max(0.0, timeout_s - (time.perf_counter() - started))
                    waiter.timer = loop.call_later(remaining, self._expire, waiter)
                self.keeper.wake.set()
            self.holdings.publish()
            return await self._wait(waiter)
        finally:
            waited = time.perf_counter() - started
            self.meters.gauges.observe_wait(waited)
            if series is not None:
                if counted:
                    series.add_waiting(-1)
                series.wait.observe(waited)

    # -- life cycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check that Redis answers and listen for grants; raise `BudgetBackendUnavailable` naming the URL if not,
        `BudgetMisconfigured` when the budget in Redis has another cap."""
        try:
            started = time.perf_counter()
            await self._redis.ping()
            self.meters.round_trip("ping", time.perf_counter() - started)
        except (RedisError, OSError) as exc:
            self.meters.stats.backend_errors += 1
            self.client.backend_ok = False
            raise BudgetBackendUnavailable(
                f"cannot reach the shared media budget's Redis at {self.safe_url}: {exc}"
            ) from exc
        self._run_background()
        try:
            await asyncio.wait_for(self.listener.subscribed.wait(), timeout=max(2.0, 4 * self.keeper.probe_interval_s))
        except TimeoutError as exc:
            raise BudgetBackendUnavailable(
                f"cannot subscribe to {self.listener.channel} on the shared media budget's Redis at {self.safe_url}"
            ) from exc
        await self.refresh()
        if self.misconfigured is not None:
            raise BudgetMisconfigured(self.misconfigured)
        await self.members.register()
        self.members.announce(self.keys["meta"].removesuffix(":meta"), self.safe_url)

    async def refresh(self) -> None:
        """One round trip that reaps, grants and updates `cluster_in_use` / `cluster_waiting`."""
        try:
            await self.client.call("snapshot")
        except Unavailable as exc:
            self.keeper.backend_failed(exc)
        except BudgetMisconfigured:
            pass  # logged, and kept in `misconfigured`

    async def flush(self) -> None:
        """Wait for the releases and abandons sent in the background so far."""
        await self.background.flush()

    async def aclose(self) -> None:
        """Stop renewing and listening, send what is pending, and close the connections. Leases still held expire."""
        if self.background.closed:
            return
        self.background.closed = True
        if self._running is not None:
            for task in self._running:
                task.cancel()
            await asyncio.gather(*self._running, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout=max(1.0, 2 * self.keeper.interval_s))
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.members.register(leaving=True), timeout=max(1.0, self.keeper.interval_s))
        waiters = self.holdings.waiters
        for waiter in list(waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(
                    BudgetBackendUnavailable("the shared media budget is closing", reason="budget_unavailable")
                )
        waiters.clear()
        await self.client.scripts.aclose()
        await self._redis.aclose()
        await self._pool.aclose()

    # -- internals ---------------------------------------------------------------------------------------------

    def _run_background(self) -> None:
        if self._running is not None or self.background.closed:
            return
        loop = self.background.loop = asyncio.get_running_loop()
        self._running = (
            loop.create_task(self.keeper.run(), name="redis-budget-keeper"),
            loop.create_task(self.listener.run(), name="redis-budget-listener"),
        )

    def _state_lost(self) -> None:
        self.keeper.state_lost()

    def _check_fits(self, nbytes: int, tenant: Tenant) -> None:
        capacity = self.client.capacity
        if nbytes > capacity:
            raise ValueError(f"reservation of {nbytes:,} bytes can never fit a budget of {capacity:,}")
        own_cap = tenant.max_bytes_in_use
        if own_cap is not None and nbytes > own_cap:
            raise RateLimited(
                f"{nbytes:,} bytes of {SHARED_MEDIA_BUDGET.subject} can never fit "
                f"{tenant.settings_key}.max_bytes_in_use={own_cap:,}",
                retry_after_s=retry_after_s(self.timeout_s),
                reason="tenant_cap",
            )

    async def _enqueue(self, waiter: Waiter) -> tuple[int, list[Any]]:
        """Run the reserve script for the waiter: its status, and the script's own answers; a grant is handed over.
        Cancelled once the script was sent, it may queue or grant the id: the abandon is written after it on the
        same connection, so Redis runs it after; on another connection, its tombstone turns a reserve that arrives
        later into a no-op."""
        max_queued = -1 if self.max_queued is None else self.max_queued
        try:
            reply = await self.client.call("reserve", waiter.ticket, waiter.nbytes, max_queued, waiter.who)
        except Unavailable:
            raise
        except BaseException:
            await self._abandon(waiter)
            raise
        status = int(reply[OWN])
        if status == GRANTED:
            self.holdings.hand_over(waiter, by_message=None)
        return status, reply[OWN:]

    def _refuse(self, waiter: Waiter, status: int, mine: list[Any]) -> None:
        """Raise the refusal the reserve script answered, if it did."""
        if status not in (QUEUE_FULL, GONE, TENANT_FULL):
            return
        self.holdings.waiters.pop(waiter.ticket, None)
        if status == QUEUE_FULL:
            raise queue_full(self.cluster_waiting, self.max_queued, self.timeout_s, SHARED_MEDIA_BUDGET)
        if status == GONE:
            raise BudgetBackendUnavailable(f"the shared media budget at {self.safe_url} refused a fresh ticket")
        tenant = waiter.tenant
        raise RateLimited(
            f"{int(mine[1]):,} requests of this tenant are already waiting for "
            f"{SHARED_MEDIA_BUDGET.subject} ({tenant.settings_key}.max_waiting={tenant.max_waiting:,})",
            retry_after_s=retry_after_s(self.timeout_s),
            reason="tenant_cap",
        )

    async def _wait(self, waiter: Waiter) -> Reservation:
        try:
            return await waiter.future
        except BackendLost:
            self.background.spawn(self.client.abandon(waiter.ticket))
            return await self.fallback.reserve(waiter.nbytes, waiter.tenant, waiter.band)
        except _TimedOut:
            raise await self._timed_out(waiter) from None
        except BaseException:
            await self._abandon(waiter)
            raise

    def _expire(self, waiter: Waiter) -> None:
        if waiter.future.done():
            return
        self.holdings.waiters.pop(waiter.ticket, None)
        waiter.future.set_exception(_TimedOut())
        self.holdings.publish()

    async def _timed_out(self, waiter: Waiter) -> RateLimited:
        """Take the timed-out waiter's ticket out of Redis; its 429 names its tenant's own cap when that is what
        it waited behind."""
        own = await asyncio.shield(self.background.spawn(self.client.abandon(waiter.ticket)))
        timeout_s = waiter.timeout_s
        tenant = waiter.tenant
        if own is not None and int(own[0]) == 1 and int(own[2]) == 1 and tenant.max_bytes_in_use is not None:
            return RateLimited(
                f"waited {timeout_s:g} s for {waiter.nbytes:,} bytes of {SHARED_MEDIA_BUDGET.subject} with this "
                f"tenant at {tenant.settings_key}.max_bytes_in_use={tenant.max_bytes_in_use:,} "
                f"({int(own[1]):,} in use)",
                retry_after_s=retry_after_s(timeout_s),
                reason="tenant_cap",
            )
        return wait_timed_out(
            waiter.nbytes,
            timeout_s,
            SHARED_MEDIA_BUDGET,
            capacity=self.client.capacity,
            in_use=self.cluster_in_use,
            waiting=self.cluster_waiting,
        )

    async def _abandon(self, waiter: Waiter) -> None:
        """The waiter leaves without its reservation: give back whatever it was granted, here or in Redis."""
        self.holdings.waiters.pop(waiter.ticket, None)
        if waiter.timer is not None:
            waiter.timer.cancel()
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            # Granted in the same turn as it was given up: hand the bytes straight back.
            future.result().release()
            return
        if not future.done():
            future.cancel()
        self.holdings.publish()
        # Shielded: a second cancellation does not stop the ticket from leaving Redis.
        await asyncio.shield(self.background.spawn(self.client.abandon(waiter.ticket)))

    async def _when_unavailable(self, exc: Unavailable, nbytes: int, tenant: Tenant, band: Band) -> Reservation:
        self.keeper.backend_failed(exc)
        if self.fallback.policy is OnUnavailable.LOCAL:
            return await self.fallback.reserve(nbytes, tenant, band)
        raise self.fallback.unavailable_error(exc)


def _check(
    capacity: int,
    lease_ttl_s: float,
    on_unavailable: OnUnavailable,
    expected_replicas: int,
    window_s: float,
    max_tenants: int,
) -> None:
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if lease_ttl_s <= 0:
        raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
    if on_unavailable not in tuple(OnUnavailable):
        raise ValueError(f"on_unavailable must be 'reject' or 'local', got {on_unavailable!r}")
    if expected_replicas < 1:
        raise ValueError(f"expected_replicas must be at least 1, got {expected_replicas}")
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    if max_tenants < 1:
        raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
