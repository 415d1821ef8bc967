"""`RedisBudget` against a real `redis-server` started on a free loopback port for these tests: reserving, waiting,
leaving, the cap and the queue bound across budgets."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.budget.base import Reservation
from gateway.budget.redis import RedisBudget
from gateway.errors import RateLimited
from tests.gateway.budget.interleavings import Op, operations
from tests.gateway.budget.redis.helpers import (
    _budget,
    _settled,
    _until,
    interleave_on_redis,
)
from tests.redis_server import RedisServer

T = TypeVar("T")


class LoopThread:
    """An event loop of its own in a thread; `run(coro)` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return self.submit(coroutine).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


# -- basics ------------------------------------------------------------------------------------------------------


async def test_reserve_release_and_the_unbound_release_the_admission_path_uses(
    redis_server: RedisServer, prefix: str
) -> None:
    budget = _budget(redis_server, prefix)
    await budget.start()
    first = await budget.reserve(60)
    second = await budget.reserve(40)
    assert (budget.in_use, budget.cluster_in_use) == (100, 100)
    first.release()
    first.release()  # idempotent
    assert budget.in_use == 40
    Reservation.release(second)  # the admission path's `discard=Reservation.release`
    assert budget.in_use == 0
    assert await _settled(budget) == (0, 0)
    with pytest.raises(ValueError, match="can never fit"):
        await budget.reserve(101)
    await budget.aclose()


async def test_no_overtaking_across_budgets(redis_server: RedisServer, prefix: str) -> None:
    a, b, c = (_budget(redis_server, prefix) for _ in range(3))
    for budget in (a, b, c):
        await budget.start()
    held = await a.reserve(50)
    head = asyncio.ensure_future(b.reserve(60))  # does not fit
    await _until(lambda: b.cluster_waiting == 1)
    small = asyncio.ensure_future(c.reserve(10))  # would fit, but it is behind the head
    await _until(lambda: c.cluster_waiting == 2)
    await asyncio.sleep(0.2)
    assert not small.done()
    held.release()
    first, second = await asyncio.wait_for(asyncio.gather(head, small), 2)
    assert (b.in_use, c.in_use) == (60, 10)
    first.release()
    second.release()
    await b.flush()
    assert await _settled(c) == (0, 0)
    for budget in (a, b, c):
        await budget.aclose()


def test_fifo_order_holds_across_budgets_on_three_event_loops(redis_server: RedisServer, prefix: str) -> None:
    loops = [LoopThread() for _ in range(3)]
    budgets = [_budget(redis_server, prefix) for _ in loops]
    order: list[int] = []
    lock = threading.Lock()

    async def take(budget: RedisBudget, index: int) -> None:
        reservation = await budget.reserve(60)  # one at a time: 60 + 60 > 100
        with lock:
            order.append(index)
        await asyncio.sleep(0.005)
        reservation.release()

    try:
        for loop, budget in zip(loops, budgets, strict=True):
            loop.run(budget.start())
        holder = loops[0].run(budgets[0].reserve(100))
        futures = []
        with redis_server.client() as client:
            for index in range(12):
                futures.append(loops[index % 3].submit(take(budgets[index % 3], index)))
                # The next request is sent once this one holds its place in the queue.
                deadline = time.monotonic() + 5
                while client.zcard(budgets[0].keys["queue"]) < index + 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.002)
        loops[0].loop.call_soon_threadsafe(holder.release)
        for future in futures:
            future.result(10)
        assert order == list(range(12))
        for loop, budget in zip(loops, budgets, strict=True):
            loop.run(budget.flush())
        assert loops[0].run(_settled(budgets[0])) == (0, 0)
    finally:
        for loop, budget in zip(loops, budgets, strict=True):
            loop.run(budget.aclose())
            loop.close()


