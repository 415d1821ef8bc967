from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.budget.local import LocalBudget, UnlimitedBudget
from gateway.config import Band
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant
from serving.asgi import ClientDisconnected, until_disconnect
from tests.gateway.budget.interleavings import Client, Op, interleave, operations
from tests.observe import metric_in


async def test_reserve_and_release() -> None:
    budget = LocalBudget(100, timeout_s=1, max_queued=10)
    first = await budget.reserve(60)
    second = await budget.reserve(40)
    assert budget.in_use == 100
    first.release()
    first.release()  # idempotent
    assert budget.in_use == 40
    second.release()
    assert budget.in_use == 0


async def test_waiters_are_served_fifo_without_overtaking() -> None:
    budget = LocalBudget(100, timeout_s=5, max_queued=10)
    held = await budget.reserve(100)
    order: list[str] = []

    async def take(name: str, nbytes: int) -> None:
        reservation = await budget.reserve(nbytes)
        order.append(name)
        await asyncio.sleep(0.01)
        reservation.release()

    big = asyncio.ensure_future(take("big", 90))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("small", 10))
    await asyncio.sleep(0.01)
    assert budget.waiting == 2
    held.release()
    await asyncio.gather(big, small)
    # "small" fit alongside "big" only once "big" had its bytes: it never went first.
    assert order == ["big", "small"]
    assert budget.in_use == 0


async def test_timeout_is_429_with_retry_after_and_leaves_the_queue() -> None:
    budget = LocalBudget(100, timeout_s=0.05, max_queued=10)
    held = await budget.reserve(100)
    with pytest.raises(RateLimited) as raised:
        await budget.reserve(50)
    assert "limits.admission_timeout_s=0.05" in raised.value.message
    assert "limits.max_multimodal_cpu_bytes=100" in raised.value.message
    assert raised.value.headers["retry-after"] == "1"
    assert raised.value.reason == "budget_timeout"
    assert budget.waiting == 0
    held.release()
    assert budget.in_use == 0


async def test_queue_cap_refuses_at_once() -> None:
    budget = LocalBudget(10, timeout_s=5, max_queued=1)
    held = await budget.reserve(10)
    waiting = asyncio.ensure_future(budget.reserve(10))
    await asyncio.sleep(0)
    with pytest.raises(RateLimited, match=r"limits.max_queued_requests=1") as raised:
        await budget.reserve(1)
    assert raised.value.reason == "queue_full"
    held.release()
    (await waiting).release()
    assert budget.in_use == 0


async def test_cancelled_waiter_leaves_at_once_and_unblocks_the_rest() -> None:
    budget = LocalBudget(100, timeout_s=5, max_queued=10)
    held = await budget.reserve(50)
    head = asyncio.ensure_future(budget.reserve(100))  # blocks everyone behind it
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(budget.reserve(50))
    await asyncio.sleep(0)
    assert budget.waiting == 2
    head.cancel()
    reservation = await asyncio.wait_for(behind, 1)  # the head left: the next one fits now
    assert budget.waiting == 0
    reservation.release()
    held.release()
    assert budget.in_use == 0


async def test_gauges_follow_the_budget() -> None:
    metrics = GatewayMetrics()
    budget = LocalBudget(1000, timeout_s=5, max_queued=10, metrics=metrics)
    assert metric_in(metrics.render().decode(), "mmgate_budget_capacity_bytes") == 1000
    reservation = await budget.reserve(400)
    assert metric_in(metrics.render().decode(), "mmgate_budget_in_use_bytes") == 400
    reservation.release()
    assert metric_in(metrics.render().decode(), "mmgate_budget_in_use_bytes") == 0


async def test_unlimited_budget_never_waits() -> None:
    budget = UnlimitedBudget()
    reservations = [await budget.reserve(1 << 40) for _ in range(3)]
    assert budget.in_use == 0
    for reservation in reservations:
        reservation.release()


@pytest.mark.parametrize("timeout_s", [30.0, None])
async def test_a_grant_that_races_a_disconnect_is_never_leaked(timeout_s: float | None) -> None:
    budget = LocalBudget(100, timeout_s=timeout_s, max_queued=10)
    holder = await budget.reserve(100)
    client = Client()
    waiter = asyncio.ensure_future(until_disconnect(budget.reserve(60), client.receive))
    await asyncio.sleep(0.01)
    assert budget.waiting == 1
    # The client leaves in the same loop turn as the budget grants its bytes.
    client.gone.set()
    holder.release()
    try:
        reservation = await waiter
    except ClientDisconnected:
        pass
    else:
        # The grant won the race: the caller holds it and must be able to give it back.
        assert budget.in_use == 60
        reservation.release()
    assert budget.in_use == 0
    assert budget.waiting == 0


