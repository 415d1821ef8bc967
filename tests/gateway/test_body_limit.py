from __future__ import annotations

import hashlib
import re
import socket
import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.body_limit import RawBodyLimit
from gateway.envelopes import Dialect
from gateway.errors import BadRequest, RequestTooLarge
from gateway.request_info import SCOPE_KEY, RequestInfo
from serving.asgi import Message
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.rawhttp import open_request, read_response
from tests.gateway.stub_upstream import StubUpstream

CAP = 4096


def test_content_length_over_cap_is_refused_without_reading_the_body(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        sock = open_request(
            url,
            f"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Type: application/json\nContent-Length: {CAP + 1}\n",
        )
        # Not one body byte is sent: the answer must come anyway.
        status, headers, body = read_response(sock)
        sock.close()
    assert status == 413
    assert headers["connection"] == "close"
    assert orjson.loads(body) == {
        "object": "error",
        "message": f"request body is {CAP + 1:,} bytes (Content-Length), over limits.max_request_body_bytes={CAP:,}",
        "type": "RequestTooLargeError",
        "param": None,
        "code": 413,
    }
    assert app.state.requests == []


def test_chunked_body_is_refused_as_soon_as_it_passes_the_cap(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        sock = open_request(url, "POST /v1/messages HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n")
        chunk = b"x" * 1024
        for _ in range(5):  # 5 KiB: past the 4 KiB cap, and the body is not finished
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(0.02)
        status, headers, body = read_response(sock)
        sock.close()
    assert status == 413
    assert headers["connection"] == "close"
    error = orjson.loads(body)
    assert error["type"] == "error"
    assert error["error"]["type"] == "request_too_large"
    assert f"limits.max_request_body_bytes={CAP:,}" in error["error"]["message"]
    assert app.state.requests == []  # the upstream was never contacted


def test_admitted_body_reaches_upstream_byte_for_byte(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    payload = b'{"model":"m","messages":[{"role":"user","content":"' + b"\xc3\xa9" * 1000 + b'"}]}'
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=iter([payload[:100], payload[100:]]))
    assert response.status_code == 200
    assert response.json()["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert app.state.requests[0].body == payload


def test_other_routes_are_not_held_to_the_admission_cap(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    payload = b"y" * (CAP * 4)
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        embeddings = httpx.post(url + "/v1/completions", content=payload)
        get_chat = httpx.get(url + "/v1/chat/completions")
    assert embeddings.status_code == 200
    assert embeddings.json()["body_bytes"] == len(payload)
    assert get_chat.status_code == 200  # only POST is an admission route


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("PUT", "/anything"), ("GET", "/v1/models")])
def test_other_routes_over_their_cap_are_refused_by_content_length(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, method: str, path: str
) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits={"max_other_body_bytes": CAP}) as (_, url):
        sock = open_request(url, f"{method} {path} HTTP/1.1\nHost: x\nContent-Length: {CAP + 1}\n")
        status, headers, body = read_response(sock)  # not one body byte was sent
        sock.close()
    assert status == 413
    assert headers["connection"] == "close"
    assert orjson.loads(body)["message"] == (
        f"request body is {CAP + 1:,} bytes (Content-Length), over limits.max_other_body_bytes={CAP:,}"
    )
    assert not app.state.arrived.is_set()  # the upstream was never contacted


def test_other_routes_chunked_past_their_cap_abort_the_upstream_request(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits={"max_other_body_bytes": CAP}) as (_, url):
        sock = open_request(url, "POST /v1/completions HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n")
        chunk = b"x" * 1024
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert app.state.arrived.wait(5)  # forwarded while the body streams
        for _ in range(4):  # 5 KiB in all: past the 4 KiB cap, and the body is not finished
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(0.02)
        status, headers, body = read_response(sock)
        sock.close()
        assert app.state.disconnected.wait(5)  # the upstream saw its request end unfinished
    assert status == 413
    assert headers["connection"] == "close"
    assert (
        orjson.loads(body)["message"]
        == f"request body passed limits.max_other_body_bytes={CAP:,} at {5 * 1024:,} bytes"
    )
    assert app.state.requests == []


def test_other_routes_under_their_cap_and_the_default(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    payload = b"z" * CAP
    with make_gateway(upstream, limits={"max_other_body_bytes": CAP}) as (_, url):
        streamed = httpx.post(url + "/v1/completions", content=iter([payload[:100], payload[100:]]))
    assert streamed.status_code == 200
    assert app.state.requests[0].body == payload
    with make_gateway(upstream) as (gateway, url):
        assert gateway.settings.limits.max_other_body_bytes == 64 << 20
        over = httpx.post(url + "/v1/completions", content=b"\0" * ((64 << 20) + 1))
    assert over.status_code == 413
    with make_gateway(upstream, limits={"max_other_body_bytes": None}) as (_, url):
        off = httpx.post(url + "/v1/completions", content=b"\0" * ((64 << 20) + 1))
    assert off.status_code == 200


def test_null_cap_admits_anything(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": None}) as (_, url):
        body = b'{"messages": [{"role": "user", "content": "' + b"z" * (CAP * 8) + b'"}]}'
        response = httpx.post(url + "/v1/chat/completions", content=body)
    assert response.status_code == 200


async def _drive(
    limit: RawBodyLimit, chunks: list[bytes], headers: list[tuple[bytes, bytes]], path: str = "/v1/chat/completions"
) -> RequestInfo:
    info = RequestInfo(request_id="r", route=path, dialect=Dialect.TRTLLM, admission=path == "/v1/chat/completions")
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": headers,
    }
    scope[SCOPE_KEY] = info
    messages: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        raise AssertionError("the middleware itself never answers; ExceptionMiddleware does")

    await limit(scope, receive, send)
    return info


async def test_a_body_within_the_cap_reaches_the_app_whole() -> None:
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(len(message["body"]))
            if not message.get("more_body"):
                return

    await _drive(RawBodyLimit(app, max_bytes=100), [b"a" * 40, b"b" * 50, b"c" * 10], [])
    assert seen == [40, 50, 10]


async def test_chunk_past_cap_raises_for_the_envelope() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass

    limit = RawBodyLimit(app, max_bytes=100)
    with pytest.raises(RequestTooLarge, match=r"limits.max_request_body_bytes=100 at 120 bytes"):
        await _drive(limit, [b"a" * 60, b"b" * 60, b"c" * 60], [])


async def test_invalid_content_length_is_a_bad_request() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    limit = RawBodyLimit(app, max_bytes=100)
    with pytest.raises(BadRequest, match="invalid Content-Length header 'ten'"):
        await _drive(limit, [b""], [(b"content-length", b"ten")])


async def test_other_route_past_its_cap_reads_as_a_disconnect_and_raises_the_413() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                raise ConnectionError("what the proxy raises for a client that left")

    limit = RawBodyLimit(app, max_bytes=None, other_max_bytes=100)
    with pytest.raises(RequestTooLarge, match=r"limits.max_other_body_bytes=100 at 120 bytes"):
        await _drive(limit, [b"a" * 60, b"b" * 60, b"c" * 60], [], path="/v1/completions")
    assert seen == ["http.request", "http.disconnect"]


def test_bytes_past_the_declared_length_are_not_the_body(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    # Within the cap a declared length is not counted again: the server hands the app only what it declares, and
    # what follows is the next request.
    app, upstream = stub
    first, second = b'{"model":"a","messages":[]}', b'{"model":"b","messages":[]}' + b" " * (2 * CAP)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n"
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.format(len(first)).encode() + first + head.format(len(second)).encode() + second)
            received = b""
            while chunk := sock.recv(65536):  # the 413 closes the connection
                received += chunk
    assert re.findall(rb"HTTP/1.1 (\d{3}) ", received) == [b"200", b"413"]
    assert [request.body for request in app.state.requests] == [first]
