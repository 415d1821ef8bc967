"""Who shares a budget (`gateway.budget.redis.members`)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.gateway.budget.redis.helpers import (
    _budget,
)
from tests.redis_server import RedisServer


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
