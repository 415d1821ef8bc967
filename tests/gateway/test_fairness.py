"""Fair queueing of the media budget between tenants, through a real gateway and a stub upstream on loopback.

Tenants are named by `X-Tenant-ID`. The stub upstream holds every request `HOLD_S` seconds before it answers, and
the budget returns at the answer's first byte, so a grant holds its bytes that long. The assertions are on what
the gateway did (the order in which requests reached the upstream, the access log's waits, the tenant series of
`/metrics`); times appear only as generous backstops or as lower bounds a loaded machine cannot break.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from tests.bench.bench_fairness import percentile
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric, metric_in, until
from tests.redis_server import RedisServer

HOLD_S = 0.2
LARGE_SIDE, SMALL_SIDE = 256, 16
LARGE = LARGE_SIDE * LARGE_SIDE * 4  # 262,144 bytes decoded (Pillow holds an RGB pixel in 4 bytes)
LARGE_BODY = chat_body(data_url(image_bytes(LARGE_SIDE, LARGE_SIDE)))
SMALL_BODY = chat_body(data_url(image_bytes(SMALL_SIDE, SMALL_SIDE, seed=1)))
CHAT = "/v1/chat/completions"
# Far above anything a request waits here: a backstop, never the thing asserted.
BACKSTOP_S = 2.0


def fair_limits(slots: int, *, enabled: bool = True, weights: tuple[float, float] = (1, 1)) -> dict[str, Any]:
    """A budget of `slots` large requests (only the decoded pixels charged, so each reserves exactly `LARGE`),
    tenants `a` and `b` configured (their own metric labels) with `weights`."""
    return {
        "max_multimodal_cpu_bytes": slots * LARGE,
        "max_multimodal_cpu_bytes_per_request": LARGE,
        "max_buffered_body_bytes": 64 << 20,
        "charge_raw_body": False,
        "fairness": {
            "enabled": enabled,
            "tenant_from": "header",
            "tenants": {"a": {"weight": weights[0]}, "b": {"weight": weights[1]}},
        },
    }


Headers = Callable[[], dict[str, str]]


def tenant_header(tenant: str) -> Headers:
    return lambda: {"x-tenant-id": tenant}


def fresh_api_key() -> dict[str, str]:
    """A new API key each time: a new identity the gateway cannot check."""
    return {"authorization": f"Bearer {uuid.uuid4().hex}"}


class Flood:
    """`clients` concurrent clients, each sending the large image again as soon as it is answered, with the headers
    `headers()` gives each request, until `stop()`; every answer must be a 200."""

    def __init__(self, client: httpx.AsyncClient, url: str, headers: Headers, clients: int) -> None:
        self.client, self.url, self.headers = client, url, headers
        self.stopping = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._loop()) for _ in range(clients)]

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            response = await self.client.post(self.url + CHAT, content=LARGE_BODY, headers=self.headers())
            assert response.status_code == 200, response.text

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)


def flooding_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64))


# -- a flood does not hold back another tenant's small requests ------------------------------------------------

A_CLIENTS = 12
FLOOD_SLOTS = 2


def small_requests_behind_a_flood(
    url: str,
    app: StubUpstream,
    count: int,
    flooder: Headers | None = None,
    honest: dict[str, str] | None = None,
) -> list[int]:
    """Tenant A floods (`A_CLIENTS` clients, `FLOOD_SLOTS` of them fill the budget; each request with the headers
    `flooder()` gives, `x-tenant-id: a` by default); once A's queue is full, tenant B (`honest`'s headers,
    `x-tenant-id: b` by default) sends `count` small images, one at a time. For each B request: how many of A's
    requests reached the upstream between B's request being sent and its reaching the upstream (the A grants it
    waited behind, plus at most the `FLOOD_SLOTS` A requests already granted and on their way when it was sent)."""
    state = app.state
    flooder = tenant_header("a") if flooder is None else flooder
    honest = {"x-tenant-id": "b"} if honest is None else honest

    async def run() -> list[int]:
        async with flooding_client() as client:
            flood = Flood(client, url, flooder, A_CLIENTS)
            try:
                marks: list[tuple[int, str]] = []
                for i in range(count):
                    # A's queue full again: every one of A's clients but those holding the budget is waiting.
                    await until(
                        lambda: metric(url, "mmgate_budget_waiting_requests") >= A_CLIENTS - FLOOD_SLOTS - 1,
                        what="tenant A's queue filled",
                    )
                    with state.lock:
                        sent_at = len(state.requests)
                    request_id = f"b-{i}"
                    response = await client.post(
                        url + CHAT, content=SMALL_BODY, headers={**honest, "x-request-id": request_id}
                    )
                    assert response.status_code == 200, response.text
                    marks.append((sent_at, request_id))
            finally:
                await flood.stop()
        with state.lock:
            seen = [r.headers.get("x-request-id", "") for r in state.requests]
        passed = []
        for sent_at, request_id in marks:
            arrived = seen.index(request_id)
            passed.append(sum(1 for rid in seen[sent_at:arrived] if not rid.startswith("b-")))
        return passed

    return asyncio.run(run())


def b_waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The budget waits of tenant B's requests, as the gateway's access log recorded them."""
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    return [line["budget_wait_s"] for line in lines if line["request_id"].startswith("b-")]