async def test_a_waiter_cancelled_in_the_turn_of_its_grant_is_cancelled_and_gives_the_bytes_back() -> None:
    budget = LocalBudget(100, timeout_s=30, max_queued=10)
    holder = await budget.reserve(100)
    waiter = asyncio.ensure_future(budget.reserve(60))
    await asyncio.sleep(0.01)
    holder.release()  # grants the waiter's bytes ...
    waiter.cancel()  # ... and its owner gives up before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.in_use == 0
    assert budget.waiting == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations(40), timeout_s=st.sampled_from([None, 0.002, 30.0]))
def test_capacity_is_conserved_on_every_interleaving(ops: list[Op], timeout_s: float | None) -> None:
    async def run() -> None:
        await interleave(LocalBudget(100, timeout_s=timeout_s, max_queued=4), ops, capacity=100)

    asyncio.run(run())


# -- fair queueing between tenants ---------------------------------------------------------------------------------

A = Tenant("a", "a")
B = Tenant("b", "b")


async def test_a_flooding_tenant_does_not_hold_back_another_tenants_request() -> None:
    budget = LocalBudget(100, timeout_s=5, max_queued=None)
    holders = [await budget.reserve(50, tenant=A) for _ in range(2)]
    flood = [asyncio.ensure_future(budget.reserve(50, tenant=A)) for _ in range(10)]
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.reserve(10, tenant=B))
    await asyncio.sleep(0)
    assert budget.waiting == 11
    holders[0].release()  # one of A's holds ends: B has had no service, so B goes first
    granted = await asyncio.wait_for(small, 1)
    assert budget.tenant_in_use("b") == 10
    granted.release()
    holders[1].release()
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    assert (budget.in_use, budget.waiting) == (0, 0)


async def test_one_tenant_is_fifo_without_overtaking() -> None:
    budget = LocalBudget(100, timeout_s=5, max_queued=None)
    held = await budget.reserve(100, tenant=A)
    big = asyncio.ensure_future(budget.reserve(90, tenant=A))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.reserve(10, tenant=A))
    await asyncio.sleep(0)
    held.release()
    await asyncio.sleep(0)
    # Both fit once the 100 are back; big was granted first.
    assert big.done()
    assert small.done()
    assert budget.in_use == 100
    big.result().release()
    small.result().release()


async def test_weights_share_the_budget_under_contention() -> None:
    """Two tenants keep the budget saturated with equal requests held equally long: grants follow the weights."""
    heavy = Tenant("heavy", "heavy", weight=3.0)
    light = Tenant("light", "light", weight=1.0)
    budget = LocalBudget(40, timeout_s=None, max_queued=None, window_s=1000)
    granted = {"heavy": 0, "light": 0}

    async def client(tenant: Tenant) -> None:
        while sum(granted.values()) < 400:
            reservation = await budget.reserve(10, tenant=tenant)
            granted[tenant.id] += 1
            await asyncio.sleep(0.002)
            reservation.release()

    clients = [asyncio.ensure_future(client(tenant)) for tenant in (heavy, light) for _ in range(6)]
    await asyncio.wait_for(asyncio.gather(*clients), 30)
    share = granted["heavy"] / sum(granted.values())
    assert 0.65 <= share <= 0.85, granted  # 3:1 is 0.75


async def test_a_tenant_at_its_cap_waits_without_blocking_others_and_its_429_names_the_key() -> None:
    capped = Tenant("a", "a", max_bytes_in_use=50, settings_key="limits.fairness.tenants.a")
    budget = LocalBudget(100, timeout_s=0.05, max_queued=None)
    held = await budget.reserve(50, tenant=capped)
    over = asyncio.ensure_future(budget.reserve(10, tenant=capped))
    await asyncio.sleep(0)
    other = await asyncio.wait_for(budget.reserve(40, tenant=B), 1)  # not behind A's capped head
    with pytest.raises(RateLimited, match=r"limits\.fairness\.tenants\.a\.max_bytes_in_use=50") as raised:
        await over
    assert raised.value.reason == "tenant_cap"
    with pytest.raises(RateLimited, match=r"can never fit limits\.fairness\.tenants\.a\.max_bytes_in_use=50"):
        await budget.reserve(60, tenant=capped)
    held.release()
    other.release()
    assert (budget.in_use, budget.waiting) == (0, 0)


