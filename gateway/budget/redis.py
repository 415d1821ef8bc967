"""The media byte budget shared by every gateway process and replica through Redis.

`RedisBudget` implements the `MediaBudget` contract of `gateway.budget.base` with the local backend's fair queue
(`gateway.budget.fair_queue`), across every process that uses the same key prefix: classes share the cap by weight
and the tenants of a class share it equally, in virtual time, FIFO within a tenant, with no overtaking of the
request the queue puts first; a tenant at its own `max_bytes_in_use` is passed over without blocking the others;
a waiting interactive request goes before any batch one, and no batch request is granted while an interactive head
waits for room. One tenant in one band is one FIFO queue. An admission timeout per band, a queue bound and the
tenants' own bounds are answered with 429. At most `max_tenants` tenant records are kept in Redis.

Everything a decision reads or writes lives under the prefix and changes only inside one Lua script per operation
(reserve, release, abandon, heartbeat, snapshot: `lua/*.lua`), so each operation is atomic and one round trip.
Every script first renews what its caller still holds, then drops expired leases and queue tickets, then grants
in fair order while the chosen head fits, then does its own work. A reserve call carries its tenant's id, class,
weight and bounds and its band; the ticket keeps them, so every later grant step uses them; a lease keeps its
tenant, so its release or its expiry settles that tenant's record. Only the reserve script may need memory for its
caller: under `maxmemory`, Redis refuses it (503) while every other script runs (`allow-oom`), since they free
memory or keep what exists, so the budget recovers by itself once memory frees.

Leases and tickets expire: a reservation is a lease that its process renews every `lease_ttl_s / 3`, a queued
request is a ticket it refreshes at the same pace, so the bytes and the places of a process that dies (`kill -9`)
come back once its last renewal runs out, whoever calls next. Times are Redis server time (`TIME` inside the
scripts), so the clocks of the gateway hosts do not matter.

Grants happen inside the scripts; each script that grants publishes the granted ticket ids on `<prefix>:granted`.
Every process listens there and hands the reservation to its waiter at once. A process also re-checks its own
tickets at each renewal and wakes when the earliest lease or ticket in Redis is due to expire, which covers a lost
message and a dead process's bytes, without polling in a tight loop.

When Redis does not answer, `on_unavailable` decides: `"reject"` refuses with `BudgetBackendUnavailable` (503),
`"local"` serves from a per-process `LocalBudget` of `capacity // expected_replicas` until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway.budget.base import (
    SHARED_MEDIA_BUDGET,
    BudgetGauges,
    Reservation,
    TenantClasses,
    TenantSeries,
    queue_full,
    retry_after_s,
    wait_timed_out,
)
from gateway.budget.local import LocalBudget
from gateway.budget.redis_pipeline import ScriptRunner
from gateway.config import Band, OnUnavailable
from gateway.errors import RateLimited, ServiceUnavailable
from gateway.metrics import GatewayMetrics
from gateway.tenants import DEFAULT_MAX_TENANTS, DEFAULT_TENANT, DEFAULT_WINDOW_S, Tenant

logger = logging.getLogger(__name__)

# The keys under `<base>:`, where <base> is the key prefix inside one hash tag (`{mmgate:budget}`):
#   queue          sorted set, ticket id -> arrival number (INCR of `seq`): every waiting ticket (the queue's
#                  length and bound, and the authority on whether a ticket still waits)
#   ticket_expiry  sorted set, ticket id -> expiry (ms, Redis server time)
#   tickets        hash, ticket id -> "bytes band weight own_cap max_waiting label_length label tenant": the bytes
#                  asked for, and its tenant, class and band as its reserve call sent them (-1: no bound)
#   q:<band>:<tenant>
#                  sorted set, ticket id -> arrival number: one tenant's tickets in one band (0 interactive,
#                  1 batch), FIFO; the tenant id is taken as it is, after the tag (Redis keys are binary-safe, and
#                  the band is one character, so no two (band, tenant) pairs share a name)
#   waiting:<band> set of the classes with tickets in the band
#   h:<band>:<label>
#                  sorted set: the head ticket of each waiting tenant of the class, by virtual finish
#   starts         hash, head ticket id -> its virtual start
#   fair           hash: each band's virtual clock, each class's state in it and each class's expected hold of a
#                  grant (ms, an average of the releases made while tickets wait; `lua/fair.lua`)
#   lease_expiry   sorted set, lease id -> expiry (ms); a granted ticket becomes the lease with the same id
#   leases         hash, lease id -> "bytes seconds microseconds tenant": the bytes held, since when (Redis
#                  TIME), for whom
#   tenants        hash, tenant -> three little-endian doubles and its class's label: the bytes its leases hold,
#                  where its last grant finished in each band (`lua/tenants.lua`); at most `max_tenants` of them
#   idle           sorted set, tenant -> when it went idle: the tenants that hold and wait for nothing and keep a
#                  record for their lead, the least recently active first
#   used           string: the sum of the leases' bytes
#   seq            string: the arrival counter
#   gone           sorted set, id -> expiry (ms): ids abandoned, which a late reserve call must not queue
#   meta           hash: the cap every caller shares, the epoch of this incarnation of the state, when it was
#                  created, until when nothing is granted (after Redis lost the state)
#   gateways       sorted set, process id -> until when it counts as sharing the budget (ms), and
#   gateway_info   hash, process id -> what it says of itself (host, pid, what it fronts): `lua/members.lua`
# and the pub/sub channel `<base>:granted`.
_KEY_NAMES = (
    "queue",
    "ticket_expiry",
    "tickets",
    "lease_expiry",
    "leases",
    "tenants",
    "idle",
    "fair",
    "starts",
    "used",
    "seq",
    "gone",
    "meta",
    "gateways",
    "gateway_info",
)

_SCRIPT_NAMES = ("reserve", "release", "abandon", "heartbeat", "snapshot")


# What every script is made of before its own body, in this order (a Lua local is seen only after it).
_SHARED = ("prelude", "tenants", "fair", "queue")


def _scripts() -> dict[str, str]:
    """Each script's source, from the `.lua` files next to this module: its own body's first line (`#!lua` and its
    flags), the shared parts, then its body."""
    lua = importlib.resources.files("gateway.budget").joinpath("lua")
    shared = "".join(lua.joinpath(f"{part}.lua").read_text(encoding="utf-8") for part in _SHARED)
    scripts = {}
    for name in _SCRIPT_NAMES:
        shebang, _, body = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8").partition("\n")
        scripts[name] = f"{shebang}\n{shared}{body}"
    return scripts


_SCRIPTS = _scripts()
# Who shares the budget: no part of a decision, so called apart from the pipelined scripts (redis-py's own path).
_MEMBERS = importlib.resources.files("gateway.budget").joinpath("lua", "members.lua").read_text(encoding="utf-8")
# At most this many of the gateways sharing a budget are named in the start-up line.
_NAMED_MEMBERS = 16

_GRANTED, _QUEUED, _QUEUE_FULL, _GONE, _TENANT_FULL = 1, 0, -1, -2, -3
_BANDS = {Band.INTERACTIVE: 0, Band.BATCH: 1}
# Where a script's own answers start in its reply, after the cluster's state, the epoch and the tenant records.
_OWN = 8


class BudgetBackendUnavailable(ServiceUnavailable):
    """The shared media budget's Redis does not answer (`redis.on_unavailable: reject`, or at start-up)."""

    default_reason = "budget_unavailable"
    public = "the shared media budget does not answer"


