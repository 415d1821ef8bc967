from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest

from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import GatewaySettings
from gateway.proxy import BODY_SLICE_BYTES
from serving.settings_loader import ConfigError, load_settings
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.rawhttp import open_request, read_response
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread

# Headers that must be the same whether the client talks to the upstream directly or through the gateway.
END_TO_END = ("content-type", "content-length", "x-upstream-header", "x-stub", "set-cookie", "cache-control")

# Paths outside the model servers' public API reach the stub only where the operator opens them.
EVERY_PATH = {"allowed_paths": ["/"]}


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
    with make_gateway(upstream, upstream=EVERY_PATH) as (_, url):
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


def test_forwarded_for_appends_to_a_trusted_proxys_chain(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """From a peer in server.forwarded_allow_ips (127.0.0.1 by default) the chain is believed: the access log names
    the client it says, and the upstream gets the chain with the peer appended."""
    _, upstream = stub
    caplog.set_level("INFO", logger="mmgate.access")
    forwarded = {"x-forwarded-for": "203.0.113.7, 10.1.2.3", "forwarded": "for=203.0.113.7"}
    trusted = {"forwarded_allow_ips": ["127.0.0.1", "10.0.0.0/8"]}
    with make_gateway(upstream, server={**trusted, "access_log": True}) as (_, url):
        response = httpx.get(url + "/v1/models", headers={**forwarded, "x-request-id": "chain-1"})
        logged = _logged(caplog, "chain-1", 5)
    sent = response.json()["headers"]
    assert sent["x-forwarded-for"] == "203.0.113.7, 10.1.2.3, 127.0.0.1"
    assert sent["forwarded"] == "for=203.0.113.7"
    assert logged["client"] == "203.0.113.7:0"  # the rightmost address that is not a trusted proxy


def test_an_untrusted_peers_forwarding_headers_never_reach_the_upstream(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's own X-Forwarded-For / Forwarded is not passed on as if the gateway vouched for it, nor logged as
    the client."""
    _, upstream = stub
    caplog.set_level("INFO", logger="mmgate.access")
    claims = {
        "x-forwarded-for": "6.6.6.6",
        "forwarded": "for=6.6.6.6;proto=https",
        "x-forwarded-proto": "https",
        "x-real-ip": "6.6.6.6",
    }
    with make_gateway(upstream, server={"forwarded_allow_ips": [], "access_log": True}) as (_, url):
        response = httpx.get(url + "/v1/models", headers={**claims, "x-request-id": "claim-1"})
        logged = _logged(caplog, "claim-1", 5)
    sent = response.json()["headers"]
    assert sent["x-forwarded-for"] == "127.0.0.1"
    assert sent["x-forwarded-proto"] == "http"
    assert "forwarded" not in sent
    assert "x-real-ip" not in sent
    assert logged["client"].startswith("127.0.0.1:")


def test_forwarded_allow_ips_refuses_what_is_not_an_address() -> None:
    with pytest.raises(ConfigError, match=r"server\.forwarded_allow_ips.*'proxy\.internal' is not an IP address"):
        load_settings(GatewaySettings, None, {"server": {"forwarded_allow_ips": ["10.0.0.0/8", "proxy.internal"]}})


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
    with make_gateway(upstream, upstream=EVERY_PATH) as (_, url):
        first = httpx.get(url + "/set-cookie")
        second = httpx.get(url + "/v1/models")
    assert first.headers["set-cookie"] == "session=secret; Path=/"
    assert "cookie" not in second.json()["headers"]


def test_large_streaming_bodies_both_ways(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    size = 8 << 20
    with make_gateway(upstream, upstream=EVERY_PATH) as (_, url):
        down = httpx.get(url + f"/big?size={size}")
        up = httpx.post(url + "/v1/files", content=(b"q" * 65536 for _ in range(64)))
    assert len(down.content) == size
    assert down.content[:256] == bytes(range(256))
    assert up.json()["body_bytes"] == 64 * 65536


@pytest.mark.parametrize("size", [BODY_SLICE_BYTES - 1, BODY_SLICE_BYTES + 1, 3 * BODY_SLICE_BYTES + 7])
def test_a_read_body_reaches_the_upstream_whole_with_its_length(
    size: int, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """The admission routes read the body before forwarding it; past one slice it goes up in slices, under the
    same Content-Length and never chunked."""
    app, upstream = stub
    image = data_url(image_bytes(8, 8), "image/png")
    body = chat_body(image, text="", pad="p" * (size - len(chat_body(image, text="", pad=""))))
    assert len(body) == size
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    seen = app.state.requests[-1]
    assert seen.body == body
    assert seen.headers["content-length"] == str(size)
    assert "transfer-encoding" not in seen.headers


def test_an_upstream_that_stops_reading_a_large_body_is_504_naming_the_knob(make_gateway: GatewayFactory) -> None:
    """aiohttp's read timeout starts with the response: the body's own progress is what bounds an upstream that
    accepts the connection and then reads nothing."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    body = chat_body(data_url(image_bytes(8, 8), "image/png"), text="", pad="p" * (16 << 20))
    limits = {"max_request_body_bytes": 64 << 20}
    upstream = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with make_gateway(upstream, upstream={"read_timeout_s": 0.5}, limits=limits) as (gateway, url):
            started = time.monotonic()
            response = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
            took = time.monotonic() - started
            in_use = gateway.budget.in_use
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert response.status_code == 504, response.text
    assert "upstream.read_timeout_s=0.5" in response.text
    assert took < 10
    assert in_use == 0


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
    with make_gateway(upstream, upstream=EVERY_PATH) as (_, url):
        with httpx.stream("GET", url + "/sse", timeout=10) as response:
            # Kept until the block ends: a dropped line iterator may close the stream when it is collected.
            stream_lines = response.iter_lines()
            assert next(stream_lines) == 'data: {"n": 1}'
            left_at = time.monotonic()
        # Leaving the block closes the client connection mid-stream; the upstream side closes after it, long
        # before the stub's 30 s hold of the stream would end.
        assert app.state.disconnected.wait(10)
        assert app.state.disconnected_at is not None
        assert left_at <= app.state.disconnected_at
        metrics = httpx.get(url + "/metrics").text
    assert 'mmgate_requests_total{code="200",route="other"}' in metrics
    assert "mmgate_inflight_requests 1.0" in metrics  # only the /metrics request itself


def test_unreachable_upstream_is_502_in_the_route_envelope(make_gateway: GatewayFactory) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    with make_gateway(dead) as (_, url):
        chat = httpx.post(url + "/v1/chat/completions", content=b"{}")
        messages = httpx.post(url + "/v1/messages", content=b"{}")
        models = httpx.get(url + "/v1/models")
    with make_gateway(dead, errors={"expose_internal": True}) as (_, url):
        detailed = httpx.post(url + "/v1/chat/completions", content=b"{}")
    assert chat.status_code == 502
    assert chat.json()["type"] == "BadGatewayError"
    assert chat.json()["code"] == 502
    assert "the upstream model server is unreachable" in chat.json()["message"]
    assert dead not in chat.json()["message"]  # errors.expose_internal: false keeps addresses in the log
    assert dead in detailed.json()["message"]
    assert messages.status_code == 502
    assert messages.json()["error"]["type"] == "api_error"
    assert models.status_code == 502


def test_upstream_read_timeout_is_504_naming_the_knob(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.stall_headers_s = 30.0  # the stub sits on its headers until the gateway gives up on it
    opened = {**EVERY_PATH, "read_timeout_s": 0.3}
    with make_gateway(upstream, upstream=opened, errors={"openai_envelope": "openai"}) as (_, url):
        started = time.monotonic()
        response = httpx.get(url + "/stalled", timeout=30)
        elapsed = time.monotonic() - started
        assert app.state.disconnected.wait(10)  # the gateway closed the upstream request it gave up on
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["type"] == "GatewayTimeoutError"
    assert "upstream.read_timeout_s=0.3" in error["message"]
    assert 0.3 * 0.9 <= elapsed < 10  # the timeout, never early, and far before the stub's 30 s


def test_read_timeout_mid_stream_aborts_the_connection(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with (
        make_gateway(upstream, upstream={**EVERY_PATH, "read_timeout_s": 0.3}) as (_, url),
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


def test_blocked_paths_narrow_the_public_api(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"blocked_paths": ["/v1/completions", "/v1/embeddings"]}) as (_, url):
        blocked = httpx.post(url + "/v1/completions", content=b"{}")
        allowed = httpx.get(url + "/v1/models")
    assert blocked.status_code == 403
    assert blocked.json()["type"] == "PermissionDeniedError"
    assert "upstream.blocked_paths" in blocked.json()["message"]
    assert allowed.status_code == 200
    assert app.state.paths() == ["/v1/models"]


# Routes of trtllm-serve (tensorrt_llm/serve/openai_server.py at 00057725) and vLLM 0.32.0 (vllm/entrypoints/serve/
# dev/, rl/, profile/, lora/) that are no public API: a gateway that is the pod's only door forwards none of them.
ADMIN_ROUTES = [
    ("GET", "/server_info"),
    ("GET", "/steady_clock_offset"),
    ("POST", "/steady_clock_offset"),
    ("POST", "/kv_cache_events"),
    ("POST", "/v1/kv_cache_hints"),
    ("POST", "/release_memory"),
    ("POST", "/resume_memory"),
    ("POST", "/update_weights"),
    ("GET", "/perf_metrics"),
    ("GET", "/health_generate"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/reset_mm_cache"),
    ("POST", "/start_profile"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/pause"),
    ("GET", "/metrics"),
    ("GET", "/prometheus/metrics"),
    ("GET", "/docs"),
    ("GET", "/v1/modelsx"),
]


def test_only_the_public_api_is_forwarded_by_default(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """Default-deny: the admin and development routes of both servers are answered 403 naming the key that opens
    them, in the route's envelope; the public API and every admission route (GET included) reach the upstream."""
    app, upstream = stub
    public = [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/version"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/embeddings"),
        ("GET", "/tokenize"),
        ("POST", "/v1/rerank"),
    ]
    with make_gateway(upstream, server={"metrics_port": _closed_port()}) as (_, url):
        refused = {(method, path): httpx.request(method, url + path, content=b"{}") for method, path in ADMIN_ROUTES}
        served = {(method, path): httpx.request(method, url + path, content=b"{}") for method, path in public}
    for (method, path), response in refused.items():
        assert response.status_code == 403, (method, path, response.text)
        assert response.json()["type"] == "PermissionDeniedError"
        assert f"{method} {path} is not forwarded" in response.json()["message"]
        assert "upstream.allowed_paths" in response.json()["message"]
    assert {key: response.status_code for key, response in served.items()} == dict.fromkeys(public, 200)
    assert app.state.paths() == [path for _, path in public]


def test_allowed_paths_open_a_route_and_everything_under_it(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    opened = {"allowed_paths": ["/metrics", "/start_profile"], "blocked_paths": ["/start_profile"]}
    with make_gateway(upstream, upstream=opened, server={"metrics_port": _closed_port()}) as (_, url):
        metrics = httpx.get(url + "/metrics")
        below = httpx.get(url + "/metrics/sub")
        beside = httpx.get(url + "/metricsx")
        blocked = httpx.post(url + "/start_profile", content=b"{}")
    assert (metrics.status_code, below.status_code) == (200, 200)
    assert beside.status_code == 403
    assert blocked.status_code == 403
    assert "upstream.blocked_paths" in blocked.json()["message"]
    assert app.state.paths() == ["/metrics", "/metrics/sub"]


def test_a_refused_route_answers_in_the_anthropic_envelope_on_an_anthropic_path(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"blocked_paths": ["/v1/messages/count_tokens"]}) as (_, url):
        refused = httpx.post(url + "/v1/messages/count_tokens", content=b"{}")
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    assert app.state.paths() == []


def _logged(caplog: pytest.LogCaptureFixture, request_id: str, within_s: float) -> dict[str, Any]:
    """The access-log line of `request_id`, waiting up to `within_s` for the gateway to write it."""
    deadline = time.monotonic() + within_s
    while True:
        for record in list(caplog.records):
            if record.name == "mmgate.access":
                line: dict[str, Any] = orjson.loads(record.getMessage())
                if line["request_id"] == request_id:
                    return line
        if time.monotonic() > deadline:
            raise AssertionError(f"no access-log line for {request_id} within {within_s} s")
        time.sleep(0.01)


CHAT = b'{"messages":[{"role":"user","content":"hi"}]}'
PROMPT = b'{"prompt":"hi"}'
LEAVING = {
    # An admission route without media: the gateway has read the body before it forwards.
    "body_read_first": (
        f"POST /v1/chat/completions HTTP/1.1\nHost: h\nContent-Length: {len(CHAT)}\n",
        CHAT,
    ),
    # Any other route: the body streams to the upstream as it arrives.
    "streamed_body": (
        "POST /v1/completions HTTP/1.1\nHost: h\nTransfer-Encoding: chunked\n",
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(PROMPT), PROMPT),
    ),
    "no_body": ("GET /v1/models HTTP/1.1\nHost: h\n", b""),
}


@pytest.mark.parametrize("case", list(LEAVING))
def test_client_leaving_before_the_upstream_answers_closes_the_upstream_request(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    app, upstream = stub
    app.state.stall_headers_s = 30.0
    caplog.set_level(logging.INFO, logger="mmgate.access")
    head, body = LEAVING[case]
    with make_gateway(upstream, server={"access_log": True}) as (_, url):
        sock = open_request(url, head + f"X-Request-Id: leaver-{case}\n")
        sock.sendall(body)
        assert app.state.stalling.wait(5)  # the whole body is upstream, which now sits on its headers
        left_at = time.monotonic()
        sock.close()
        # Closed after the client left, long before the stub's 30 s stall would end.
        assert app.state.disconnected.wait(10)
        assert app.state.disconnected_at is not None
        assert left_at <= app.state.disconnected_at
        line = _logged(caplog, f"leaver-{case}", within_s=10)
    assert line["status"] == 499
    assert line["client_disconnected"] is True
    assert line["rejection"] is None


def test_client_leaving_mid_body_closes_the_upstream_request(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    with make_gateway(upstream, server={"access_log": True}) as (_, url):
        sock = open_request(
            url, "POST /v1/completions HTTP/1.1\nHost: h\nTransfer-Encoding: chunked\nX-Request-Id: half-body\n"
        )
        sock.sendall(b"5\r\nhello\r\n")  # and never the rest
        assert app.state.arrived.wait(5)
        left_at = time.monotonic()
        sock.close()
        # Closed after the client left: the stub would otherwise wait for the rest of the body.
        assert app.state.disconnected.wait(10)
        assert app.state.disconnected_at is not None
        assert left_at <= app.state.disconnected_at
        line = _logged(caplog, "half-body", within_s=10)
    assert line["status"] == 499
    assert line["client_disconnected"] is True
    assert app.state.paths() == []  # the upstream never got a whole request


def test_client_leaving_with_media_before_the_upstream_answers_releases_the_budget(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.stall_headers_s = 30.0
    share = 1 << 20
    limits = {"budget_mode": "slots", "max_multimodal_cpu_bytes": share, "max_multimodal_cpu_bytes_per_request": share}
    body = chat_body(data_url(image_bytes(64, 64)))
    with make_gateway(upstream, limits=limits) as (gateway, url):
        sock = open_request(url, f"POST /v1/chat/completions HTTP/1.1\nHost: h\nContent-Length: {len(body)}\n")
        sock.sendall(body)
        assert app.state.stalling.wait(5)
        assert gateway.budget.in_use == share
        left_at = time.monotonic()
        sock.close()
        while gateway.budget.in_use and time.monotonic() - left_at < 10:
            time.sleep(0.01)
        # Released because the client left: the upstream's 30 s stall would have held it far longer.
        assert gateway.budget.in_use == 0
        assert app.state.disconnected.wait(10)


@contextmanager
def _gateway_on(http: str, upstream: str) -> Iterator[str]:
    """The gateway under uvicorn's `http` protocol implementation (`make_gateway` takes uvicorn's default)."""
    settings = GatewaySettings(upstream={"url": upstream}, server={"access_log": False}, media={"processor": None})
    gateway = Gateway(settings)
    config = GATEWAY.server_config(gateway, settings)
    config.http = http
    with ServerThread(gateway, config=config) as server:
        yield server.url


def _exchange(url: str, head: str) -> tuple[int, dict[str, str], bytes]:
    with open_request(url, head) as sock:
        return read_response(sock)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_options_asterisk_is_answered_by_the_gateway(stub: tuple[StubUpstream, str], http: str) -> None:
    app, upstream = stub
    with _gateway_on(http, upstream) as url:
        status, headers, body = _exchange(url, "OPTIONS * HTTP/1.1\nHost: h\nConnection: close\n")
    assert status == 200
    allowed = {method.strip() for method in headers["allow"].split(",")}
    assert {"GET", "HEAD", "POST", "OPTIONS"} <= allowed
    assert headers["content-length"] == "0"
    assert body == b""
    assert app.state.paths() == []


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_asterisk_with_another_method_is_400(stub: tuple[StubUpstream, str], http: str) -> None:
    app, upstream = stub
    with _gateway_on(http, upstream) as url:
        status, _, body = _exchange(url, "GET * HTTP/1.1\nHost: h\nConnection: close\n")
    assert status == 400
    assert orjson.loads(body)["type"] == "BadRequestError"
    assert app.state.paths() == []


@pytest.mark.parametrize("target", ["http://example.com/v1/models", "v1/models", "example.com:443"])
def test_target_that_is_not_a_path_is_400_not_forwarded(stub: tuple[StubUpstream, str], target: str) -> None:
    # uvicorn's httptools protocol turns an absolute-form target into its path and refuses the others itself;
    # its h11 protocol hands them to the app as they came.
    app, upstream = stub
    with _gateway_on("h11", upstream) as url:
        status, _, body = _exchange(url, f"GET {target} HTTP/1.1\nHost: h\nConnection: close\n")
    assert status == 400
    error = orjson.loads(body)
    assert error["type"] == "BadRequestError"
    assert target in error["message"]
    assert app.state.paths() == []
