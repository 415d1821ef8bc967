from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.rawhttp import open_request, read_response
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import served_process
from tests.serving.test_http_limits import (
    answer,
    closed_within,
    connect,
    head_with_headers,
    padded_head,
    served,
)

ROOT = Path(__file__).resolve().parents[2]

# `python -m gateway` as a terminal starts it, with SIGINT at Python's default handler. A shell starts a background
# job with SIGINT ignored, and its children inherit that: uvicorn still drains on SIGINT, but its re-raise of the
# signal once shut down then does nothing, and the exit status is 0.
GATEWAY_AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('gateway', run_name='__main__', alter_sys=True)",
]


@contextmanager
def gateway_process(
    tmp_path: Path, upstream: str, drain_timeout_s: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    config = tmp_path / "gateway.yaml"
    # The stub's streaming routes are no public API: opened.
    config.write_text(
        f"server:\n  drain_timeout_s: {drain_timeout_s}\n  access_log: false\nupstream:\n  allowed_paths: [/]\n"
    )
    with served_process(
        "gateway", config, "--upstream", upstream, start_timeout_s=30, command=GATEWAY_AS_FROM_A_TERMINAL
    ) as served:
        yield served.process, served.url


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams_then_exits(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    app, upstream = stub
    with (
        gateway_process(tmp_path, upstream, drain_timeout_s=20) as (process, url),
        httpx.stream("GET", url + "/sse", timeout=20) as response,
    ):
        lines = response.iter_lines()
        assert next(lines) == 'data: {"n": 1}'
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/healthz", timeout=2)
        assert process.poll() is None  # still finishing the stream
        app.state.sse_release.set()
        assert [line for line in lines if line] == ['data: {"n": 2}', "data: [DONE]"]
        # uvicorn re-raises the signal once shut down, so the exit status says "terminated by SIGTERM".
        assert process.wait(timeout=15) in (0, -signal.SIGTERM)


@pytest.mark.slow
def test_requests_cut_by_the_drain_timeout_are_answered_in_their_envelope(
    stub: tuple[StubUpstream, str], tmp_path: Path
) -> None:
    """Past `server.drain_timeout_s` what is still running gets a JSON 503 (or, mid-stream, a terminal error
    event), the access log records what was sent, and the shutdown logs no traceback."""
    _, upstream = stub
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  drain_timeout_s: 1\nupstream:\n  allowed_paths: [/slow-headers]\n")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    results: dict[str, tuple[int, str]] = {}

    def stream(name: str, path: str) -> None:
        with httpx.stream("POST", url + path, json=chat, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines) == 'data: {"n": 1}'
            started.release()
            results[name] = (response.status_code, "\n".join(lines))

    def held(name: str) -> None:
        started.release()
        response = httpx.get(url + "/slow-headers?s=20", timeout=30)
        results[name] = (response.status_code, response.text)

    with served_process("gateway", config, "--upstream", upstream, start_timeout_s=30) as served:
        process, url = served.process, served.url
        started = threading.Semaphore(0)
        clients = [
            threading.Thread(target=stream, args=("openai", "/v1/chat/completions")),
            threading.Thread(target=stream, args=("anthropic", "/v1/messages")),
            threading.Thread(target=held, args=("held",)),
        ]
        for client in clients:
            client.start()
        for _ in clients:
            assert started.acquire(timeout=30)
        time.sleep(0.3)  # the held request reaches the upstream
        process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(timeout=30)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        output = process.communicate()[0]

    status, body = results["held"]
    assert status == 503
    cut = "the gateway shut down before the request finished (server.drain_timeout_s=1)"
    assert orjson.loads(body) == {
        "object": "error",
        "message": cut,
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    status, rest = results["openai"]
    assert status == 200
    event = rest.strip().splitlines()
    assert event[0].startswith("data: ")
    assert orjson.loads(event[0][6:])["message"] == cut
    status, rest = results["anthropic"]
    assert status == 200
    name, data = rest.strip().splitlines()
    assert name == "event: error"
    assert orjson.loads(data[6:]) == {"type": "error", "error": {"type": "overloaded_error", "message": cut}}
    logged = [orjson.loads(line) for line in output.splitlines() if '"request_id"' in line]
    assert sorted((line["path"], line["status"], line["rejection"]) for line in logged if line["rejection"]) == [
        ("/slow-headers", 503, "drain_timeout"),
        ("/v1/chat/completions", 200, "drain_timeout"),
        ("/v1/messages", 200, "drain_timeout"),
    ]
    assert "Traceback" not in output, output
    assert "Exception in ASGI application" not in output


def test_ctrl_c_stops_without_a_traceback(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    _, upstream = stub
    with gateway_process(tmp_path, upstream, drain_timeout_s=5) as (process, _):
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 128 + signal.SIGINT
        output = process.communicate()[0]
    assert "Traceback" not in output, output
    assert "Finished server process" in output


def start_request_stop(tmp_path: Path, upstream: str, server: str) -> str:
    """All a gateway writes, stdout and stderr, from its start through one request and a SIGTERM to its exit."""
    config = tmp_path / "gateway.yaml"
    config.write_text(f"server:\n  drain_timeout_s: 1\n{server}")
    with served_process("gateway", config, "--upstream", upstream, start_timeout_s=30) as served:
        assert httpx.get(served.url + "/v1/models", timeout=10).status_code == 200
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=30) in (0, -signal.SIGTERM)
        return served.process.communicate()[0]


@pytest.mark.slow
def test_every_line_a_gateway_writes_is_a_json_object(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    _, upstream = stub
    output = start_request_stop(tmp_path, upstream, "")
    lines = [orjson.loads(line) for line in output.splitlines()]
    logged = [line for line in lines if "request_id" not in line]  # the rest: the access log's line
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in logged), logged
    loggers = {line["logger"] for line in logged}
    assert {"uvicorn.error", "mmgate.gateway"} <= loggers, loggers
    assert any(line["path"] == "/v1/models" for line in lines if "request_id" in line)


@pytest.mark.slow
def test_log_format_text_writes_plain_lines(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    _, upstream = stub
    output = start_request_stop(tmp_path, upstream, "  log_format: text\n  access_log: false\n")
    lines = output.splitlines()
    assert any(" INFO mmgate.gateway: gateway forwarding to " in line for line in lines), output
    for line in lines:
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ", line), line
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(line)


# Request-head limits, timeouts and the connection cap, applied from the `server` settings.

SMALL_LIMITS: dict[str, float] = {
    "max_connections": 4,
    "max_header_bytes": 4096,
    "max_headers": 16,
    "header_timeout_s": 0.5,
    "body_idle_timeout_s": 0.5,
}


def stalled_chat_body(url: str, wait_s: float) -> tuple[int, dict[str, str]] | None:
    """A chat request that sends 10 of its 100 body bytes, then nothing: the answer within `wait_s`, if any."""
    with open_request(url, "POST /v1/chat/completions HTTP/1.1\nhost: x\ncontent-length: 100\n") as sock:
        sock.sendall(b'{"model": ')
        sock.settimeout(wait_s)
        try:
            status, headers, _ = read_response(sock)
        except TimeoutError:
            return None
        assert closed_within(sock, 2)
        return status, headers


def idle_kept_open(url: str, wait_s: float) -> bool:
    with connect(url) as sock:
        return not closed_within(sock, wait_s)


def held_connections_served(url: str, count: int) -> bool:
    held = [connect(url) for _ in range(count)]
    try:
        return all(served(sock) for sock in held)
    finally:
        for sock in held:
            sock.close()


# What each limit prevents: True when the limit is off.
LIMIT_OFF = {
    "max_connections": lambda url: held_connections_served(url, 8),
    "max_header_bytes": lambda url: answer(url, padded_head(8192)) == (200, False),
    "max_headers": lambda url: answer(url, head_with_headers(32)) == (200, False),
    "header_timeout_s": lambda url: idle_kept_open(url, 1.0),
    "body_idle_timeout_s": lambda url: stalled_chat_body(url, 1.0) is None,
}


def test_gateway_refuses_oversized_request_heads_by_default(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        assert answer(url, padded_head(64 << 10)) == (200, False)
        assert answer(url, padded_head((64 << 10) + 1)) == (431, True)
        assert answer(url, head_with_headers(128)) == (200, False)
        assert answer(url, head_with_headers(129)) == (431, True)


def test_a_64_mib_header_neither_stalls_healthz_nor_is_read_in_full(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    size = 64 << 20
    sent = 0
    with make_gateway(upstream) as (_, url):

        def flood() -> None:
            nonlocal sent
            block = b"a" * (1 << 20)
            with connect(url) as sock:
                try:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
                    while sent < size:
                        sock.sendall(block)
                        sent += len(block)
                except OSError:
                    pass

        sender = threading.Thread(target=flood)
        latencies: list[float] = []
        with httpx.Client(base_url=url, timeout=20) as client:
            started = time.monotonic()
            sender.start()
            while sender.is_alive() or time.monotonic() - started < 0.5:
                before = time.monotonic()
                assert client.get("/healthz").status_code == 200
                latencies.append(time.monotonic() - before)
                if time.monotonic() - started > 8:
                    break
        sender.join(timeout=30)
    assert sent < size  # refused after its first 64 KiB
    assert max(latencies) < 1.0  # with the whole header read, /healthz waits seconds


def test_gateway_times_out_slow_clients(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    server = {"header_timeout_s": 0.5, "body_idle_timeout_s": 0.5, "access_log": True}
    with make_gateway(upstream, server=server) as (_, url):
        with open_request(url, "GET /healthz HTTP/1.1\nhost: x") as unfinished:
            status, headers, _ = read_response(unfinished)
            assert (status, headers["connection"]) == (408, "close")
            assert closed_within(unfinished, 2)
        answered = stalled_chat_body(url, 2.0)
        assert answered is not None
        assert (answered[0], answered[1]["connection"]) == (408, "close")
        deadline = time.monotonic() + 2
        while not [r for r in caplog.records if r.name == "mmgate.access"] and time.monotonic() < deadline:
            time.sleep(0.02)
    (line,) = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    assert line["client_disconnected"] is True  # the gateway saw the client leave and freed its request
    assert app.state.requests == []


def test_gateway_caps_connections(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    # `served` sends `GET /`, no public API: opened.
    with (
        make_gateway(upstream, server={"max_connections": 2}, upstream={"allowed_paths": ["/"]}) as (_, url),
        connect(url) as one,
        connect(url) as two,
    ):
        assert served(one)
        assert served(two)
        with connect(url) as third:
            assert read_response(third)[0] == 503
        assert served(one)


@pytest.mark.parametrize("key", list(LIMIT_OFF))
def test_null_turns_each_limit_off(key: str, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    keys = list(LIMIT_OFF)
    sibling = keys[(keys.index(key) + 1) % len(keys)]
    with make_gateway(upstream, server={**SMALL_LIMITS, key: None}, upstream={"allowed_paths": ["/"]}) as (_, url):
        assert LIMIT_OFF[key](url)
        assert not LIMIT_OFF[sibling](url)  # the others still apply
