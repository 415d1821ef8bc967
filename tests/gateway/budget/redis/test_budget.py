"""The shared media budget against a real `redis-server` started on a free loopback port for these tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import signal
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.budget.base import Reservation
from gateway.budget.redis import BudgetBackendUnavailable, BudgetMisconfigured, RedisBudget
from gateway.budget.redis.scripts import OWN, SCRIPTS
from gateway.config import Band, OnUnavailable
from gateway.errors import RateLimited
from gateway.tenants import Tenant
from tests.gateway.budget.interleavings import Op, interleave, operations
from tests.redis_server import RedisServer, redis_server_binary
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[4]
T = TypeVar("T")


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:8]}"


def _budget(server: RedisServer, prefix: str, **options: Any) -> RedisBudget:
    settings: dict[str, Any] = {
        "capacity": 100,
        "timeout_s": 10.0,
        "max_queued": None,
        "lease_ttl_s": 10.0,
        "socket_timeout_s": 0.5,
    }
    settings.update(options)
    return RedisBudget(url=server.url, key_prefix=prefix, **settings)


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


async def _settled(budget: RedisBudget) -> tuple[int, int]:
    await budget.flush()
    await budget.refresh()
    return budget.cluster_in_use, budget.cluster_waiting


def queue_dead_ticket(
    server: RedisServer,
    budget: RedisBudget,
    ticket: str,
    nbytes: int,
    *,
    ttl_ms: int,
    who: str = "0 1.0 -1 -1 5 otherdefault",
) -> None:
    """Queue `ticket` through the reserve script as a process would that then dies: nobody refreshes it, and it
    expires `ttl_ms` after this call. `who` is the reserve call's "band weight own_cap max_waiting label_length
    label tenant"."""
    args = (budget.capacity, ttl_ms, "", budget.client.window, budget.max_tenants, ticket, nbytes, -1, who)
    with server.client() as client:
        reply = client.eval(SCRIPTS["reserve"], 1, budget.base, *args)  # type: ignore[no-untyped-call]
    assert int(reply[OWN]) == 0, "the dead ticket was granted, not queued"


