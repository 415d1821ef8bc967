from __future__ import annotations

import socket
import threading
import time

import httpx
import orjson
import pytest

from tests.gateway.conftest import GatewayFactory
from tests.gateway.stub_upstream import StubUpstream

# Headers that must be the same whether the client talks to the upstream directly or through the gateway.
END_TO_END = ("content-type", "content-length", "x-upstream-header", "x-stub", "set-cookie", "cache-control")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("method", "path", "content"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("POST", "/v1/completions", b'{"prompt":"hi","max_tokens":3}'),
        ("POST", "/v1/embeddings", b'{"input":"hi"}'),
        ("POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}'),
        ("GET", "/status/404", None),
        ("POST", "/status/500", b"{}"),
        ("POST", "/status/429", b"{}"),
        ("DELETE", "/v1/files/abc?purpose=x&y=%2F", None),
        ("PUT", "/anything/else", b"\x00\x01binary\xff"),
    ],
)
def test_passthrough_is_byte_identical_to_calling_the_upstream(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    method: str,
    path: str,
    content: bytes | None,
) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        headers = {"content-type": "application/json", "x-request-id": "fixed-id"}
        direct = httpx.request(method, upstream + path, content=content, headers=headers)
        proxied = httpx.request(method, url + path, content=content, headers=headers)
    assert proxied.status_code == direct.status_code
    echoed = not (path.startswith("/status/") or path == "/health")
    for name in END_TO_END:
        if not (echoed and name == "content-length"):  # the echo grows by the forwarding headers
            assert proxied.headers.get(name) == direct.headers.get(name), name
    if not echoed:
        assert proxied.content == direct.content
    else:
        # The echo reports what reached the upstream: same method, path, query and body; the gateway only
        # adds its forwarding headers.
        direct_echo, proxied_echo = direct.json(), proxied.json()
        for key in ("method", "path", "query", "body_sha256", "body_bytes"):
            assert proxied_echo[key] == direct_echo[key], key
        sent = proxied_echo["headers"]
        assert sent["x-forwarded-for"] == "127.0.0.1"
        assert sent["x-forwarded-proto"] == "http"
        assert sent["x-request-id"] == "fixed-id"
        added = set(sent) - set(direct_echo["headers"])
        if content is None and sent.get("content-length") == "0":
            added.discard("content-length")  # aiohttp states an empty body on DELETE; same meaning as none
        assert added == {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}