@pytest.mark.parametrize("instances", [2, 3])
def test_the_global_cap_holds_under_200_concurrent_reservations(
    redis_server: RedisServer, prefix: str, instances: int
) -> None:
    capacity = 1000
    loops = [LoopThread() for _ in range(instances)]
    budgets = [_budget(redis_server, prefix, capacity=capacity, timeout_s=60.0) for _ in loops]
    lock = threading.Lock()
    held = [0]
    most_held = [0]
    sampled = {"used": 0, "leases": 0, "queued": 0, "samples": 0}
    stop = threading.Event()

    def sample() -> None:
        with redis_server.client() as client:
            keys = budgets[0].keys
            while not stop.is_set():
                pipe = client.pipeline(transaction=True)
                pipe.get(keys["used"])
                pipe.hvals(keys["leases"])
                pipe.zcard(keys["queue"])
                used, leases, queued = pipe.execute()
                sampled["used"] = max(sampled["used"], int(used or 0))
                sampled["leases"] = max(sampled["leases"], sum(int(lease.split()[0]) for lease in leases))
                sampled["queued"] = max(sampled["queued"], int(queued))
                sampled["samples"] += 1
                time.sleep(0.0005)

    async def run(budget: RedisBudget, seed: int, count: int) -> None:
        rng = random.Random(seed)

        async def one() -> None:
            nbytes = rng.randint(capacity // 10, capacity * 2 // 5)
            reservation = await budget.reserve(nbytes)
            with lock:
                held[0] += nbytes
                most_held[0] = max(most_held[0], held[0])
            await asyncio.sleep(rng.uniform(0.001, 0.006))
            with lock:
                held[0] -= nbytes
            reservation.release()

        await asyncio.gather(*(one() for _ in range(count)))
        await budget.flush()

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        for loop, budget in zip(loops, budgets, strict=True):
            loop.run(budget.start())
        sampler.start()
        shares = [200 // instances + (1 if i < 200 % instances else 0) for i in range(instances)]
        futures = [
            loop.submit(run(budget, seed, count))
            for seed, (loop, budget, count) in enumerate(zip(loops, budgets, shares, strict=True))
        ]
        for future in futures:
            future.result(60)
        stop.set()
        sampler.join(5)
        assert sum(shares) == 200
        # What the callers held at once, and what Redis counted, never passed the cap ...
        assert most_held[0] <= capacity
        assert sampled["used"] <= capacity
        assert sampled["leases"] <= capacity
        # ... while the budget was the bottleneck (a test that passes with nothing shared would not show this).
        assert most_held[0] > capacity // 2
        assert sampled["queued"] >= 50
        assert sampled["samples"] > 20
        assert loops[0].run(_settled(budgets[0])) == (0, 0)
    finally:
        stop.set()
        for loop, budget in zip(loops, budgets, strict=True):
            loop.run(budget.aclose())
            loop.close()


# -- leaving, timeouts and the queue bound ----------------------------------------------------------------------


async def test_a_cancelled_waiter_frees_its_ticket_at_once(redis_server: RedisServer, prefix: str) -> None:
    a, b = _budget(redis_server, prefix), _budget(redis_server, prefix)
    await a.start()
    await b.start()
    held = await a.reserve(50)
    head = asyncio.ensure_future(a.reserve(100))  # blocks everyone behind it
    await _until(lambda: a.cluster_waiting == 1)
    behind = asyncio.ensure_future(b.reserve(50))
    await _until(lambda: b.cluster_waiting == 2)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    assert a.waiting == 0
    # The ticket left Redis before the cancelled call returned, and the next waiter was granted by that same call.
    with redis_server.client() as client:
        assert client.zcard(a.keys["queue"]) == 0
    reservation = await asyncio.wait_for(behind, 10)
    assert (b.stats.grants_by_message, b.stats.grants_by_recheck) == (1, 0)  # by message, not by the re-check
    assert b.waiting == 0
    reservation.release()
    held.release()
    await a.flush()
    assert await _settled(b) == (0, 0)
    await a.aclose()
    await b.aclose()


async def test_a_reserve_cancelled_before_redis_answered_gives_back_what_redis_then_grants(
    own_redis: RedisServer, prefix: str
) -> None:
    budget = _budget(own_redis, prefix, socket_timeout_s=2.0)
    await budget.start()
    (await budget.reserve(1)).release()  # Redis has the reserve script cached: the paused call is not a NOSCRIPT
    # The reserve waits in Redis's input.
    own_redis.client().execute_command("CLIENT", "PAUSE", 300, "ALL")  # type: ignore[no-untyped-call]
    reserve = asyncio.ensure_future(budget.reserve(60))
    await asyncio.sleep(0.1)
    reserve.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserve  # returns once Redis ran the reserve (a grant) and then the abandon written after it
    assert (budget.in_use, budget.waiting) == (0, 0)
    assert await _settled(budget) == (0, 0)
    assert await budget.reserve(100) is not None  # the whole cap is free again
    await budget.aclose()


async def test_admission_timeout_is_429_with_retry_after_and_leaves_the_queue(
    redis_server: RedisServer, prefix: str
) -> None:
    budget = _budget(redis_server, prefix, timeout_s=0.2, lease_ttl_s=30.0)  # the re-check would come after 10 s
    await budget.start()
    held = await budget.reserve(100)
    started = time.monotonic()
    with pytest.raises(RateLimited) as raised:
        await budget.reserve(50)
    # The waiter's own timer fired (the message names it; the bytes were never freed, so no re-check could grant),
    # never early.
    assert time.monotonic() - started >= 0.2 * 0.9
    assert "limits.admission_timeout_s=0.2" in raised.value.message
    assert "limits.max_multimodal_cpu_bytes=100" in raised.value.message
    assert raised.value.headers["retry-after"] == "1"
    assert raised.value.reason == "budget_timeout"
    assert budget.waiting == 0
    held.release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


async def test_the_queue_bound_is_the_clusters_and_refuses_at_once(redis_server: RedisServer, prefix: str) -> None:
    calls: list[str] = []
    a = _budget(redis_server, prefix, max_queued=1)
    b = _budget(redis_server, prefix, max_queued=1, on_round_trip=lambda name, _: calls.append(name))
    await a.start()
    await b.start()
    held = await a.reserve(100)
    waiting = asyncio.ensure_future(a.reserve(10))
    await _until(lambda: a.cluster_waiting == 1)
    with pytest.raises(RateLimited, match=r"limits.max_queued_requests=1") as raised:
        await b.reserve(1)
    # Refused on the answer to its one reserve call: it never queued (no abandon to leave the queue).
    assert [name for name in calls if name in ("reserve", "abandon")] == ["reserve"]
    assert raised.value.reason == "queue_full"
    assert b.waiting == 0
    held.release()
    (await asyncio.wait_for(waiting, 1)).release()
    await a.flush()
    assert await _settled(b) == (0, 0)
    await a.aclose()
    await b.aclose()


# -- the interleaving property ----------------------------------------------------------------------------------


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=operations(30), timeout_s=st.sampled_from([None, 0.003, 30.0]))
def test_capacity_is_conserved_on_every_interleaving(
    redis_server: RedisServer, ops: list[Op], timeout_s: float | None
) -> None:
    asyncio.run(interleave_on_redis(redis_server, ops, timeout_s))