async def _until(predicate: Any, within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


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


async def test_a_release_redis_did_not_answer_is_sent_again_at_the_next_heartbeat(
    redis_server: RedisServer, prefix: str
) -> None:
    budget = _budget(redis_server, prefix, lease_ttl_s=3.0)  # heartbeats every second; leases live 3 s
    await budget.start()
    reservation = await budget.reserve(60)
    scripts = budget.client.scripts
    failed: list[str] = []

    class ReleaseFailsTwice:
        """The written release's connection breaks, and so does the call that retries it at once."""

        def send(self, name: str, *args: str | int) -> asyncio.Future[Any] | None:
            if name == "release" and not failed:
                failed.append("written")
                broken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                broken.set_exception(RedisConnectionError("injected: the written release's connection broke"))
                return broken
            return scripts.send(name, *args)

        async def __call__(self, name: str, *args: str | int) -> Any:
            if name == "release" and failed == ["written"]:
                failed.append("called")
                raise RedisConnectionError("injected: the release's retry broke too")
            return await scripts(name, *args)

    budget.client.scripts = ReleaseFailsTwice()  # type: ignore[assignment]
    reservation.release()
    assert await _settled(budget) == (60, 0)  # Redis still counts the lease
    await _until(lambda: budget.cluster_in_use == 0, within=10)
    # Given back by the heartbeat's retry, not reaped once the unrenewed lease expired.
    assert budget.stats.leases_reaped == 0
    assert failed == ["written", "called"]
    budget.client.scripts = scripts
    await budget.aclose()


async def test_two_budgets_share_one_cap_and_waiters_learn_of_grants_by_message(
    redis_server: RedisServer, prefix: str
) -> None:
    a, b = _budget(redis_server, prefix), _budget(redis_server, prefix)  # TTL 10 s: re-checks every 3.3 s
    await a.start()
    await b.start()
    held = await a.reserve(70)
    waiter = asyncio.ensure_future(b.reserve(40))
    await _until(lambda: b.cluster_waiting == 1)
    await asyncio.sleep(0.1)
    assert not waiter.done()
    held.release()
    reservation = await asyncio.wait_for(waiter, 10)
    assert (b.stats.grants_by_message, b.stats.grants_by_recheck) == (1, 0)  # by message, not by the re-check
    assert (a.in_use, b.in_use) == (0, 40)
    reservation.release()
    assert await _settled(b) == (0, 0)
    await a.aclose()
    await b.aclose()


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


# -- crash safety ------------------------------------------------------------------------------------------------

# Argument: the URL, the key prefix, then optionally the bytes to hold (100) and the tenant's id and own cap.
_HOLDER = """
import asyncio, sys
from gateway.budget.redis import RedisBudget
from gateway.tenants import DEFAULT_TENANT, Tenant

async def main() -> None:
    budget = RedisBudget(url=sys.argv[1], key_prefix=sys.argv[2], capacity=100, timeout_s=5, max_queued=None,
                         lease_ttl_s=1.0)
    await budget.start()
    nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    tenant = DEFAULT_TENANT
    if len(sys.argv) > 5:
        tenant = Tenant(sys.argv[4], sys.argv[4], max_bytes_in_use=int(sys.argv[5]))
    await budget.reserve(nbytes, tenant=tenant)
    print("held", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_the_bytes_of_a_killed_holder_come_back_within_the_lease_ttl(
    redis_server: RedisServer, prefix: str
) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, redis_server.url, prefix, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 20)
        assert line == b"held\n"
        budget = _budget(redis_server, prefix, lease_ttl_s=1.0)
        await budget.start()
        waiter = asyncio.ensure_future(budget.reserve(100))
        # The holder renews its lease: well past one TTL, the bytes are still its own.
        await asyncio.sleep(1.6)
        assert not waiter.done()
        assert budget.cluster_in_use == 100
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        reservation = await asyncio.wait_for(waiter, 10)
        elapsed = time.monotonic() - killed
        # Given back because the dead holder's lease expired unrenewed and was reaped, one 1 s TTL after its last
        # renewal. The time is a backstop with room for a loaded machine, far below the 10 s admission timeout.
        assert budget.stats.leases_reaped == 1
        assert elapsed < 6, f"the dead holder's bytes came back after {elapsed:.2f} s"
        reservation.release()
        assert await _settled(budget) == (0, 0)
        await budget.aclose()
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()


async def test_the_ticket_of_a_dead_waiter_expires_and_unblocks_the_queue(
    redis_server: RedisServer, prefix: str
) -> None:
    budget = _budget(redis_server, prefix, lease_ttl_s=30.0)  # the regular re-check would come after 10 s
    await budget.start()
    held = await budget.reserve(50)
    started = time.monotonic()  # before the dead ticket's due time is taken from Redis's clock
    # A ticket at the head of the queue whose process is gone: nobody refreshes it; it expires in 0.3 s.
    queue_dead_ticket(redis_server, budget, "dead:0", 100, ttl_ms=300)
    # Fits, but behind the dead head: granted within 8 s, so not by the regular re-check 10 s away, but when the
    # dead ticket fell due and was reaped; never before it was due.
    reservation = await asyncio.wait_for(budget.reserve(50), 8)
    assert time.monotonic() - started >= 0.3 * 0.9
    assert budget.stats.tickets_reaped == 1
    reservation.release()
    held.release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


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


async def test_a_waiter_cancelled_in_the_turn_of_its_grant_gives_the_bytes_back(
    redis_server: RedisServer, prefix: str
) -> None:
    budget = _budget(redis_server, prefix)
    await budget.start()
    holder = await budget.reserve(100)
    waiter = asyncio.ensure_future(budget.reserve(60))
    await _until(lambda: budget.cluster_waiting == 1)
    granted = budget.listener.on_granted

    def grant_then_cancel(tickets: Any) -> None:
        granted(tickets)  # hands the waiter its reservation ...
        waiter.cancel()  # ... and its owner gives up before it runs again

    budget.listener.on_granted = grant_then_cancel  # type: ignore[method-assign]
    holder.release()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.stats.grants_by_message == 1
    assert (budget.in_use, budget.waiting) == (0, 0)
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


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


# -- Redis unavailable -------------------------------------------------------------------------------------------


async def test_start_names_the_url_when_redis_does_not_answer() -> None:
    redis_server_binary()
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    budget = RedisBudget(url=url, capacity=100, timeout_s=1, max_queued=None, socket_timeout_s=0.5)
    with pytest.raises(BudgetBackendUnavailable) as raised:
        await budget.start()
    assert "redis://:***@127.0.0.1:" in raised.value.message
    assert "secret" not in raised.value.message
    assert raised.value.status_code == 503
    await budget.aclose()


async def test_redis_stopped_with_reject_answers_503_and_recovers(own_redis: RedisServer, prefix: str) -> None:
    budget = _budget(own_redis, prefix, lease_ttl_s=1.0, on_unavailable="reject")
    await budget.start()
    held = await budget.reserve(60)
    waiter = asyncio.ensure_future(budget.reserve(60))
    await _until(lambda: budget.cluster_waiting == 1)
    await asyncio.to_thread(own_redis.stop)
    # The queued request learns at its next renewal (every TTL / 3) that nothing can grant it.
    with pytest.raises(BudgetBackendUnavailable) as raised:
        await asyncio.wait_for(waiter, 2)
    assert raised.value.status_code == 503
    with pytest.raises(BudgetBackendUnavailable) as raised:
        await budget.reserve(10)
    assert own_redis.url in raised.value.message
    assert "nothing is admitted" in raised.value.message
    assert budget.stats.backend_errors >= 2
    assert not budget.backend_degraded
    held.release()  # the holder keeps serving; its release cannot reach Redis and does no harm
    await budget.flush()
    await asyncio.to_thread(own_redis.start)
    # The restarted server is empty, and the old lease was released meanwhile: nothing to re-assert.
    reservation = await budget.reserve(100)
    assert budget.cluster_in_use == 100
    reservation.release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


async def test_redis_stopped_with_local_falls_back_to_a_share_and_returns(
    own_redis: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.budget.redis")
    mode: OnUnavailable = "local"
    budget = _budget(own_redis, prefix, lease_ttl_s=1.0, on_unavailable=mode, expected_replicas=2)
    assert budget.fallback_capacity == 50
    await budget.start()
    held = await budget.reserve(30)
    waiter = asyncio.ensure_future(budget.reserve(100))
    await _until(lambda: budget.cluster_waiting == 1)
    await asyncio.to_thread(own_redis.stop)
    # The queued request moves to the local share (a request larger than the share takes all of it).
    moved = await asyncio.wait_for(waiter, 2)
    assert moved.nbytes == 50
    assert budget.backend_degraded
    with pytest.raises(TimeoutError):  # the local share is full
        await asyncio.wait_for(budget.reserve(20), 0.3)
    assert budget.waiting == 0
    moved.release()
    local = await budget.reserve(40)
    assert budget.in_use == 30 + 40  # the old lease is still held by its request
    assert sum("admitting from a local share" in r.getMessage() for r in caplog.records) == 1
    assert budget.stats.fallbacks == 1
    await asyncio.to_thread(own_redis.start)
    await _until(lambda: not budget.backend_degraded, within=3)
    assert sum("answers again: admitting from it" in r.getMessage() for r in caplog.records) == 1
    shared = await budget.reserve(60)
    # The restarted server came up empty; the request that still holds its 30 bytes re-asserted them.
    assert budget.cluster_in_use == 30 + 60
    assert budget.stats.leases_reasserted == 1
    local.release()  # back to the local share, not to Redis
    held.release()
    await budget.flush()
    await budget.refresh()
    assert budget.cluster_in_use == 60
    assert budget.in_use == 60
    shared.release()
    assert await _settled(budget) == (0, 0)
    await budget.aclose()


async def test_after_redis_loses_its_state_nothing_is_granted_until_the_holders_reasserted(
    own_redis: RedisServer, prefix: str
) -> None:
    """Two gateways fill the cap; Redis is killed and restarted empty. The requests still hold their bytes, so a
    new request must wait for one of them, not be granted against an empty count."""
    gateways = [_budget(own_redis, prefix, lease_ttl_s=1.0, on_unavailable="reject") for _ in range(2)]
    for budget in gateways:
        await budget.start()
    held = [await gateways[0].reserve(60), await gateways[1].reserve(40)]
    await asyncio.to_thread(own_redis.kill)
    await asyncio.to_thread(own_redis.start)
    newcomer = asyncio.ensure_future(gateways[1].reserve(50))
    # Both gateways renew (every TTL / 3) and so re-assert what they hold; the budget settles after one TTL.
    await _until(lambda: all(budget.stats.leases_reasserted == 1 for budget in gateways), within=5)
    await _until(lambda: gateways[0].cluster_in_use == 100, within=5)
    await asyncio.sleep(1.5)  # past the settling TTL and several renewals
    assert not newcomer.done(), "granted while the re-asserted leases fill the cap"
    assert gateways[1].cluster_waiting == 1
    held[0].release()
    granted = await asyncio.wait_for(newcomer, 5)
    await _until(lambda: gateways[1].cluster_in_use == 90)
    assert all(budget.stats.state_losses == 1 for budget in gateways)
    for reservation in (granted, held[1]):
        reservation.release()
    assert await _settled(gateways[0]) == (0, 0)
    for budget in gateways:
        await budget.aclose()


async def test_a_gateway_with_another_cap_is_refused_naming_both(redis_server: RedisServer, prefix: str) -> None:
    first = _budget(redis_server, prefix, capacity=100)
    await first.start()
    other = _budget(redis_server, prefix, capacity=200)
    with pytest.raises(BudgetMisconfigured) as raised:
        await other.start()
    assert raised.value.status_code == 503
    assert raised.value.message == (
        f"the shared media budget {prefix!r} has a cap of 100 bytes and this gateway 200 "
        "(limits.max_multimodal_cpu_bytes): every gateway sharing a budget needs the same cap (stop the others, "
        "or give this one its own redis.key_prefix or redis.scope)"
    )
    with pytest.raises(BudgetMisconfigured):
        await other.reserve(10)
    assert first.cluster_in_use == 0  # the refused gateway changed nothing
    await other.aclose()
    reservation = await first.reserve(100)
    reservation.release()
    await first.aclose()


async def test_the_cap_can_change_once_every_gateway_of_the_old_one_is_gone(
    own_redis: RedisServer, prefix: str
) -> None:
    old = _budget(own_redis, prefix, capacity=100, lease_ttl_s=0.3)
    await old.start()
    await old.aclose()
    # The record lives three TTLs past the last call.
    await _until(lambda: not own_redis.client().exists("{" + prefix + "}:meta"), within=5)
    new = _budget(own_redis, prefix, capacity=200, lease_ttl_s=0.3)
    await new.start()
    reservation = await new.reserve(200)
    reservation.release()
    await new.aclose()


# -- the interleaving property ----------------------------------------------------------------------------------


def tenant_records(server: RedisServer, budget: RedisBudget) -> dict[str, int]:
    """Each tenant's record in Redis: the bytes its leases hold (its record holds that and where its last grant
    finished in each band, as three little-endian doubles, then its class's label)."""
    with redis.Redis(host="127.0.0.1", port=server.port, password=server.password) as client:
        records = cast(dict[bytes, bytes], client.hgetall(budget.keys["tenants"]))
    return {tenant.decode(): int(struct.unpack_from("<ddd", record)[0]) for tenant, record in records.items()}


async def interleave_on_redis(
    server: RedisServer,
    ops: list[Op],
    timeout_s: float | None,
    tenant_of: Callable[[int], tuple[Tenant, Band]] | None = None,
) -> None:
    """`interleavings.interleave` on a RedisBudget (client `i` reserving for `tenant_of(i)`, the default tenant
    without it): the cluster never holds more than the cap, and once every client is gone nothing is held, no
    tenant's count is left and no tenant's queue."""
    budget = _budget(
        server, f"prop:{uuid.uuid4().hex[:8]}", timeout_s=timeout_s, batch_timeout_s=timeout_s, max_queued=4
    )
    await budget.start()

    def cluster_within_capacity() -> None:
        assert budget.cluster_in_use <= 100

    if tenant_of is None:
        await interleave(budget, ops, capacity=100, check=cluster_within_capacity)
    else:
        await interleave(budget, ops, capacity=100, check=cluster_within_capacity, tenant_of=tenant_of)
    assert await _settled(budget) == (0, 0)
    assert set(tenant_records(server, budget).values()) <= {0}
    with server.client() as client:
        assert client.keys(budget.base + ":q:*") == []
        assert client.keys(budget.base + ":waiting:*") == []
    await budget.aclose()


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


async def test_the_processes_sharing_a_budget_are_known_and_forgotten_when_they_leave_or_die(
    redis_server: RedisServer, prefix: str
) -> None:
    """Each process names itself to its budget at start-up and with every heartbeat; one that closes leaves at once,
    one that dies (no more heartbeats) is forgotten after three lease TTLs. Only processes are kept: the set is as
    large as the gateways sharing the budget."""
    first = _budget(redis_server, prefix, member="host-a pid 1", fronts="m:8001", lease_ttl_s=0.3)
    second = _budget(redis_server, prefix, member="host-b pid 2", fronts="m:8001", lease_ttl_s=0.3)
    third = _budget(redis_server, prefix, member="host-c pid 3", fronts="m:8001", lease_ttl_s=0.3)
    await first.start()
    await second.start()
    assert sorted(second.sharing) == ["host-a pid 1 -> m:8001", "host-b pid 2 -> m:8001"]
    await third.start()
    assert len(third.sharing) == 3
    await second.aclose()  # leaves at once
    await third.members.register()
    assert sorted(third.sharing) == ["host-a pid 1 -> m:8001", "host-c pid 3 -> m:8001"]
    # The first stops its heartbeats without leaving, as a killed process does: gone after 3 TTLs (0.9 s).
    assert first._running is not None
    keeper, _ = first._running
    keeper.cancel()
    await asyncio.sleep(1.2)
    await third.members.register()
    assert third.sharing == ["host-c pid 3 -> m:8001"]
    with redis_server.client() as client:
        assert client.zcard(third.keys["gateways"]) == 1
        assert client.hlen(third.keys["gateway_info"]) == 1
    await third.aclose()
    await first.aclose()


async def test_gateways_in_front_of_different_servers_on_one_budget_are_warned_of(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The wrong shape named by hand (one redis.scope for sidecars of different pods): each server's gateway starts,
    and the start-up says that the budget protects no one server."""
    first = _budget(redis_server, prefix, member="pod-a pid 1", fronts="pod-a:8001")
    second = _budget(redis_server, prefix, member="pod-b pid 1", fronts="pod-b:8001")
    await first.start()
    with caplog.at_level(logging.WARNING, logger="gateway.budget.redis"):
        await second.start()
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warned == [
        f"gateways in front of different model servers (pod-a:8001, pod-b:8001) share the media budget "
        f"{{{prefix}}}: its cap protects no one server's memory; give each server a budget of its own (redis.scope)"
    ]
    await second.aclose()
    await first.aclose()
