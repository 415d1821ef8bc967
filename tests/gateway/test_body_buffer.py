"""The bound on raw request bodies a gateway process holds (`limits.max_buffered_body_bytes`), through the real
gateway: a body is taken from the bound before it is read, waits FIFO when the bound is full (its client held by TCP
flow control), gets a 429 naming the key past `limits.admission_timeout_s`, and gives its bytes back however the
request ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import Gateway
from gateway.body_buffer import STEP_BYTES, BodyHold, wait_s
from gateway.config import GatewaySettings
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import chat_body
from tests.gateway.rawhttp import open_request
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric, until

MIB = 1 << 20
CHAT = "/v1/chat/completions"


def text_body(size: int, tag: str) -> bytes:
    """A chat body of about `size` bytes without media, its text starting with `tag`."""
    return chat_body(text=tag + "x" * (size - 100))


def buffered(gateway: Gateway) -> tuple[int, int]:
    """(bytes held, requests waiting) of the gateway's bound on bodies."""
    bodies = gateway.admission.bodies
    return bodies.in_use, bodies.waiting


def arrived(stub: StubUpstream) -> list[str]:
    with stub.state.lock:
        bodies = [seen.body for seen in stub.state.requests]
    return [orjson.loads(body)["messages"][0]["content"][0]["text"][:2] for body in bodies]


def limits(bound: int, **more: Any) -> dict[str, Any]:
    return {"max_buffered_body_bytes": bound, "max_request_body_bytes": 2 * MIB, **more}


