"""What the Redis budget's tests share: a budget on the test's Redis, its settled state in Redis, waiting for a
condition, a dead process's ticket and holder, the tenant records, and the interleaving property on Redis."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import redis

from gateway.budget.redis import RedisBudget
from gateway.budget.redis.scripts import OWN, SCRIPTS
from gateway.config import Band
from gateway.tenants import Tenant
from tests.gateway.budget.interleavings import Op, interleave
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[4]


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