class BudgetMisconfigured(BudgetBackendUnavailable):
    """The shared budget under this key prefix has another cap than this gateway's."""

    default_reason = "budget_misconfigured"
    public = "the shared media budget is misconfigured"


class _Unavailable(Exception):
    """A Redis call failed; carries the cause."""


class _BackendLost(Exception):
    """Set on a waiter when Redis went away and the budget falls back to the local share."""


class _TimedOut(Exception):
    """Set on a waiter whose admission timeout passed: its abandon call says which 429 it gets."""


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


class _Lease:
    """One lease of the shared budget, as the `Reservation` handed to the caller sees it.

    `Reservation.release()` (also called unbound, as `Reservation.release(r)`, by the admission path) gives the bytes
    back through `_give_back(nbytes)` on the object it was built with; a lease provides that method, so the caller
    gets a plain `Reservation` and the lease is released once, in the background, whichever way it is called.
    """

    __slots__ = ("_owner", "granted", "lease_id", "lost", "nbytes", "released", "series", "tenant_id")

    def __init__(
        self, owner: RedisBudget, lease_id: str, nbytes: int, tenant_id: str, series: TenantSeries | None
    ) -> None:
        self._owner = owner
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
            self._owner._release_lease(self)

    def reservation(self) -> Reservation:
        return Reservation(self, self.nbytes)