async def test_a_tenants_waiting_cap_is_429_at_once_naming_the_key() -> None:
    tenant = Tenant("a", "a", max_waiting=1, settings_key="limits.fairness.tenants.a")
    budget = LocalBudget(10, timeout_s=5, max_queued=None)
    held = await budget.reserve(10, tenant=B)
    first = asyncio.ensure_future(budget.reserve(10, tenant=tenant))
    await asyncio.sleep(0)
    with pytest.raises(RateLimited, match=r"limits\.fairness\.tenants\.a\.max_waiting=1") as raised:
        await budget.reserve(10, tenant=tenant)
    assert raised.value.reason == "tenant_cap"
    other = asyncio.ensure_future(budget.reserve(10, tenant=B))  # other tenants still queue
    await asyncio.sleep(0)
    assert budget.waiting == 2
    held.release()
    (await first).release()
    (await other).release()


async def test_interactive_goes_before_batch_and_batch_never_passes_a_waiting_interactive() -> None:
    budget = LocalBudget(100, timeout_s=5, max_queued=None, batch_timeout_s=5)
    first, second = await budget.reserve(50, tenant=A), await budget.reserve(50, tenant=A)
    batch = asyncio.ensure_future(budget.reserve(10, tenant=A, band=Band.BATCH))
    await asyncio.sleep(0)
    interactive = asyncio.ensure_future(budget.reserve(100, tenant=B))
    await asyncio.sleep(0)
    first.release()
    await asyncio.sleep(0)
    assert not batch.done()  # 10 bytes would fit, but an interactive request waits for room
    second.release()
    await asyncio.sleep(0)
    assert interactive.done()
    assert not batch.done()
    interactive.result().release()
    (await asyncio.wait_for(batch, 1)).release()


async def test_batch_has_its_own_admission_timeout() -> None:
    budget = LocalBudget(10, timeout_s=0.02, max_queued=None, batch_timeout_s=0.2)
    held = await budget.reserve(10, tenant=A)
    batch = asyncio.ensure_future(budget.reserve(10, tenant=B, band=Band.BATCH))
    with pytest.raises(RateLimited):
        await budget.reserve(10, tenant=B)
    assert not batch.done()
    held.release()
    (await asyncio.wait_for(batch, 1)).release()


TENANTS = (
    Tenant("t0", "t0", weight=1.0),
    Tenant("t1", "t1", weight=3.0, max_bytes_in_use=60, max_waiting=3),
    Tenant("t2", "other", weight=0.5),
)

# The same tenants without a bound on waiting requests (every request queues).
UNBOUNDED = tuple(dataclasses.replace(tenant, max_waiting=None) for tenant in TENANTS)


def tenant_of(i: int) -> tuple[Tenant, Band]:
    return TENANTS[i % 3], Band.BATCH if i % 2 else Band.INTERACTIVE


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations(40), timeout_s=st.sampled_from([None, 0.002, 30.0]))
def test_capacity_is_conserved_on_every_interleaving_with_several_tenants(
    ops: list[Op], timeout_s: float | None
) -> None:
    async def run() -> None:
        budget = LocalBudget(
            100, timeout_s=timeout_s, max_queued=4, batch_timeout_s=timeout_s, metrics=GatewayMetrics()
        )
        await interleave(budget, ops, capacity=100, tenant_of=tenant_of)

    asyncio.run(run())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    asks=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 60)), min_size=1, max_size=30),
    releases=st.lists(st.integers(0, 29), max_size=30),
)
def test_no_waiting_request_starves(asks: list[tuple[int, int]], releases: list[int]) -> None:
    """Without timeouts, every request is granted as long as holders keep giving their bytes back."""

    async def run() -> None:
        budget = LocalBudget(100, timeout_s=None, max_queued=None, batch_timeout_s=None)
        tasks = [
            asyncio.ensure_future(budget.reserve(n, tenant=UNBOUNDED[i % 3], band=tenant_of(i)[1])) for i, n in asks
        ]
        await asyncio.sleep(0)
        for k in releases:  # some holders give back early, in any order
            task = tasks[k % len(tasks)]
            if task.done():
                task.result().release()
            await asyncio.sleep(0)
        pending = set(tasks)
        for _ in range(len(tasks) + 1):
            for task in list(pending):
                if task.done():
                    assert 0 <= budget.in_use <= 100
                    task.result().release()
                    pending.discard(task)
            await asyncio.sleep(0)
        assert not pending, f"{len(pending)} starved with {budget.in_use} in use"
        assert (budget.in_use, budget.waiting) == (0, 0)

    asyncio.run(run())
