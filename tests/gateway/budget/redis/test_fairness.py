"""Fair queueing between tenants in the shared media budget, against a real `redis-server`, held to the local
backend's rules: the scenarios that both backends run are parametrized over them (RedisBudgets on one prefix stand
for gateway processes; one LocalBudget stands for all of them)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.crc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.budget.base import MediaBudget, Reservation
from gateway.budget.factory import build_budget, describe
from gateway.budget.local import LocalBudget
from gateway.budget.redis import BudgetBackendUnavailable, RedisBudget
from gateway.budget.reporter import BudgetReporter
from gateway.config import Band, GatewaySettings
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant
from tests.gateway.budget.interleavings import Op, contend, none_starve, operations
from tests.gateway.budget.redis.helpers import (
    _HOLDER,
    ROOT,
    _budget,
    _settled,
    _until,
    interleave_on_redis,
    tenant_records,
)
from tests.gateway.budget.test_local import UNBOUNDED, tenant_of
from tests.observe import metric_in
from tests.redis_server import RedisServer

A = Tenant("a", "a")
B = Tenant("b", "b")
X = Tenant("x", "x")


class Shared:
    """The budgets of one test, sharing one cap."""

    def __init__(self, kind: str, server: RedisServer) -> None:
        self.kind = kind
        self.server = server
        self.prefix = f"fair:{uuid.uuid4().hex[:8]}"
        self.budgets: list[MediaBudget] = []

    async def make(self, count: int = 2, **options: Any) -> list[MediaBudget]:
        """`count` budgets of one cap (`capacity` 100 unless told) with the same options."""
        options.setdefault("capacity", 100)
        options.setdefault("timeout_s", 10.0)
        options.setdefault("max_queued", None)
        if self.kind == "local":
            capacity = options.pop("capacity")
            local = LocalBudget(capacity, **options)
            self.budgets = [local]
            return [local] * count
        for _ in range(count):
            budget = _budget(self.server, self.prefix, **options)
            await budget.start()
            self.budgets.append(budget)
        return list(self.budgets)

    async def in_use(self) -> int:
        """The bytes the cap holds, once every release sent so far was answered."""
        for budget in self.budgets:
            if isinstance(budget, RedisBudget):
                await budget.flush()
        first = self.budgets[0]
        if isinstance(first, RedisBudget):
            return (await _settled(first))[0]
        await asyncio.sleep(0)
        return first.in_use

    async def tenant_ids(self) -> set[str]:
        """The tenants whose state the budget keeps (in Redis: their records), once every release was answered."""
        first = self.budgets[0]
        if isinstance(first, RedisBudget):
            for budget in self.budgets:
                if isinstance(budget, RedisBudget):
                    await budget.flush()
            return set(tenant_records(self.server, first))
        assert isinstance(first, LocalBudget)
        await asyncio.sleep(0)
        return set(first._queue.tenants)

    async def sweep(self) -> None:
        """What forgets idle tenants whose lead is gone or too old, whatever else happens: a heartbeat in Redis, new
        tenants arriving in the local budget."""
        for budget in self.budgets[:1]:
            if isinstance(budget, RedisBudget):
                await budget.keeper.beat()
            else:
                for _ in range(3):
                    (await budget.reserve(1, tenant=stranger())).release()

    def evictions(self) -> int:
        """Tenant states forgotten at `max_tenants`, by every budget of the test."""
        first = self.budgets[0]
        if isinstance(first, LocalBudget):
            return first.tenant_evictions
        return sum(budget.stats.tenant_evictions for budget in self.budgets if isinstance(budget, RedisBudget))

    async def aclose(self) -> None:
        for budget in self.budgets:
            if isinstance(budget, RedisBudget):
                await budget.aclose()


@pytest.fixture(params=["local", "redis"])
async def shared(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[Shared]:
    backend = Shared(request.param, redis_server)
    yield backend
    await backend.aclose()


async def queued(budget: MediaBudget, count: int) -> None:
    """Wait until `count` requests of this process wait, each one with its place in the queue."""
    await _until(lambda: budget.waiting >= count, within=10)
    if isinstance(budget, RedisBudget):
        await _until(lambda: all(w.queued for w in budget.holdings.waiters.values()), within=10)


async def ask(
    budget: MediaBudget, nbytes: int, *, tenant: Tenant, band: Band = Band.INTERACTIVE
) -> asyncio.Task[Reservation]:
    """A request that waits: started, and in the queue when this returns."""
    before = budget.waiting
    task = asyncio.ensure_future(budget.reserve(nbytes, tenant=tenant, band=band))
    await queued(budget, before + 1)
    return task


async def give_up(tasks: list[asyncio.Task[Reservation]]) -> None:
    """Cancel the requests; those already granted give their bytes back."""
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Reservation):
            result.release()


# -- order and shares ------------------------------------------------------------------------------------------


async def test_tenant_series_follow_this_processs_requests(shared: Shared) -> None:
    metrics = GatewayMetrics(tenant_labels=("a", "other"), shared_budget=shared.kind == "redis")
    (budget,) = await shared.make(1, metrics=metrics)

    def value(family: Any, label: str) -> float:
        return float(family.labels(label)._value.get())

    reservation = await budget.reserve(60, tenant=A)
    stranger = await budget.reserve(40, tenant=Tenant("x", "other"))
    assert value(metrics.tenant_budget_in_use_bytes, "a") == 60
    assert value(metrics.tenant_budget_in_use_bytes, "other") == 40
    waiter = await ask(budget, 10, tenant=A)
    assert value(metrics.tenant_budget_waiting_requests, "a") == 1
    await asyncio.sleep(0.01)
    reservation.release()
    (await asyncio.wait_for(waiter, 10)).release()
    stranger.release()
    assert value(metrics.tenant_budget_granted_bytes, "a") == 70
    assert value(metrics.tenant_budget_byte_seconds, "a") >= 60 * 0.01
    assert value(metrics.tenant_budget_in_use_bytes, "a") == 0
    assert value(metrics.tenant_budget_waiting_requests, "a") == 0
    assert metrics.tenant_budget_wait_seconds.labels("a")._sum.get() > 0


@pytest.mark.parametrize(("weights", "expected"), [((1.0, 1.0), "abab"), ((3.0, 1.0), "aaba")])
async def test_the_grants_of_one_instant_follow_the_weights(
    shared: Shared, weights: tuple[float, float], expected: str
) -> None:
    """Four requests of each of two tenants (classes of their own) wait, in turn, for a cap of 4 that one release
    frees at once: each grant moves its class's next start on by its cost over its weight, which orders the grants
    (a tie goes to the earlier request), on both backends alike."""
    (budget,) = await shared.make(1, capacity=40)
    a, b = Tenant("a", "a", weight=weights[0]), Tenant("b", "b", weight=weights[1])
    holder = await budget.reserve(40, tenant=X)
    order: list[str] = []

    async def take(tenant: Tenant) -> Reservation:
        reservation = await budget.reserve(10, tenant=tenant)
        order.append(tenant.id)
        return reservation

    tasks = []
    for _ in range(4):
        for tenant in (a, b):
            tasks.append(asyncio.ensure_future(take(tenant)))
            await queued(budget, len(tasks))
    holder.release()
    await _until(lambda: len(order) == 4, within=10)
    assert "".join(order) == expected
    assert await shared.in_use() == 40
    await give_up(tasks)
    assert await shared.in_use() == 0


@pytest.mark.parametrize(("weights", "low", "high"), [((1.0, 1.0), 0.35, 0.65), ((3.0, 1.0), 0.65, 0.85)])
async def test_weights_share_the_budget_under_contention_across_processes(
    shared: Shared, weights: tuple[float, float], low: float, high: float
) -> None:
    """Two tenants, each on a process of its own, keep the budget saturated with equal requests held equally long:
    grants follow the weights (3:1 is 0.75)."""
    budgets = await shared.make(2, capacity=40, timeout_s=None, window_s=1000.0)
    tenants = [Tenant("heavy", "heavy", weight=weights[0]), Tenant("light", "light", weight=weights[1])]
    granted = await asyncio.wait_for(contend(budgets, tenants, grants=400, nbytes=10, hold_s=0.002, clients=6), 90)
    share = granted["heavy"] / sum(granted.values())
    assert low <= share <= high, granted
    assert await shared.in_use() == 0


async def test_one_tenant_is_fifo_without_overtaking_across_processes(shared: Shared) -> None:
    a_side, b_side = await shared.make(2)
    held = await a_side.reserve(100, tenant=A)
    big = await ask(b_side, 90, tenant=A)
    small = await ask(a_side, 10, tenant=A)
    assert await shared.in_use() == 100
    assert not small.done()
    held.release()
    first, second = await asyncio.wait_for(asyncio.gather(big, small), 10)
    assert await shared.in_use() == 100
    first.release()
    second.release()
    assert await shared.in_use() == 0


async def test_a_flooding_tenant_does_not_hold_back_another_tenants_request(shared: Shared) -> None:
    flooder, other = await shared.make(2, max_queued=None)
    holders = [await flooder.reserve(50, tenant=A) for _ in range(2)]
    flood = [await ask(flooder, 50, tenant=A) for _ in range(5)]
    small = await ask(other, 10, tenant=B)
    holders[0].release()  # one of A's holds ends: B has had no service, so B goes first
    granted = await asyncio.wait_for(small, 10)
    assert await shared.in_use() == 60
    assert not any(task.done() for task in flood)
    granted.release()
    holders[1].release()
    await give_up(flood)
    assert await shared.in_use() == 0


# -- identities a client mints ------------------------------------------------------------------------------------


def stranger() -> Tenant:
    """A tenant no one configured, with an identity of its own (a fresh API key)."""
    return Tenant(uuid.uuid4().hex, "other")


async def test_fresh_identities_buy_no_place_before_a_small_request(shared: Shared) -> None:
    """Strangers, each with an identity of its own, hold the budget and queue behind it for large requests; a tenant
    served before asks for a few bytes that fit: it starts where a new identity would, and its small request
    finishes first, so it is granted at once."""
    (budget,) = await shared.make(1)
    honest = Tenant("honest", "other")
    before = await budget.reserve(5, tenant=honest)
    await asyncio.sleep(0.05)
    before.release()
    holders = [await budget.reserve(30, tenant=stranger()) for _ in range(3)]
    queue = [await ask(budget, 30, tenant=stranger()) for _ in range(8)]
    small = await asyncio.wait_for(budget.reserve(5, tenant=honest), 10)
    assert await shared.in_use() == 95
    assert not any(task.done() for task in queue)
    small.release()
    await give_up(queue)
    for holder in holders:
        holder.release()
    assert await shared.in_use() == 0


async def test_a_stream_of_fresh_identities_does_not_starve_a_large_request(shared: Shared) -> None:
    """Small requests of new identities keep coming while a large one waits for the whole cap: each new one starts
    at the class's virtual time, which every grant moves on, so the large request's turn comes and then nothing
    overtakes it."""
    (budget,) = await shared.make(1, timeout_s=30.0)
    held = [await budget.reserve(10, tenant=stranger()) for _ in range(3)]
    large = await ask(budget, 100, tenant=Tenant("large", "other"))
    later: list[asyncio.Task[Reservation]] = []
    granted_before = 0
    for _ in range(200):
        if held:
            held.pop(0).release()
        small = asyncio.ensure_future(budget.reserve(10, tenant=stranger()))
        await asyncio.wait({small, large}, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
        if large.done():
            later.append(small)
            break
        if small.done():
            held.append(small.result())
            granted_before += 1
        else:
            later.append(small)
    assert large.done(), "the large request starved"
    assert granted_before > 0  # the small requests of new identities went first, for a while
    (await large).release()
    for reservation in held:
        reservation.release()
    await give_up(later)
    assert await shared.in_use() == 0


@pytest.mark.parametrize(("weight", "low", "high"), [(1.0, 0.35, 0.65), (3.0, 0.65, 0.85)])
async def test_identities_a_client_mints_share_one_class_and_its_weight(
    shared: Shared, weight: float, low: float, high: float
) -> None:
    """A configured tenant and clients minting an identity per request (the class `other`, weight 1) keep the
    budget saturated from two processes: the configured tenant's share of the grants follows the two classes'
    weights, however many identities the others mint."""
    budgets = await shared.make(2, capacity=40, timeout_s=None)
    acme = Tenant("acme", "acme", weight=weight)
    granted = {"acme": 0, "other": 0}

    async def client(budget: MediaBudget, minting: bool) -> None:
        while sum(granted.values()) < 400:
            tenant = stranger() if minting else acme
            reservation = await budget.reserve(10, tenant=tenant)
            granted[tenant.label] += 1
            await asyncio.sleep(0.002)
            reservation.release()

    clients = [client(budgets[0], False) for _ in range(6)] + [client(budgets[1], True) for _ in range(6)]
    await asyncio.wait_for(asyncio.gather(*clients), 90)
    share = granted["acme"] / sum(granted.values())
    assert low <= share <= high, granted
    assert await shared.in_use() == 0


# -- tenant states -------------------------------------------------------------------------------------------------


async def test_tenants_that_ask_without_waiting_leave_no_state(shared: Shared) -> None:
    (budget,) = await shared.make(1)
    for _ in range(300):
        (await budget.reserve(10, tenant=stranger())).release()
    assert len(await shared.tenant_ids()) <= 2
    assert shared.evictions() == 0


async def test_tenant_states_stop_at_the_cap_the_least_recently_active_idle_one_going_first(shared: Shared) -> None:
    """Strangers served while others wait finish ahead of their class's virtual time, so their states stay once
    they are idle; at `max_tenants` states, each new tenant forgets the least recently active idle one. Tenants that
    hold or wait are never forgotten."""
    metrics = GatewayMetrics(shared_budget=shared.kind == "redis")
    (budget,) = await shared.make(1, max_tenants=14, metrics=metrics)
    holder = await budget.reserve(90, tenant=Tenant("holder", "other"))
    large = [await ask(budget, 95, tenant=Tenant(f"w{i}", "other")) for i in range(10)]
    served = [Tenant(f"s{i}", "other") for i in range(5)]
    for tenant in served:
        (await asyncio.wait_for(budget.reserve(10, tenant=tenant), 10)).release()
    kept = await shared.tenant_ids()
    assert kept == {"holder", *(f"w{i}" for i in range(10)), "s2", "s3", "s4"}
    assert shared.evictions() == 2
    # The metrics say so: this process's states (local), the cluster's records as of the last round trip (redis).
    if isinstance(budget, RedisBudget):
        await budget.refresh()
    BudgetReporter(budget, metrics).sync()
    exposition = metrics.render().decode()
    assert metric_in(exposition, "mmgate_budget_tenant_states") == 14
    assert metric_in(exposition, "mmgate_budget_tenant_evictions_total") == 2
    await give_up(large)
    holder.release()
    assert await shared.in_use() == 0


async def test_an_idle_tenants_lead_goes_with_the_window_or_with_the_contention(shared: Shared) -> None:
    """A tenant served while others wait keeps its state, idle, for its lead: until `window_s` has passed, or until
    its class has nobody waiting (its clock then moves past every finish); then the sweep forgets it."""
    (budget,) = await shared.make(1, window_s=0.3)
    holder = await budget.reserve(90, tenant=Tenant("holder", "other"))
    large = await ask(budget, 95, tenant=Tenant("large", "other"))
    (await asyncio.wait_for(budget.reserve(10, tenant=Tenant("early", "other")), 10)).release()
    await shared.sweep()
    assert "early" in await shared.tenant_ids()
    await asyncio.sleep(0.4)
    await shared.sweep()
    assert "early" not in await shared.tenant_ids()
    (await asyncio.wait_for(budget.reserve(10, tenant=Tenant("late", "other")), 10)).release()
    await shared.sweep()
    assert "late" in await shared.tenant_ids()
    await give_up([large])
    await shared.sweep()
    assert "late" not in await shared.tenant_ids()
    holder.release()
    assert await shared.in_use() == 0


# -- a tenant's own bounds ---------------------------------------------------------------------------------------


CAPPED = Tenant("a", "a", max_bytes_in_use=50, settings_key="limits.fairness.tenants.a")


async def test_a_tenant_at_its_cap_waits_in_every_process_without_blocking_others(shared: Shared) -> None:
    a_side, b_side = await shared.make(2)
    held = await a_side.reserve(50, tenant=CAPPED)
    # The cap is the tenant's across processes: B's process waits for A's 50 too.
    over = await ask(b_side, 10, tenant=CAPPED)
    other = await asyncio.wait_for(b_side.reserve(40, tenant=B), 10)  # not behind A's capped head
    assert await shared.in_use() == 90
    assert not over.done()
    with pytest.raises(RateLimited, match=r"can never fit limits\.fairness\.tenants\.a\.max_bytes_in_use=50") as raised:
        await b_side.reserve(60, tenant=CAPPED)
    assert raised.value.reason == "tenant_cap"
    held.release()
    (await asyncio.wait_for(over, 10)).release()
    other.release()
    assert await shared.in_use() == 0
    assert a_side.waiting == b_side.waiting == 0


async def test_a_tenant_that_waited_at_its_cap_gets_429_naming_the_key(shared: Shared) -> None:
    a_side, b_side = await shared.make(2, timeout_s=0.3)
    held = await a_side.reserve(50, tenant=CAPPED)
    with pytest.raises(RateLimited, match=r"limits\.fairness\.tenants\.a\.max_bytes_in_use=50 \(50 in use\)") as raised:
        await asyncio.wait_for(b_side.reserve(10, tenant=CAPPED), 10)
    assert raised.value.reason == "tenant_cap"
    assert raised.value.headers["retry-after"] == "1"
    held.release()
    assert await shared.in_use() == 0
    assert b_side.waiting == 0


async def test_a_timeout_that_is_not_the_tenants_cap_is_the_budget_timeout(shared: Shared) -> None:
    capped = Tenant("a", "a", max_bytes_in_use=50)
    (budget,) = await shared.make(1, timeout_s=0.2)
    held = await budget.reserve(100, tenant=B)
    with pytest.raises(RateLimited, match=r"limits\.admission_timeout_s=0\.2") as raised:
        await budget.reserve(10, tenant=capped)
    assert raised.value.reason == "budget_timeout"
    held.release()
    assert await shared.in_use() == 0


async def test_a_tenants_waiting_cap_is_429_at_once_naming_the_key(shared: Shared) -> None:
    tenant = Tenant("a", "a", max_waiting=1, settings_key="limits.fairness.tenants.a")
    a_side, b_side = await shared.make(2, capacity=10)
    held = await a_side.reserve(10, tenant=B)
    first = await ask(a_side, 10, tenant=tenant)
    # The bound is the tenant's in the cluster: the other process refuses its second request.
    with pytest.raises(RateLimited, match=r"limits\.fairness\.tenants\.a\.max_waiting=1") as raised:
        await b_side.reserve(10, tenant=tenant)
    assert raised.value.reason == "tenant_cap"
    other = await ask(b_side, 10, tenant=B)  # other tenants still queue
    held.release()
    (await asyncio.wait_for(first, 10)).release()
    (await asyncio.wait_for(other, 10)).release()
    assert await shared.in_use() == 0


@pytest.mark.parametrize("bound", ["max_queued_requests", "max_waiting"])
async def test_a_bound_of_zero_waiting_requests_still_admits_a_request_whose_bytes_are_free(
    shared: Shared, bound: str
) -> None:
    """`limits.max_queued_requests` and a tenant's `max_waiting` bound the requests that wait: at 0, a request whose
    bytes are free and that nobody waits before is granted at once, and one that would wait is refused at once
    naming the bound, on both backends alike."""
    tenant = Tenant(
        "z", "z", max_waiting=0 if bound == "max_waiting" else None, settings_key="limits.fairness.tenants.z"
    )
    (budget,) = await shared.make(1, capacity=40, max_queued=0 if bound == "max_queued_requests" else None)
    held = await budget.reserve(30, tenant=tenant)
    with pytest.raises(RateLimited) as raised:
        await budget.reserve(20, tenant=tenant)
    if bound == "max_queued_requests":
        assert "limits.max_queued_requests=0" in str(raised.value)
        assert raised.value.reason == "queue_full"
    else:
        assert "limits.fairness.tenants.z.max_waiting=0" in str(raised.value)
        assert raised.value.reason == "tenant_cap"
    fits = await budget.reserve(10, tenant=tenant)
    held.release()
    fits.release()
    assert await shared.in_use() == 0


# -- bands -------------------------------------------------------------------------------------------------------


async def test_interactive_goes_before_batch_and_batch_never_passes_a_waiting_interactive(shared: Shared) -> None:
    a_side, b_side = await shared.make(2, batch_timeout_s=10.0)
    first, second = await a_side.reserve(50, tenant=A), await a_side.reserve(50, tenant=A)
    batch = await ask(b_side, 10, tenant=A, band=Band.BATCH)
    interactive = await ask(a_side, 100, tenant=B)
    first.release()
    # 10 bytes would fit, but an interactive request waits for room.
    assert await shared.in_use() == 50
    assert not batch.done()
    second.release()
    granted = await asyncio.wait_for(interactive, 10)
    assert await shared.in_use() == 100
    assert not batch.done()
    granted.release()
    (await asyncio.wait_for(batch, 10)).release()
    assert await shared.in_use() == 0


async def test_batch_has_its_own_admission_timeout(shared: Shared) -> None:
    a_side, b_side = await shared.make(2, capacity=10, timeout_s=0.2, batch_timeout_s=30.0)
    held = await a_side.reserve(10, tenant=A)
    batch = await ask(b_side, 10, tenant=B, band=Band.BATCH)
    with pytest.raises(RateLimited):
        await a_side.reserve(10, tenant=B)
    assert not batch.done()
    held.release()
    (await asyncio.wait_for(batch, 10)).release()
    assert await shared.in_use() == 0


# -- the properties ----------------------------------------------------------------------------------------------


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=operations(30), timeout_s=st.sampled_from([None, 0.003, 30.0]))
def test_capacity_is_conserved_on_every_interleaving_with_several_tenants(
    redis_server: RedisServer, ops: list[Op], timeout_s: float | None
) -> None:
    asyncio.run(interleave_on_redis(redis_server, ops, timeout_s, tenant_of))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    asks=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 60)), min_size=1, max_size=30),
    releases=st.lists(st.integers(0, 29), max_size=30),
)
def test_no_waiting_request_starves_with_several_tenants_and_weights(
    redis_server: RedisServer, asks: list[tuple[int, int]], releases: list[int]
) -> None:
    def unbounded(i: int) -> tuple[Tenant, Band]:
        return UNBOUNDED[i % 3], tenant_of(i)[1]

    async def run() -> None:
        budget = _budget(redis_server, f"starve:{uuid.uuid4().hex[:8]}", timeout_s=None, batch_timeout_s=None)
        await budget.start()
        await none_starve(budget, asks, releases, capacity=100, tenant_of=unbounded, within_s=30)
        assert await _settled(budget) == (0, 0)
        await budget.aclose()

    asyncio.run(run())


# -- tenant ids, Redis state -------------------------------------------------------------------------------------

ODD_IDS = ("a", "a b", "a\nb", "{x}", "0:a", "q:0:a", "é", "}", "", "a" * 300)


async def test_any_tenant_id_is_a_tenant_of_its_own_in_the_slot_of_the_prefix(
    redis_server: RedisServer,
) -> None:
    budget = _budget(redis_server, f"ids:{uuid.uuid4().hex[:8]}", capacity=1000)
    await budget.start()
    tenants = [Tenant(tenant_id, "other", max_bytes_in_use=10) for tenant_id in ODD_IDS]
    held = [await budget.reserve(10, tenant=tenant) for tenant in tenants]
    # Each one is at its own cap, whatever the others: its second request waits, in both bands.
    waiting = [await ask(budget, 10, tenant=tenant, band=band) for tenant in tenants for band in Band]
    records = tenant_records(redis_server, budget)
    assert sorted(records) == sorted(ODD_IDS)
    assert set(records.values()) == {10}
    with redis_server.client() as client:
        for tenant in tenants:
            for band in Band:
                assert client.zcard(budget.tenant_queue_key(tenant.id, band)) == 1
        keys = client.keys(budget.base + "*")
    assert len(keys) > len(ODD_IDS) * 2
    assert {redis.crc.key_slot(key.encode()) for key in keys} == {redis.crc.key_slot(budget.base.encode())}
    for reservation in held:
        reservation.release()
    for task in waiting:
        (await asyncio.wait_for(task, 10)).release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


@pytest.mark.parametrize(
    ("prefix", "base"),
    [("mmgate:budget", "{mmgate:budget}"), ("app:{b}", "app:{b}"), ("a{b", "{a{b}"), ("a{}b}", "{a{}b}}")],
)
def test_the_key_base_has_one_hash_tag(prefix: str, base: str) -> None:
    budget = RedisBudget(url="redis://127.0.0.1:1/0", key_prefix=prefix, capacity=1, timeout_s=1, max_queued=None)
    assert budget.keys["queue"] == base + ":queue"


async def test_a_redis_past_its_maxmemory_frees_tenant_records_itself_and_admits_again(own_redis: RedisServer) -> None:
    """Tenant records fill a Redis configured as the docs advise (`maxmemory`, `noeviction`): a reserve needs
    memory and gets 503, but the heartbeats that renew, reap and sweep still run, the records of idle tenants go
    once their lead is older than the window, and reserves are admitted again with nobody stepping in."""
    mib = 1 << 20
    budget = _budget(
        own_redis,
        f"full:{uuid.uuid4().hex[:8]}",
        capacity=100 * mib,
        lease_ttl_s=0.6,
        window_s=0.5,
        on_unavailable="reject",
    )
    await budget.start()
    holder = await budget.reserve(90 * mib, tenant=Tenant("holder", "other"))
    large = [await ask(budget, 95 * mib, tenant=stranger()) for _ in range(200)]
    with own_redis.client() as client:
        before = int(client.info("memory")["used_memory"])
    # Served while 200 others wait, each one leads the class's clock for about 200 grants after its own.
    for _ in range(400):
        (await asyncio.wait_for(budget.reserve(10 * mib, tenant=stranger()), 10)).release()
    await budget.flush()
    assert len(tenant_records(own_redis, budget)) > 350
    with own_redis.client() as client:
        grown = int(client.info("memory")["used_memory"]) - before
        assert grown > 16 << 10
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", before + grown // 2)
    with pytest.raises(BudgetBackendUnavailable):
        await budget.reserve(10 * mib, tenant=stranger())
    admitted = None
    for _ in range(100):
        await asyncio.sleep(0.1)
        try:
            admitted = await asyncio.wait_for(budget.reserve(10 * mib, tenant=stranger()), 10)
            break
        except BudgetBackendUnavailable:
            continue
    assert admitted is not None, "the budget stayed refused after the records' window"
    assert len(tenant_records(own_redis, budget)) <= 202
    admitted.release()
    with own_redis.client() as client:
        client.config_set("maxmemory", 0)
    await give_up(large)
    holder.release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


# -- crash safety and Redis restarts, with tenants ------------------------------------------------------------------


@pytest.mark.slow
async def test_a_killed_holders_bytes_come_back_to_its_tenant(redis_server: RedisServer) -> None:
    """The holder held its tenant's whole cap; once it is killed and its lease expires, the tenant's next request is
    granted: the lease's bytes left the tenant's count, not only the cluster's."""
    prefix = f"kill:{uuid.uuid4().hex[:8]}"
    holder = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _HOLDER, redis_server.url, prefix, "60", "t", "60"),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 20) == b"held\n"
        budget = _budget(redis_server, prefix, lease_ttl_s=1.0)
        await budget.start()
        tenant = Tenant("t", "t", max_bytes_in_use=60)
        waiter = await ask(budget, 60, tenant=tenant)
        other = await asyncio.wait_for(budget.reserve(40, tenant=B), 10)  # the cluster has room; t has none
        assert not waiter.done()
        holder.kill()
        reservation = await asyncio.wait_for(waiter, 10)
        assert budget.stats.leases_reaped == 1
        assert tenant_records(redis_server, budget)["t"] == 60
        reservation.release()
        other.release()
        assert await _settled(budget) == (0, 0)
        await budget.aclose()
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()


