"""The grant listener (`gateway.budget.redis.listener`): grants learnt by message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.gateway.budget.redis.helpers import (
    _budget,
    _settled,
    _until,
)
from tests.redis_server import RedisServer


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