def test_a_body_that_would_pass_the_bound_is_read_once_room_frees_up(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.gated = True
    bodies = {tag: text_body(MIB, tag) for tag in ("A1", "B1", "C1")}
    with make_gateway(upstream, limits=limits(int(2.5 * MIB))) as (gateway, url):

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                first = [asyncio.ensure_future(client.post(url + CHAT, content=bodies[tag])) for tag in ("A1", "B1")]
                await until(lambda: app.state.at_gate == 2, what="two bodies at the upstream")
                third = asyncio.ensure_future(client.post(url + CHAT, content=bodies["C1"]))
                await until(lambda: buffered(gateway)[1] == 1, what="the third body waiting")
                # Two bodies fill the bound; the third is not taken in (nor forwarded) until one of them ends.
                assert buffered(gateway) == (len(bodies["A1"]) + len(bodies["B1"]), 1)
                assert app.state.at_gate == 2
                app.state.open_gate()
                await until(lambda: app.state.at_gate == 3, what="the third body at the upstream")
                app.state.open_gate(2)
                return [*await asyncio.gather(*first), await third]

        responses = asyncio.run(run())
        assert buffered(gateway) == (0, 0)
        # Each request holds its body, then what parsing it allocates.
        assert metric(url, "mmgate_body_buffer_wait_seconds_count") == 6
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert sorted(arrived(app)) == ["A1", "B1", "C1"]


def test_a_wait_past_the_admission_timeout_is_a_429_naming_the_bound(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = stub
    app.state.gated = True
    bound = int(1.5 * MIB)
    caplog.set_level("INFO", logger="mmgate.access")
    sections = {"limits": limits(bound, admission_timeout_s=0.5), "server": {"access_log": True}}
    with make_gateway(upstream, **sections) as (gateway, url):

        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                holder = asyncio.ensure_future(client.post(url + CHAT, content=text_body(MIB, "A1")))
                await until(lambda: app.state.at_gate == 1, what="the first body at the upstream")
                refused = await client.post(url + CHAT, content=text_body(MIB, "B1"))
                app.state.open_gate()
                return refused, await holder

        refused, served = asyncio.run(run())
        assert buffered(gateway) == (0, 0)
        rejected = metric(url, "mmgate_rejections_total", route=CHAT, reason="body_timeout")
    assert served.status_code == 200
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert (
        f"of the bound on buffered request bodies (limits.max_buffered_body_bytes={bound:,}"
        in (refused.json()["message"])
    )
    assert rejected == 1
    assert arrived(app) == ["A1"]
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    (refused_line,) = [line for line in lines if line["status"] == 429]
    # The access log says what the 429 waited for, and how long: never less than the timeout.
    assert refused_line["body_wait_s"] >= 0.5 * 0.9


@pytest.mark.parametrize("bound", [None, 4 * MIB])
def test_the_access_log_says_how_long_a_body_waited_where_the_bound_is_on(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture, bound: int | None
) -> None:
    _, upstream = stub
    caplog.set_level("INFO", logger="mmgate.access")
    sections = {"limits": {"max_buffered_body_bytes": bound}, "server": {"access_log": True}}
    with make_gateway(upstream, **sections) as (_, url):
        assert httpx.post(url + CHAT, content=text_body(MIB, "A1")).status_code == 200
    (line,) = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    # Taken at once: a wait of 0 (and no field at all where there is no bound to wait for).
    assert line.get("body_wait_s", "absent") == ("absent" if bound is None else 0.0)


def test_a_requests_wait_is_what_its_body_and_its_parse_waited_together() -> None:
    assert wait_s(BodyHold(), BodyHold()) is None
    assert wait_s(BodyHold(), BodyHold(wait_s=0.0)) == 0.0
    assert wait_s(BodyHold(wait_s=0.5), BodyHold(wait_s=0.25)) == 0.75


def test_a_chunked_body_takes_the_bound_a_step_at_a_time_as_it_arrives(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.gated = True
    body = text_body(3 * MIB, "A1")
    with make_gateway(upstream, limits=limits(8 * MIB, max_request_body_bytes=4 * MIB)) as (gateway, url):

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 64 << 10):
                yield body[start : start + (64 << 10)]

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as client:
                request = asyncio.ensure_future(client.post(url + CHAT, content=chunks()))
                await until(lambda: app.state.at_gate == 1, what="the body at the upstream")
                held, _ = buffered(gateway)
                assert len(body) <= held <= len(body) + STEP_BYTES
                app.state.open_gate()
                return await request

        assert asyncio.run(run()).status_code == 200
        assert buffered(gateway) == (0, 0)
    assert app.state.requests[0].body == body


def test_a_client_that_leaves_while_its_body_waits_leaves_the_queue(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.gated = True
    with make_gateway(upstream, limits=limits(int(1.05 * MIB))) as (gateway, url):

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as client:
                holder = asyncio.ensure_future(client.post(url + CHAT, content=text_body(MIB, "A1")))
                await until(lambda: app.state.at_gate == 1, what="the first body at the upstream")
                # Small enough for the socket buffers: sent whole, so the kernel has the FIN behind it while the
                # gateway reads none of it.
                leaver = text_body(96 << 10, "B1")
                head = f"POST {CHAT} HTTP/1.1\nHost: gateway\nContent-Length: {len(leaver)}\n"
                sock = open_request(url, head)
                sock.sendall(leaver)
                await until(lambda: buffered(gateway)[1] == 1, what="the second body waiting")
                sock.close()
                await until(lambda: buffered(gateway)[1] == 0, what="the leaver out of the queue")
                assert buffered(gateway)[0] == len(text_body(MIB, "A1"))
                app.state.open_gate()
                return await holder

        assert asyncio.run(run()).status_code == 200
        assert buffered(gateway) == (0, 0)
        assert metric(url, "mmgate_requests_total", route=CHAT, code="499") == 1
    assert arrived(app) == ["A1"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_larger_than_the_whole_bound_is_refused_before_it_is_held(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, chunked: bool
) -> None:
    app, upstream = stub
    body = text_body(2 * MIB, "A1")
    with make_gateway(upstream, limits=limits(MIB)) as (gateway, url):
        content = iter([body[: MIB // 2], body[MIB // 2 :]]) if chunked else body
        response = httpx.post(url + CHAT, content=content, timeout=30)
        assert buffered(gateway) == (0, 0)
    assert response.status_code == 413
    message = response.json()["message"]
    assert "limits.max_buffered_body_bytes=1,048,576" in message, message
    assert app.state.requests == []


def test_the_bound_defaults_to_the_media_budget_and_each_worker_holds_its_share() -> None:
    assert GatewaySettings().limits.max_buffered_body_bytes == 2 << 30
    settings = GatewaySettings(limits={"max_multimodal_cpu_bytes": "128MiB"})  # type: ignore[arg-type]
    assert settings.limits.max_buffered_body_bytes == 128 * MIB
    assert settings.body_buffer_share == 128 * MIB
    workers = GatewaySettings(
        limits={"max_buffered_body_bytes": "1GiB", "max_multimodal_cpu_bytes_per_request": "64MiB"},  # type: ignore[arg-type]
        server={"workers": 4},  # type: ignore[arg-type]
    )
    assert workers.body_buffer_share == 256 * MIB
    off = GatewaySettings(limits={"max_buffered_body_bytes": None})  # type: ignore[arg-type]
    assert off.body_buffer_share is None


@pytest.mark.parametrize("bound", [None, 4 * MIB])
def test_requests_without_a_body_or_with_the_bound_off_pass(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, bound: int | None
) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_buffered_body_bytes": bound}) as (gateway, url):
        assert httpx.post(url + CHAT, content=b"").status_code == 400  # an empty body is not JSON
        assert httpx.post(url + CHAT, content=chat_body()).status_code == 200
        assert buffered(gateway) == (0, 0)


def test_a_body_read_parses_ahead_of_bodies_waiting_to_be_read(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """What parsing a read body allocates is taken from the same bound as the bodies: it goes ahead of the bodies
    waiting for room. Behind them in one FIFO queue, a small parse waits for room that only its own request's end
    can give (the body at the head waits for the same room), and its request times out 429."""
    app, upstream = stub
    app.state.gated = True
    bodies = {tag: text_body(MIB, tag) for tag in ("A1", "B1", "C1")}
    with make_gateway(upstream, limits=limits(int(2.5 * MIB), admission_timeout_s=5)) as (gateway, url):

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                held = asyncio.ensure_future(client.post(url + CHAT, content=bodies["B1"]))
                await until(lambda: app.state.at_gate == 1, what="one body at the upstream")
                # A's body arrives in two halves, C's whole while A's second half is still to come.
                slow = open_request(url, f"POST {CHAT} HTTP/1.1\nHost: g\nContent-Length: {len(bodies['A1'])}\n")
                half = len(bodies["A1"]) // 2
                slow.sendall(bodies["A1"][:half])
                await until(lambda: buffered(gateway)[0] > 1.5 * MIB, what="A's body being read")
                waiting = asyncio.ensure_future(client.post(url + CHAT, content=bodies["C1"]))
                await until(lambda: buffered(gateway)[1] == 1, what="C waiting for room")
                slow.sendall(bodies["A1"][half:])
                await until(lambda: app.state.at_gate == 2, timeout_s=4, what="A parsed and at the upstream")
                app.state.open_gate(3)
                answer = await asyncio.to_thread(slow.recv, 65536)
                slow.close()
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
                return [await held, await waiting]

        assert [r.status_code for r in asyncio.run(run())] == [200, 200]
        assert buffered(gateway) == (0, 0)
    assert sorted(arrived(app)) == ["A1", "B1", "C1"]
