"""The bound on raw bodies of requests waiting for the media budget, through the real gateway."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from gateway.budget.queued_bodies import QueuedBodies
from gateway.errors import RateLimited
from gateway.metrics import GatewayMetrics
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import until

MIB = 1 << 20


def test_bodies_waiting_for_the_budget_are_bounded_and_the_next_one_is_429(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.hold_s = 1.5  # the first request holds the only budget slot this long
    image = data_url(image_bytes(32, 32))
    padded = chat_body(image, text="x" * MIB)  # about 1 MiB of raw body each
    limits = {
        "budget_mode": "slots",
        "max_request_body_bytes": 2 * MIB,
        "max_queued_body_bytes": int(2.5 * MIB),
        "max_multimodal_cpu_bytes": 8 * MIB,
        "max_multimodal_cpu_bytes_per_request": 8 * MIB,
        "admission_timeout_s": 10,
    }
    with make_gateway(upstream, limits=limits) as (gateway, url):

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                holder = asyncio.ensure_future(client.post(url + "/v1/chat/completions", content=chat_body(image)))
                await until(lambda: gateway.budget.in_use > 0)
                waiting = [
                    asyncio.ensure_future(client.post(url + "/v1/chat/completions", content=padded)) for _ in range(2)
                ]
                await until(lambda: gateway.budget.waiting == 2)
                assert gateway.admission.queued_bodies.total == 2 * len(padded)
                refused = await client.post(url + "/v1/chat/completions", content=padded)
                return [refused, await holder, *await asyncio.gather(*waiting)]

        refused, *served = asyncio.run(run())
        assert gateway.admission.queued_bodies.total == 0
        assert gateway.budget.in_use == 0
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "10"
    message = orjson.loads(refused.content)["message"]
    assert f"limits.max_queued_body_bytes={int(2.5 * MIB):,}" in message
    assert f"this one's {len(padded):,}" in message
    assert [r.status_code for r in served] == [200, 200, 200]


def test_a_body_over_the_bound_may_still_wait_alone() -> None:
    queued = QueuedBodies(MIB, timeout_s=1, metrics=GatewayMetrics())
    with queued.hold(2 * MIB):
        assert queued.total == 2 * MIB
        with pytest.raises(RateLimited, match=r"limits.max_queued_body_bytes=1,048,576"), queued.hold(1):
            pass
    assert queued.total == 0
