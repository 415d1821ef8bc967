"""The lease keeper (`gateway.budget.redis.keeper`): what a dead process held or queued comes back, and leases
are re-asserted after Redis lost its state."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest

from tests.gateway.budget.redis.helpers import (
    _HOLDER,
    ROOT,
    _budget,
    _settled,
    _until,
    queue_dead_ticket,
)
from tests.redis_server import RedisServer


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
