"""The script client (`gateway.budget.redis.client`): a cap that disagrees with the shared budget's."""

from __future__ import annotations

import pytest

from gateway.budget.redis import BudgetMisconfigured
from tests.gateway.budget.redis.helpers import (
    _budget,
    _until,
)
from tests.redis_server import RedisServer


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
