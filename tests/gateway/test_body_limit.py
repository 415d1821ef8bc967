from __future__ import annotations

import hashlib
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


def test_other_routes_are_not_capped(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    payload = b"y" * (CAP * 4)
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        embeddings = httpx.post(url + "/v1/embeddings", content=payload)
        get_chat = httpx.get(url + "/v1/chat/completions")
    assert embeddings.status_code == 200
    assert embeddings.json()["body_bytes"] == len(payload)
    assert get_chat.status_code == 200  # only POST is an admission route


def test_null_cap_admits_anything(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": None}) as (_, url):
        body = b'{"messages": [{"role": "user", "content": "' + b"z" * (CAP * 8) + b'"}]}'
        response = httpx.post(url + "/v1/chat/completions", content=body)
    assert response.status_code == 200


async def _drive(limit: RawBodyLimit, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> RequestInfo:
    info = RequestInfo(request_id="r", route="/v1/chat/completions", dialect=Dialect.TRTLLM)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": headers,
    }
    scope[SCOPE_KEY] = info
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> Message:
        message = messages.pop(0)
        info.body_bytes += len(message["body"])  # what AccessLog does in the real chain
        return message

    async def send(message: Message) -> None:
        raise AssertionError("the middleware itself never answers; ExceptionMiddleware does")

    await limit(scope, receive, send)
    return info


async def test_count_is_kept_in_scope_for_media_accounting() -> None:
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        seen.append(scope[SCOPE_KEY].body_bytes)

    info = await _drive(RawBodyLimit(app, max_bytes=100, routes=("/v1/chat/completions",)), [b"a" * 40, b"b" * 50], [])
    assert seen == [90]
    assert info.body_bytes == 90


async def test_chunk_past_cap_raises_for_the_envelope() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass

    limit = RawBodyLimit(app, max_bytes=100, routes=("/v1/chat/completions",))
    with pytest.raises(RequestTooLarge, match=r"limits.max_request_body_bytes=100 at 120 bytes"):
        await _drive(limit, [b"a" * 60, b"b" * 60, b"c" * 60], [])


async def test_invalid_content_length_is_a_bad_request() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    limit = RawBodyLimit(app, max_bytes=100, routes=("/v1/chat/completions",))
    with pytest.raises(BadRequest, match="invalid Content-Length header 'ten'"):
        await _drive(limit, [b""], [(b"content-length", b"ten")])