class _Waiter:
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
        self.who = _who(tenant, band)
        self.queued = False  # the reserve script answered "queued": heartbeats may refresh the ticket
        self.timer: asyncio.TimerHandle | None = None


def _who(tenant: Tenant, band: Band) -> str:
    """What a reserve call tells the scripts of its tenant and band: "band weight own_cap max_waiting label_length
    label tenant", -1 for no bound; the class's label and the tenant's id go last, as they are (they may hold
    spaces), the label's length in bytes telling them apart."""
    cap = -1 if tenant.max_bytes_in_use is None else tenant.max_bytes_in_use
    waiting = -1 if tenant.max_waiting is None else tenant.max_waiting
    label = tenant.label
    return f"{_BANDS[band]} {tenant.weight!r} {cap} {waiting} {len(label.encode())} {label}{tenant.id}"


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


def _key_base(prefix: str) -> str:
    """The prefix with one hash tag, so a Redis Cluster keeps every key in one slot (a script may touch only one
    slot): its own when it has one (a `{` and, after it, a `}` with something between), else the whole prefix.
    Every key starts with the base, so nothing after it (a tenant's id) moves the key to another slot."""
    start = prefix.find("{")
    if start >= 0 and prefix.find("}", start + 1) > start + 1:
        return prefix
    return "{" + prefix + "}"


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
        self.capacity: int | None = capacity
        self._capacity = capacity
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.window_s = window_s
        self._window = repr(float(window_s))
        self.max_tenants = max_tenants
        self.max_queued = max_queued
        self.url = url
        self.key_prefix = key_prefix
        self.lease_ttl_s = lease_ttl_s
        self.on_unavailable = OnUnavailable(on_unavailable)
        self.expected_replicas = expected_replicas
        self._gauges = BudgetGauges.media(metrics)
        self._gauges.capacity(capacity)
        self._classes = TenantClasses(metrics)
        self._gauges.publish(0, 0)
        self.on_round_trip = on_round_trip
        self.stats = RedisBudgetStats()
        self.cluster_in_use = 0
        self.cluster_waiting = 0
        self.cluster_tenants = 0  # tenant records in Redis
        self.backend_degraded = False  # serving from the local fallback (`on_unavailable="local"`)
        self.backend_ok = True  # the last call to Redis answered
        self.channel = f"{_key_base(key_prefix)}:granted"
        self.keys = {name: f"{_key_base(key_prefix)}:{name}" for name in _KEY_NAMES}
        self._max_queued = -1 if max_queued is None else max_queued
        self._keys = [_key_base(key_prefix)]
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._tombstone_ms = 2 * self._ttl_ms + round(4000 * socket_timeout_s)
        self._interval_s = lease_ttl_s / 3
        self._probe_interval_s = min(1.0, self._interval_s)
        self._safe_url = _redact(url)
        self._pool: aioredis.BlockingConnectionPool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=2,  # the grant listener's, and one for a ping
            timeout=2 * socket_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), 1),
            decode_responses=True,
        )
        self._redis = aioredis.Redis(connection_pool=self._pool)
        # The scripts run pipelined on a connection of their own; the pool serves the grant listener and pings.
        self._scripts = ScriptRunner(self._pool, _SCRIPTS, self._keys[0])
        self.fallback_capacity = max(1, capacity // expected_replicas)
        self._fallback = LocalBudget(
            self.fallback_capacity,
            timeout_s=timeout_s,
            max_queued=max_queued,
            batch_timeout_s=batch_timeout_s,
            window_s=window_s,
            max_tenants=max_tenants,
        )
        self._process = uuid.uuid4().hex[:12]
        # What this process says of itself to the others sharing the budget (who it is, the model server it
        # fronts), and what they said at its last call.
        self.member = f"{member or f'pid {os.getpid()}'} -> {fronts or '?'}"
        self.sharing: list[str] = []
        self._members = self._redis.register_script(_MEMBERS)
        self._ids = itertools.count()
        self._waiters: dict[str, _Waiter] = {}
        self._leases: dict[str, _Lease] = {}
        # Leases given back here whose release Redis did not answer: retried at each heartbeat until it does (they
        # are no longer renewed, so at worst they expire).
        self._unreleased: set[str] = set()
        self._held = 0
        self._tasks: set[asyncio.Future[Any]] = set()  # background calls: tasks, and releases written without one
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._subscribed = asyncio.Event()
        self._next_expiry_at: float | None = None
        self._last_beat = -math.inf
        self._closed = False
        # The epoch of the budget's record in Redis as of the last reply ("" before the first). Another one in a
        # reply means Redis lost the state: the next renewal, still naming the old epoch, re-asserts the leases.
        self._epoch = ""
        self._epoch_changed = False
        self.misconfigured: str | None = None  # the cap mismatch, while Redis reports one

    @property
    def safe_url(self) -> str:
        """`url` without its password, for logs and `/readyz`."""
        return self._safe_url

    def tenant_queue_key(self, tenant_id: str, band: Band = Band.INTERACTIVE) -> str:
        """The name of the sorted set of `tenant_id`'s tickets in `band`."""
        return f"{self._keys[0]}:q:{_BANDS[band]}:{tenant_id}"

    # -- the MediaBudget contract ------------------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        """Bytes this process holds (shared leases and, after a fallback, local reservations)."""
        return self._held + self._fallback.in_use

    @property
    def waiting(self) -> int:
        """Requests of this process waiting for the budget."""
        return len(self._waiters) + self._fallback.waiting

    async def reserve(
        self, nbytes: int, *, tenant: Tenant = DEFAULT_TENANT, band: Band = Band.INTERACTIVE
    ) -> Reservation:
        """Queued fairly with every gateway's requests: by `tenant` (its id, weight and bounds) within `band`."""
        if nbytes > self._capacity:
            raise ValueError(f"reservation of {nbytes:,} bytes can never fit a budget of {self._capacity:,}")
        own_cap = tenant.max_bytes_in_use
        if own_cap is not None and nbytes > own_cap:
            raise RateLimited(
                f"{nbytes:,} bytes of {SHARED_MEDIA_BUDGET.subject} can never fit "
                f"{tenant.settings_key}.max_bytes_in_use={own_cap:,}",
                retry_after_s=retry_after_s(self.timeout_s),
                reason="tenant_cap",
            )
        if self._closed:
            raise BudgetBackendUnavailable("the shared media budget is closed", reason="budget_unavailable")
        self._run_background()
        if self.backend_degraded:
            return await self._reserve_local(nbytes, tenant, band)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        timeout_s = self.batch_timeout_s if band is Band.BATCH else self.timeout_s
        waiter = _Waiter(self._new_id(), nbytes, loop.create_future(), tenant, band, timeout_s)
        series = self._classes.get(tenant.label)
        counted = False
        # Registered before the script runs: a grant message may arrive before the script's answer.
        self._waiters[waiter.ticket] = waiter
        try:
            try:
                reply = await self._call("reserve", waiter.ticket, nbytes, self._max_queued, waiter.who)
            except _Unavailable as exc:
                self._waiters.pop(waiter.ticket, None)
                return await self._when_unavailable(exc, nbytes, tenant, band)
            except BaseException:
                # Cancelled once the script was sent: it may queue or grant the id. The abandon is written after
                # it on the same connection, so Redis runs it after; on another connection, its tombstone turns a
                # reserve that arrives later into a no-op.
                await self._abandon(waiter)
                raise
            status = int(reply[_OWN])
            if status == _GRANTED:
                self._hand_over(waiter, by_message=None)
            elif status == _QUEUE_FULL:
                self._waiters.pop(waiter.ticket, None)
                raise queue_full(self.cluster_waiting, self.max_queued, self.timeout_s, SHARED_MEDIA_BUDGET)
            elif status == _GONE:
                self._waiters.pop(waiter.ticket, None)
                raise BudgetBackendUnavailable(f"the shared media budget at {self._safe_url} refused a fresh ticket")
            elif status == _TENANT_FULL:
                self._waiters.pop(waiter.ticket, None)
                raise RateLimited(
                    f"{int(reply[_OWN + 1]):,} requests of this tenant are already waiting for "
                    f"{SHARED_MEDIA_BUDGET.subject} ({tenant.settings_key}.max_waiting={tenant.max_waiting:,})",
                    retry_after_s=retry_after_s(self.timeout_s),
                    reason="tenant_cap",
                )
            else:
                waiter.queued = True
                if series is not None:
                    series.add_waiting(1)
                    counted = True
                if timeout_s is not None and not waiter.future.done():
                    remaining = max(0.0, timeout_s - (time.perf_counter() - started))
                    waiter.timer = loop.call_later(remaining, self._expire, waiter)
                self._wake.set()
            self._publish()
            try:
                return await waiter.future
            except _BackendLost:
                self._spawn(self._abandon_remote(waiter.ticket))
                return await self._reserve_local(nbytes, tenant, band)
            except _TimedOut:
                raise await self._timed_out(waiter) from None
            except BaseException:
                await self._abandon(waiter)
                raise
        finally:
            waited = time.perf_counter() - started
            self._gauges.observe_wait(waited)
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
            self._record("ping", time.perf_counter() - started)
        except (RedisError, OSError) as exc:
            self.stats.backend_errors += 1
            self.backend_ok = False
            raise BudgetBackendUnavailable(
                f"cannot reach the shared media budget's Redis at {self._safe_url}: {exc}"
            ) from exc
        self._run_background()
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout=max(2.0, 4 * self._probe_interval_s))
        except TimeoutError as exc:
            raise BudgetBackendUnavailable(
                f"cannot subscribe to {self.channel} on the shared media budget's Redis at {self._safe_url}"
            ) from exc
        await self.refresh()
        if self.misconfigured is not None:
            raise BudgetMisconfigured(self.misconfigured)
        await self._register()
        named = "; ".join(self.sharing[:_NAMED_MEMBERS])
        more = len(self.sharing) - _NAMED_MEMBERS
        logger.info(
            "shared media budget %s at %s: %d gateway process%s share%s it now (this one included): %s%s",
            self.keys["meta"].removesuffix(":meta"),
            self._safe_url,
            len(self.sharing),
            "" if len(self.sharing) == 1 else "es",
            "s" if len(self.sharing) == 1 else "",
            named,
            f"; and {more} more" if more > 0 else "",
        )
        servers = sorted({said.rpartition(" -> ")[2] for said in self.sharing})
        if len(servers) > 1:
            logger.warning(
                "gateways in front of different model servers (%s) share the media budget %s: its cap protects no "
                "one server's memory; give each server a budget of its own (redis.scope)",
                ", ".join(servers),
                self.keys["meta"].removesuffix(":meta"),
            )

    async def _register(self, *, leaving: bool = False) -> None:
        """Say to the budget that this process shares it (for three lease TTLs), or that it leaves, and keep what
        every process present says of itself in `sharing`."""
        ttl = 0 if leaving else 3 * self._ttl_ms
        started = time.perf_counter()
        said = await self._members(keys=self._keys, args=[self._process, self.member, ttl])
        self._record("members", time.perf_counter() - started)
        self.sharing = [str(item) for item in said]

    async def refresh(self) -> None:
        """One round trip that reaps, grants and updates `cluster_in_use` / `cluster_waiting`."""
        try:
            await self._call("snapshot")
        except _Unavailable as exc:
            self._on_backend_failure(exc)
        except BudgetMisconfigured:
            pass  # logged, and kept in `misconfigured`

    async def flush(self) -> None:
        """Wait for the releases and abandons sent in the background so far."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop renewing and listening, send what is pending, and close the connections. Leases still held expire."""
        if self._closed:
            return
        self._closed = True
        for task in (self._keeper, self._listener):
            if task is not None:
                task.cancel()
        for task in (self._keeper, self._listener):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout=max(1.0, 2 * self._interval_s))
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._register(leaving=True), timeout=max(1.0, self._interval_s))
        for waiter in list(self._waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(
                    BudgetBackendUnavailable("the shared media budget is closing", reason="budget_unavailable")
                )
        self._waiters.clear()
        await self._scripts.aclose()
        await self._redis.aclose()
        await self._pool.aclose()

    # -- internals ---------------------------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self._process}:{next(self._ids)}"

    def _run_background(self) -> None:
        if self._keeper is not None or self._closed:
            return
        self._loop = asyncio.get_running_loop()
        self._keeper = self._loop.create_task(self._keep(), name="redis-budget-keeper")
        self._listener = self._loop.create_task(self._listen(), name="redis-budget-listener")

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _call(self, name: str, *args: str | int) -> list[Any]:
        started = time.perf_counter()
        try:
            reply = await self._scripts(
                name, self._capacity, self._ttl_ms, self._epoch, self._window, self.max_tenants, *args
            )
        except (RedisError, OSError) as exc:
            self.stats.backend_errors += 1
            self.backend_ok = False
            self._record(name, time.perf_counter() - started)
            raise _Unavailable(f"{type(exc).__name__}: {exc}") from exc
        self._record(name, time.perf_counter() - started)
        return self._on_reply(reply)

    def _on_reply(self, reply: Any) -> list[Any]:
        """Take the cluster's state from a script's reply; `BudgetMisconfigured` when Redis holds another cap."""
        self.backend_ok = True
        answer: list[Any] = list(reply)
        if answer[0] == "cap":
            raise self._mismatch(int(answer[1]))
        self.misconfigured = None
        epoch = str(answer[5])
        if not self._epoch:
            self._epoch = epoch
        elif epoch != self._epoch and not self._epoch_changed:
            self._epoch_changed = True
            self.stats.state_losses += 1
            logger.warning(
                "the shared media budget's Redis at %s lost its state (a restart or a flush): re-asserting the "
                "%d leases this process holds; nothing is granted for redis.lease_ttl_s=%g s while every "
                "gateway does the same",
                self._safe_url,
                len(self._leases),
                self.lease_ttl_s,
            )
            self._last_beat = -math.inf
            self._wake.set()
        self.cluster_in_use = int(answer[0])
        self.cluster_waiting = int(answer[1])
        next_expiry_ms = int(answer[2])
        self._next_expiry_at = (
            None if next_expiry_ms < 0 else asyncio.get_running_loop().time() + next_expiry_ms / 1000 + 0.002
        )
        self.stats.leases_reaped += int(answer[3])
        self.stats.tickets_reaped += int(answer[4])
        if int(answer[6]) >= 0:  # counted by the heartbeat and the snapshot
            self.cluster_tenants = int(answer[6])
        self.stats.tenant_evictions += int(answer[7])
        return answer

    def _mismatch(self, stored: int) -> BudgetMisconfigured:
        message = (
            f"the shared media budget {self.key_prefix!r} has a cap of {stored:,} bytes and this gateway "
            f"{self._capacity:,} (limits.max_multimodal_cpu_bytes): every gateway sharing a budget needs the same "
            "cap (stop the others, or give this one its own redis.key_prefix or redis.scope)"
        )
        if self.misconfigured != message:
            logger.error("%s", message)
        self.misconfigured = message
        return BudgetMisconfigured(message)

    def _record(self, name: str, seconds: float) -> None:
        self.stats.round_trips += 1
        self.stats.round_trip_seconds += seconds
        if self.on_round_trip is not None:
            self.on_round_trip(name, seconds)

    def _hand_over(self, waiter: _Waiter, *, by_message: bool | None) -> None:
        """Turn a grant into the waiter's reservation, in one step. A waiter that already gave up (its future is
        done) is left to its own abandon, which gives the lease back."""
        if waiter.future.done():
            return
        self._waiters.pop(waiter.ticket, None)
        if waiter.timer is not None:
            waiter.timer.cancel()
        series = self._classes.get(waiter.tenant.label)
        lease = _Lease(self, waiter.ticket, waiter.nbytes, waiter.tenant.id, series)
        self._leases[waiter.ticket] = lease
        self._held += waiter.nbytes
        if series is not None:
            series.take(waiter.nbytes)
        if by_message is True:
            self.stats.grants_by_message += 1
        elif by_message is False:
            self.stats.grants_by_recheck += 1
        waiter.future.set_result(lease.reservation())
        self._publish()

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._waiters.pop(waiter.ticket, None)
        waiter.future.set_exception(_TimedOut())
        self._publish()

    async def _timed_out(self, waiter: _Waiter) -> RateLimited:
        """Take the timed-out waiter's ticket out of Redis; its 429 names its tenant's own cap when that is what
        it waited behind."""
        own = await asyncio.shield(self._spawn(self._abandon_remote(waiter.ticket)))
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
            capacity=self._capacity,
            in_use=self.cluster_in_use,
            waiting=self.cluster_waiting,
        )

    async def _abandon(self, waiter: _Waiter) -> None:
        """The waiter leaves without its reservation: give back whatever it was granted, here or in Redis."""
        self._waiters.pop(waiter.ticket, None)
        if waiter.timer is not None:
            waiter.timer.cancel()
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            # Granted in the same turn as it was given up: hand the bytes straight back.
            future.result().release()
            return
        if not future.done():
            future.cancel()
        self._publish()
        # Shielded: a second cancellation does not stop the ticket from leaving Redis.
        await asyncio.shield(self._spawn(self._abandon_remote(waiter.ticket)))

    async def _abandon_remote(self, ticket: str) -> list[Any] | None:
        """The abandon script's own answers, or None when Redis did not answer: then the ticket (or the lease it
        was granted) expires on its own."""
        try:
            reply = await self._call("abandon", ticket, self._tombstone_ms)
        except (_Unavailable, BudgetMisconfigured):
            return None
        return reply[_OWN:]

    def _release_lease(self, lease: _Lease) -> None:
        if self._leases.pop(lease.lease_id, None) is not None:
            self._held -= lease.nbytes
            if lease.series is not None:
                lease.series.give_back(lease.nbytes, time.perf_counter() - lease.granted)
        self._publish()
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            return  # the lease expires on its own
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._send_release(lease.lease_id)
        else:
            loop.call_soon_threadsafe(self._send_release, lease.lease_id)

    def _send_release(self, lease_id: str) -> None:
        """Write the release at once and handle its reply in a callback; without a connection up, or when the
        written release fails, a task makes the call with its retry."""
        if self._closed:
            return
        reply = self._scripts.send(
            "release", self._capacity, self._ttl_ms, self._epoch, self._window, self.max_tenants, lease_id
        )
        if reply is None:
            self._spawn(self._release_remote(lease_id))
            return
        started = time.perf_counter()

        def answered(reply: asyncio.Future[Any]) -> None:
            self._tasks.discard(reply)
            if reply.cancelled() or reply.exception() is not None:
                self._spawn(self._release_remote(lease_id))
            else:
                self._record("release", time.perf_counter() - started)
                with contextlib.suppress(BudgetMisconfigured):  # logged; the lease expires on its own
                    self._on_reply(reply.result())

        self._tasks.add(reply)
        reply.add_done_callback(answered)

    async def _release_remote(self, lease_id: str) -> None:
        # Releasing a lease that has gone does nothing, so a retry is always safe.
        try:
            await self._call("release", lease_id)
        except (_Unavailable, BudgetMisconfigured):
            self._unreleased.add(lease_id)

    async def _retry_releases(self) -> None:
        for lease_id in list(self._unreleased):
            try:
                await self._call("release", lease_id)
            except (_Unavailable, BudgetMisconfigured):
                return
            self._unreleased.discard(lease_id)

    async def _reserve_local(self, nbytes: int, tenant: Tenant, band: Band) -> Reservation:
        # A request larger than the local share takes the whole share: it runs alone in this process.
        return await self._fallback.reserve(min(nbytes, self.fallback_capacity), tenant=tenant, band=band)

    async def _when_unavailable(self, exc: _Unavailable, nbytes: int, tenant: Tenant, band: Band) -> Reservation:
        self._on_backend_failure(exc)
        if self.on_unavailable is OnUnavailable.LOCAL:
            return await self._reserve_local(nbytes, tenant, band)
        raise self._unavailable_error(exc)

    def _unavailable_error(self, exc: BaseException) -> BudgetBackendUnavailable:
        return BudgetBackendUnavailable(
            f"the shared media budget's Redis at {self._safe_url} does not answer ({exc}); "
            "nothing is admitted that the budget has not counted (redis.on_unavailable=reject)"
        )

    def _on_backend_failure(self, exc: _Unavailable) -> None:
        """Redis did not answer: move this process's waiters to the fallback, or refuse them."""
        if self.on_unavailable is OnUnavailable.LOCAL and not self.backend_degraded:
            self.backend_degraded = True
            self.stats.fallbacks += 1
            self._gauges.capacity(self.fallback_capacity)
            logger.warning(
                "the shared media budget's Redis at %s does not answer (%s): admitting from a local share of "
                "%s bytes (limits.max_multimodal_cpu_bytes // redis.expected_replicas=%d) until it answers again",
                self._safe_url,
                exc,
                f"{self.fallback_capacity:,}",
                self.expected_replicas,
            )
            self._wake.set()
        for waiter in list(self._waiters.values()):
            if waiter.queued and not waiter.future.done():
                self._waiters.pop(waiter.ticket, None)
                if waiter.timer is not None:
                    waiter.timer.cancel()
                if self.on_unavailable is OnUnavailable.LOCAL:
                    waiter.future.set_exception(_BackendLost())
                else:
                    waiter.future.set_exception(self._unavailable_error(exc))
        self._publish()

    async def _keep(self) -> None:
        """Renew leases and tickets every `lease_ttl_s / 3`, wake when the earliest lease or ticket in Redis is due
        to expire while this process has waiters, and probe Redis while degraded."""
        loop = asyncio.get_running_loop()
        while not self._closed:  # also ends a loop whose cancellation a redis-py call lost
            if self.backend_degraded:
                due = self._last_beat + self._probe_interval_s
            else:
                due = self._last_beat + self._interval_s
                if self._waiters and self._next_expiry_at is not None:
                    due = min(due, self._next_expiry_at)
            delay = due - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                self._wake.clear()
                continue
            self._last_beat = loop.time()
            if self.backend_degraded:
                await self._probe()
            else:
                await self._beat()
                with contextlib.suppress(RedisError, OSError):
                    await self._register()
            self._publish()

    async def _probe(self) -> None:
        try:
            started = time.perf_counter()
            await self._redis.ping()
            self._record("ping", time.perf_counter() - started)
        except (RedisError, OSError):
            self.stats.backend_errors += 1
            return
        self.backend_degraded = False
        self.backend_ok = True
        self._gauges.capacity(self._capacity)
        logger.warning("the shared media budget's Redis at %s answers again: admitting from it", self._safe_url)
        self._last_beat = -math.inf  # renew at once

    async def _beat(self) -> None:
        leases = [lease for lease in self._leases.values() if not lease.lost]
        held = [part for lease in leases for part in (lease.lease_id, lease.nbytes, lease.tenant_id)]
        tickets = [waiter.ticket for waiter in self._waiters.values() if waiter.queued]
        try:
            reply = await self._call("heartbeat", len(leases), *held, *tickets)
        except _Unavailable as exc:
            self._on_backend_failure(exc)
            return
        except BudgetMisconfigured:
            return  # logged; every call keeps failing until the caps agree
        # The leases named the epoch this process knew; Redis re-asserted them under the one it has now.
        self._epoch, self._epoch_changed = str(reply[5]), False
        renewed, reasserted, lost, granted, missing = reply[_OWN : _OWN + 5]
        self.stats.lease_renewals += int(renewed)
        self.stats.leases_reasserted += int(reasserted)
        for lease_id in lost:
            lease = self._leases.get(lease_id)
            if lease is not None and not lease.lost:
                lease.lost = True
                self.stats.leases_lost += 1
        for ticket in granted:
            waiter = self._waiters.get(ticket)
            if waiter is not None:
                self._hand_over(waiter, by_message=False)
        for ticket in missing:
            waiter = self._waiters.get(ticket)
            if waiter is not None and not waiter.future.done():
                self._spawn(self._requeue(waiter))
        if self._unreleased:
            await self._retry_releases()

    async def _requeue(self, waiter: _Waiter) -> None:
        """The waiter's ticket expired in Redis (this process stalled past the TTL, or Redis lost its data): queue
        it again at the back under a new id."""
        old = waiter.ticket
        self._waiters.pop(old, None)
        waiter.ticket = self._new_id()
        waiter.queued = False
        self._waiters[waiter.ticket] = waiter
        self._spawn(self._abandon_remote(old))
        try:
            reply = await self._call("reserve", waiter.ticket, waiter.nbytes, self._max_queued, waiter.who)
        except _Unavailable as exc:
            waiter.queued = True  # let the failure handling move or refuse it
            self._on_backend_failure(exc)
            return
        except BudgetMisconfigured as exc:
            self._waiters.pop(waiter.ticket, None)
            if not waiter.future.done():
                waiter.future.set_exception(exc)
            return
        status = int(reply[_OWN])
        if status == _GRANTED:
            self._hand_over(waiter, by_message=False)
        elif status == _QUEUED:
            waiter.queued = True
        elif not waiter.future.done():
            self._waiters.pop(waiter.ticket, None)
            bound = (
                f"{waiter.tenant.settings_key}.max_waiting={waiter.tenant.max_waiting}"
                if status == _TENANT_FULL
                else f"limits.max_queued_requests={self.max_queued}"
            )
            waiter.future.set_exception(
                RateLimited(
                    f"lost its place in the media budget's queue and the queue is full ({bound})",
                    retry_after_s=retry_after_s(self.timeout_s),
                    reason="tenant_cap" if status == _TENANT_FULL else "queue_full",
                )
            )

    async def _listen(self) -> None:
        """Hand grants published on the channel to this process's waiters; resubscribe after a failure."""
        backoff = 0.05
        while not self._closed:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while not self._closed:
                    message = await pubsub.get_message(timeout=self._probe_interval_s)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self._subscribed.set()
                        backoff = 0.05
                    elif message["type"] == "message":
                        self._on_granted(str(message["data"]).split())
            except (RedisError, OSError):
                self._subscribed.clear()
                self.stats.backend_errors += 1
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self._probe_interval_s)

    def _on_granted(self, tickets: Sequence[str]) -> None:
        for ticket in tickets:
            waiter = self._waiters.get(ticket)
            if waiter is not None:
                self._hand_over(waiter, by_message=True)

    def _publish(self) -> None:
        self._gauges.publish(self.in_use, self.waiting)