async def test_leases_reasserted_after_redis_lost_its_state_count_for_their_tenants(own_redis: RedisServer) -> None:
    prefix = f"restart:{uuid.uuid4().hex[:8]}"
    capped = Tenant("t", "t", max_bytes_in_use=60)
    gateways = [_budget(own_redis, prefix, lease_ttl_s=1.0, on_unavailable="reject") for _ in range(2)]
    for budget in gateways:
        await budget.start()
    held = await gateways[0].reserve(60, tenant=capped)
    await asyncio.to_thread(own_redis.kill)
    await asyncio.to_thread(own_redis.start)
    await _until(lambda: gateways[0].stats.leases_reasserted == 1, within=5)
    # The re-asserted lease is the tenant's again: its next request waits for it, another tenant's does not.
    same = await ask(gateways[1], 10, tenant=capped)
    other = await asyncio.wait_for(gateways[1].reserve(40, tenant=B), 10)
    assert tenant_records(own_redis, gateways[0])["t"] == 60
    assert not same.done()
    held.release()
    (await asyncio.wait_for(same, 10)).release()
    other.release()
    await gateways[0].flush()
    assert await _settled(gateways[1]) == (0, 0)
    for budget in gateways:
        await budget.aclose()


# -- the local fallback and the factory ---------------------------------------------------------------------------


