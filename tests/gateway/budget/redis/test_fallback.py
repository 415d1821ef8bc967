"""Redis not answering (`gateway.budget.redis.fallback`): `redis.on_unavailable` reject and local."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.budget.redis import BudgetBackendUnavailable, RedisBudget
from gateway.config import OnUnavailable
from tests.gateway.budget.redis.helpers import (
    _budget,
    _settled,
    _until,
)
from tests.redis_server import RedisServer, redis_server_binary
from tests.servers import free_port


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
