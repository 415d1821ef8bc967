from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.budget.local import LocalBudget, UnlimitedBudget
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from serving.asgi import ClientDisconnected, until_disconnect
from tests.gateway.budget.interleavings import Client, Op, interleave, operations


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
    assert metrics.budget_capacity_bytes._value.get() == 1000
    reservation = await budget.reserve(400)
    assert metrics.budget_in_use_bytes._value.get() == 400
    reservation.release()
    assert metrics.budget_in_use_bytes._value.get() == 0


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