async def test_the_local_fallback_queues_by_tenant_and_band(own_redis: RedisServer) -> None:
    budget = _budget(own_redis, f"fallback:{uuid.uuid4().hex[:8]}", lease_ttl_s=1.0, on_unavailable="local")
    await budget.start()
    await asyncio.to_thread(own_redis.stop)
    await budget.refresh()  # learns that Redis is gone
    assert budget.backend_degraded
    capped = Tenant("a", "a", max_bytes_in_use=30)
    held = await budget.reserve(30, tenant=capped)
    assert budget.fallback.budget.tenant_in_use("a") == 30
    over = await ask(budget, 10, tenant=capped, band=Band.BATCH)
    other = await asyncio.wait_for(budget.reserve(50, tenant=B), 1)  # not behind A's capped head
    held.release()
    (await asyncio.wait_for(over, 5)).release()
    other.release()
    assert budget.in_use == 0
    await budget.aclose()


def test_the_redis_backend_is_built_with_the_fairness_settings() -> None:
    config = GatewaySettings(
        limits={  # type: ignore[arg-type]
            "budget_backend": "redis",
            "fairness": {"window_s": 7, "batch_admission_timeout_s": 90},
        },
        redis={"url": "redis://127.0.0.1:1/0"},  # type: ignore[arg-type]
    )
    budget = build_budget(config, GatewayMetrics(shared_budget=True))
    assert isinstance(budget, RedisBudget)
    assert (budget.window_s, budget.batch_timeout_s) == (7, 90)
    assert budget.fallback.budget.window_s == 7
    assert "fair queueing between tenants by api_key" in describe(config)
    off = GatewaySettings(
        limits={"budget_backend": "redis", "fairness": {"enabled": False}},  # type: ignore[arg-type]
        redis={"url": "redis://127.0.0.1:1/0"},  # type: ignore[arg-type]
    )
    budget = build_budget(off, GatewayMetrics(shared_budget=True))
    assert isinstance(budget, RedisBudget)
    assert budget.batch_timeout_s == off.limits.admission_timeout_s
    assert "(FIFO)" in describe(off)
