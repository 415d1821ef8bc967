"""Releases of the shared budget's leases (`gateway.budget.redis.releases`)."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from tests.gateway.budget.redis.helpers import (
    _budget,
    _settled,
    _until,
)
from tests.redis_server import RedisServer


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