def test_hop_by_hop_headers_are_dropped_both_ways(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.get(
            url + "/v1/models",
            headers={
                "connection": "keep-alive, x-secret-hop",
                "x-secret-hop": "1",
                "te": "trailers",
                "keep-alive": "5",
            },
        )
    sent = response.json()["headers"]
    assert "x-secret-hop" not in sent
    assert "te" not in sent
    assert "keep-alive" not in sent
    assert sent.get("connection") != "keep-alive, x-secret-hop"
    assert "transfer-encoding" not in response.headers or response.headers["transfer-encoding"] == "chunked"


def test_request_id_is_created_when_absent_and_returned(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.get(url + "/v1/models")
        kept = httpx.get(url + "/v1/models", headers={"x-request-id": "abc-123"})
    created = response.headers["x-request-id"]
    assert len(created) == 32
    assert response.json()["headers"]["x-request-id"] == created
    assert kept.headers["x-request-id"] == "abc-123"


def test_forwarded_for_appends_to_an_existing_chain(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.get(url + "/v1/models", headers={"x-forwarded-for": "203.0.113.7"})
    assert response.json()["headers"]["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"


def test_no_client_headers_are_invented(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with (
        make_gateway(upstream) as (_, url),
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock,
    ):
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    sent = orjson.loads(data.partition(b"\r\n\r\n")[2])["headers"]
    assert "user-agent" not in sent
    assert "accept-encoding" not in sent
    assert "accept" not in sent


def test_cookies_never_leak_between_clients(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        first = httpx.get(url + "/set-cookie")
        second = httpx.get(url + "/v1/models")
    assert first.headers["set-cookie"] == "session=secret; Path=/"
    assert "cookie" not in second.json()["headers"]


def test_large_streaming_bodies_both_ways(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    size = 8 << 20
    with make_gateway(upstream) as (_, url):
        down = httpx.get(url + f"/big?size={size}")
        up = httpx.post(url + "/v1/files", content=(b"q" * 65536 for _ in range(64)))
    assert len(down.content) == size
    assert down.content[:256] == bytes(range(256))
    assert up.json()["body_bytes"] == 64 * 65536


def test_sse_first_chunk_arrives_while_the_upstream_holds_the_stream(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with (
        make_gateway(upstream) as (_, url),
        httpx.stream(
            "POST", url + "/v1/chat/completions", content=b'{"stream": true, "messages": []}', timeout=10
        ) as response,
    ):
        assert response.headers["content-type"] == "text/event-stream"
        lines = response.iter_lines()
        assert next(lines) == 'data: {"n": 1}'
        assert not app.state.sse_release.is_set()  # the upstream is still holding the stream open
        app.state.sse_release.set()
        rest = [line for line in lines if line]
    assert rest == ['data: {"n": 2}', "data: [DONE]"]


def test_client_disconnect_mid_stream_closes_the_upstream_side(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream) as (_, url):
        with httpx.stream("GET", url + "/sse", timeout=10) as response:
            assert next(response.iter_lines()) == 'data: {"n": 1}'
            left_at = time.monotonic()
        # Leaving the block closes the client connection mid-stream.
        assert app.state.disconnected.wait(5)
        assert app.state.disconnected_at is not None
        assert app.state.disconnected_at - left_at < 1.0
        metrics = httpx.get(url + "/metrics").text
    assert 'mmgate_requests_total{code="200",route="other"}' in metrics
    assert "mmgate_inflight_requests 1.0" in metrics  # only the /metrics request itself


def test_unreachable_upstream_is_502_in_the_route_envelope(make_gateway: GatewayFactory) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    with make_gateway(dead) as (_, url):
        chat = httpx.post(url + "/v1/chat/completions", content=b"{}")
        messages = httpx.post(url + "/v1/messages", content=b"{}")
        models = httpx.get(url + "/v1/models")
    assert chat.status_code == 502
    assert chat.json()["type"] == "BadGatewayError"
    assert chat.json()["code"] == 502
    assert dead in chat.json()["message"]
    assert messages.status_code == 502
    assert messages.json()["error"]["type"] == "api_error"
    assert models.status_code == 502


def test_upstream_read_timeout_is_504_naming_the_knob(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream, upstream={"read_timeout_s": 0.3}, errors={"openai_envelope": "openai"}) as (
        _,
        url,
    ):
        started = time.monotonic()
        response = httpx.get(url + "/slow-headers?s=3", timeout=10)
        elapsed = time.monotonic() - started
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["type"] == "GatewayTimeoutError"
    assert "upstream.read_timeout_s=0.3" in error["message"]
    assert elapsed < 2.5


def test_read_timeout_mid_stream_aborts_the_connection(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with (
        make_gateway(upstream, upstream={"read_timeout_s": 0.3}) as (_, url),
        httpx.stream("GET", url + "/stall-body", timeout=10) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()  # the body never completes: the gateway must not pretend it did


def test_concurrent_streams_are_independent(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    results: list[int] = []
    with make_gateway(upstream) as (_, url):

        def worker() -> None:
            with httpx.Client() as client:
                for _ in range(20):
                    results.append(client.post(url + "/v1/completions", content=b'{"prompt":"x"}').status_code)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [200] * 160


def test_blocked_paths_are_refused_not_forwarded(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"blocked_paths": ["/release_memory", "/update_weights"]}) as (_, url):
        blocked = httpx.post(url + "/update_weights/now", content=b"{}")
        allowed = httpx.get(url + "/v1/models")
    assert blocked.status_code == 403
    assert blocked.json()["type"] == "PermissionDeniedError"
    assert "upstream.blocked_paths" in blocked.json()["message"]
    assert allowed.status_code == 200
    assert app.state.paths() == ["/v1/models"]