def test_a_flooding_tenant_holds_back_another_tenants_small_requests_by_at_most_one_grant(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = stub
    app.state.hold_s = HOLD_S
    caplog.set_level(logging.INFO, logger="mmgate.access")
    count = 5
    with make_gateway(upstream, limits=fair_limits(FLOOD_SLOTS), server={"access_log": True}) as (_, url):
        passed = small_requests_behind_a_flood(url, app, count)
        waited = metric(url, "mmgate_tenant_budget_wait_seconds_count", tenant="b")
        # The histogram's first bucket above HOLD_S + BACKSTOP_S.
        waited_long = waited - metric(url, "mmgate_tenant_budget_wait_seconds_bucket", tenant="b", le="2.5")
    waits = b_waits(caplog)
    # B has far less service than A, so the first bytes A gives back once B is queued go to B: it waits for no
    # grant to A. What reaches the upstream meanwhile is at most the A requests already granted and on their way
    # when B was sent (one budget's worth, FLOOD_SLOTS) and as many granted before B joined the queue: at most one
    # grant cycle of A's on top of those in flight (0 is what a run measures; FIFO measures 8 to 10).
    assert max(passed) <= 2 * FLOOD_SLOTS, passed
    assert len(waits) == count == waited
    # B waits for the first of A's grants to end: one hold (the backstop for a loaded machine on top).
    assert percentile(waits, 0.99) <= HOLD_S + BACKSTOP_S, waits
    assert waited_long == 0


def test_without_fair_queueing_the_small_requests_wait_behind_the_flood(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The contrast: the same scenario with `limits.fairness.enabled: false` (one FIFO queue) fails the bound."""
    app, upstream = stub
    app.state.hold_s = HOLD_S
    caplog.set_level(logging.INFO, logger="mmgate.access")
    count = 3
    limits = fair_limits(FLOOD_SLOTS, enabled=False)
    with make_gateway(upstream, limits=limits, server={"access_log": True}) as (_, url):
        passed = small_requests_behind_a_flood(url, app, count)
    waits = b_waits(caplog)
    # Behind the whole of A's queue (about A_CLIENTS - FLOOD_SLOTS requests), FIFO.
    assert min(passed) > 2 * FLOOD_SLOTS, passed
    # A lower bound a loaded machine cannot break: each A request ahead holds its slot for at least HOLD_S.
    assert statistics.median(waits) >= 2 * HOLD_S, waits


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_clients_minting_an_api_key_per_request_hold_back_another_tenants_small_requests_by_at_most_one_grant(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    backend: str,
) -> None:
    """The flood of the first test, from clients that send a fresh API key with every request (the gateway hashes a
    key and never checks it), against a tenant with a key of its own: each fresh key starts at its class's virtual
    time, no earlier than the tenants waiting, and B's small image finishes first, so B waits as it does behind
    one flooding tenant, on either budget backend."""
    app, upstream = stub
    app.state.hold_s = HOLD_S
    caplog.set_level(logging.INFO, logger="mmgate.access")
    count = 5
    limits = fair_limits(FLOOD_SLOTS)
    limits["fairness"] = {"enabled": True, "tenant_from": "api_key"}
    sections: dict[str, Any] = {"limits": limits, "server": {"access_log": True}}
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        limits["budget_backend"] = "redis"
        sections["redis"] = {"url": server.url, "key_prefix": f"fresh-keys:{uuid.uuid4().hex[:8]}"}
    with make_gateway(upstream, **sections) as (_, url):
        passed = small_requests_behind_a_flood(
            url, app, count, flooder=fresh_api_key, honest={"authorization": "Bearer honest-key"}
        )
    waits = b_waits(caplog)
    assert max(passed) <= 2 * FLOOD_SLOTS, passed
    assert len(waits) == count
    assert percentile(waits, 0.99) <= HOLD_S + BACKSTOP_S, waits


# -- weights share the budget under mutual contention ----------------------------------------------------------

SHARE_SLOTS = 4
SHARE_CLIENTS = 8
SHARE_WINDOW_S = 3.0


def byte_seconds(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (
        metric_in(text, "mmgate_tenant_budget_byte_seconds_total", tenant="a"),
        metric_in(text, "mmgate_tenant_budget_byte_seconds_total", tenant="b"),
    )


def share_under_contention(url: str) -> float:
    """Both tenants flood (`SHARE_CLIENTS` clients each, more than the `SHARE_SLOTS` the budget holds); A's share
    of the bytes x seconds held (the tenant series of `/metrics`) over the run, from its start to `SHARE_WINDOW_S`
    after both tenants are waiting, before the floods stop: their drain, where one tenant's queue empties first,
    is no contention."""

    async def run() -> float:
        start = byte_seconds(url)
        async with flooding_client() as client:
            floods = [Flood(client, url, tenant_header(tenant), SHARE_CLIENTS) for tenant in "ab"]
            try:
                await until(
                    lambda: all(metric(url, "mmgate_tenant_budget_waiting_requests", tenant=t) > 0 for t in "ab"),
                    what="both tenants waiting",
                )
                await asyncio.sleep(SHARE_WINDOW_S)
                end = byte_seconds(url)
            finally:
                for flood in floods:
                    await flood.stop()
        a, b = (e - s for s, e in zip(start, end, strict=True))
        return a / (a + b)

    return asyncio.run(run())


@pytest.mark.parametrize(("weights", "share", "tolerance"), [((1, 1), 0.5, 0.05), ((3, 1), 0.75, 0.1)])
def test_weights_share_the_budget_under_mutual_contention(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    weights: tuple[float, float],
    share: float,
    tolerance: float,
) -> None:
    app, upstream = stub
    app.state.hold_s = HOLD_S
    with make_gateway(upstream, limits=fair_limits(SHARE_SLOTS, weights=weights)) as (_, url):
        measured = share_under_contention(url)
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    # 1:1 within 10% of an equal share; 3:1 near 3/4, a tolerance 1:1 (1/2) is far outside.
    assert abs(measured - share) <= tolerance, measured
    assert in_use == 0


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted proxy", "untrusted peer"])
def test_a_fairness_id_counts_only_from_a_trusted_proxy_and_is_forwarded_from_it(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, trusted: bool
) -> None:
    """llm-d's endpoint picker (or its Envoy) in front of the gateway sets `x-llm-d-inference-fairness-id`: from a
    peer in `server.forwarded_allow_ips` the request is that tenant's (here one whose own cap refuses it, naming the
    key) and the model server gets the header; from any other peer the header is dropped: the request is queued as
    `tenant_from` says and the header never reaches the model server."""
    app, upstream = stub
    limits = {
        "max_multimodal_cpu_bytes": 4 * LARGE,
        "max_multimodal_cpu_bytes_per_request": LARGE,
        "charge_raw_body": False,
        "fairness": {"tenants": {"team-a": {"max_bytes_in_use": LARGE // 2}}},
    }
    server = {"forwarded_allow_ips": ["127.0.0.1"] if trusted else []}
    headers = {"x-llm-d-inference-fairness-id": "team-a", "authorization": "Bearer sk-client"}
    with make_gateway(upstream, limits=limits, server=server) as (_, url):
        image = httpx.post(url + CHAT, content=LARGE_BODY, headers=headers, timeout=30)
        text = httpx.post(url + CHAT, content=chat_body(), headers=headers, timeout=30)
    assert text.status_code == 200
    forwarded = [seen.headers.get("x-llm-d-inference-fairness-id") for seen in app.state.requests]
    if trusted:
        assert image.status_code == 429, image.text
        assert "limits.fairness.tenants.team-a.max_bytes_in_use=131,072" in image.json()["message"]
        assert forwarded == ["team-a"]
    else:
        assert image.status_code == 200, image.text
        assert forwarded == [None, None]
