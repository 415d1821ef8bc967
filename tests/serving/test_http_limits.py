"""The HTTP limits protocol under real uvicorn on loopback, driven by raw sockets."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn

from serving.asgi import ClientDisconnected, disconnect_signal, until_disconnect
from serving.http_limits import HttpLimits
from serving.server import DrainingServer, uvicorn_config
from serving.uvicorn_private import HIGH_WATER_LIMIT
from tests.gateway.rawhttp import open_request, read_response
from tests.servers import ServerThread
from tests.stub_asgi import lifespan

TIMEOUT_S = 0.5
# include/net/tcp_states.h: our FIN acknowledged, the peer's not yet received.
TCP_FIN_WAIT2 = 5


class Recorder:
    """`GET` answers at once; `POST /body` reads the body and answers its length, `POST /held` the same after
    `hold_s`. What each `receive()` returned is kept in `messages`; `disconnected` is set when one was
    `http.disconnect`."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.messages: list[str] = []
        self.disconnected = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        size = 0
        if scope["path"] in ("/body", "/held"):
            if scope["path"] == "/held":
                await asyncio.sleep(self.hold_s)
            while True:
                message = await receive()
                self.messages.append(message["type"])
                if message["type"] == "http.disconnect":
                    self.disconnected.set()
                    return
                size += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
        body = str(size).encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class SignalWatcher(Recorder):
    """`POST /watch` reads the body, then waits for the client to leave through the scope's `DisconnectSignal`
    alone (`receive` is not read again); `left` is set when it did. `awaiting_rest` is set when it waits in
    `receive()` for more of the body after the first piece; `loop` is the server's event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.left = threading.Event()
        self.awaiting_rest = threading.Event()
        self.had_signal = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/watch":
            await super().__call__(scope, receive, send)
            return
        self.loop = asyncio.get_running_loop()
        message = await receive()
        while message.get("more_body"):
            # Nothing yields between this and `receive()` waiting for the next piece.
            self.awaiting_rest.set()
            message = await receive()
        signal = disconnect_signal(scope)
        self.had_signal = signal is not None

        async def never() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {}

        try:
            await until_disconnect(asyncio.sleep(30), never, signal=signal)
        except ClientDisconnected:
            self.left.set()


class Draining:
    def start_draining(self) -> None:
        pass


@contextmanager
def serve(limits: HttpLimits, app: Recorder | None = None) -> Iterator[str]:
    app = app or Recorder()
    config = uvicorn_config(app, host="127.0.0.1", port=0, drain_timeout_s=1, log_level="warning", http_limits=limits)
    with ServerThread(app, config=config) as server:
        yield server.url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (after whatever it still sends) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def statuses_until_closed(sock: socket.socket) -> list[int]:
    """The status of each response the server sends before closing the connection (within 2 s)."""
    sock.settimeout(2)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return [int(status) for status in re.findall(rb"HTTP/1.1 (\d{3}) ", data)]


def padded_head(total: int) -> bytes:
    """A `GET /healthz` head of exactly `total` bytes."""
    start, end = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: ", b"\r\n\r\n"
    return start + b"a" * (total - len(start) - len(end)) + end


def head_with_headers(count: int) -> bytes:
    lines = [b"host: x"] + [b"x-h%d: v" % n for n in range(count - 1)]
    return b"GET /healthz HTTP/1.1\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"


def answer(url: str, head: bytes, *, pieces: int = 1) -> tuple[int, bool]:
    """The status for `head` sent in `pieces` sends, and whether the server closed the connection after it."""
    with connect(url) as sock:
        step = -(-len(head) // pieces)
        try:
            for offset in range(0, len(head), step):
                sock.sendall(head[offset : offset + step])
                time.sleep(0.01)
        except OSError:
            pass
        status, _, _ = read_response(sock)
        return status, closed_within(sock, 0.3)


def test_head_past_max_header_bytes_is_431_and_closes() -> None:
    limit = 64 << 10
    with serve(HttpLimits(max_header_bytes=limit)) as url:
        assert answer(url, padded_head(limit)) == (200, False)
        assert answer(url, padded_head(limit + 1)) == (431, True)
        # Counted across reads, not per read.
        assert answer(url, padded_head(limit + 1), pieces=8) == (431, True)
        assert answer(url, padded_head(limit), pieces=8) == (200, False)


def test_long_request_line_counts_toward_max_header_bytes() -> None:
    with serve(HttpLimits(max_header_bytes=1024)) as url:
        assert answer(url, b"GET /" + b"a" * 1024 + b" HTTP/1.1\r\nhost: x\r\n\r\n") == (431, True)


def test_pipelined_head_is_counted_from_its_start() -> None:
    # The second head begins inside the read that ends the first request, so only its parsed fields count there.
    with serve(HttpLimits(max_header_bytes=1024)) as url, connect(url) as sock:
        sock.sendall(padded_head(200) + padded_head(4000))
        assert statuses_until_closed(sock) == [200, 431]


def test_headers_past_max_headers_are_431_and_close() -> None:
    with serve(HttpLimits(max_headers=128)) as url:
        assert answer(url, head_with_headers(128)) == (200, False)
        assert answer(url, head_with_headers(129)) == (431, True)


def test_refusals_are_small_json_with_connection_close() -> None:
    with serve(HttpLimits(max_headers=1)) as url, connect(url) as sock:
        sock.sendall(head_with_headers(2))
        status, headers, body = read_response(sock)
    assert status == 431
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    assert body == b'{"error":"more than 1 headers"}'


def test_trickled_head_past_header_timeout_is_408_and_closes() -> None:
    stop = threading.Event()
    lines = 50
    with serve(HttpLimits(header_timeout_s=TIMEOUT_S)) as url, connect(url) as sock:
        sent: list[int] = []

        def trickle() -> None:
            # A header line every 0.2 s: the head is never quiet for the timeout, and takes 10 s to send.
            try:
                sock.sendall(b"GET / HTTP/1.1\r\n")
                for n in range(lines):
                    if stop.wait(0.2):
                        return
                    sock.sendall(b"x-%d: 1\r\n" % n)
                    sent.append(n)
            except OSError:
                pass

        sender = threading.Thread(target=trickle)
        started = time.monotonic()
        sender.start()
        try:
            status, headers, _ = read_response(sock)
            elapsed = time.monotonic() - started
            assert status == 408
            assert headers["connection"] == "close"
            # The head's whole time counts, not its silences: answered while the client was still sending it.
            assert len(sent) < lines
            assert elapsed >= TIMEOUT_S * 0.9
            assert closed_within(sock, 2)
        finally:
            stop.set()
            sender.join()


def test_idle_connections_are_closed_after_header_timeout() -> None:
    with serve(HttpLimits(header_timeout_s=TIMEOUT_S)) as url:
        with connect(url) as fresh:
            started = time.monotonic()
            # Closed without an answer: nothing of a request was sent. The recv's own timeout is a backstop.
            fresh.settimeout(10)
            assert fresh.recv(1024) == b""
            assert time.monotonic() - started >= TIMEOUT_S * 0.9
        # Each response starts the wait anew: 8 requests 0.3 timeouts apart (2.4 timeouts in all) are all served;
        # then the idle keep-alive connection is closed, well before uvicorn's own 5 s keep-alive timeout.
        with connect(url) as kept:
            for _ in range(8):
                time.sleep(TIMEOUT_S * 0.3)
                kept.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                assert read_response(kept)[0] == 200
            assert closed_within(kept, 3)


def stalled_body_is_408(url: str) -> bool:
    with open_request(url, "POST /body HTTP/1.1\nhost: x\ncontent-length: 100\n") as sock:
        sock.sendall(b"x" * 10)
        sock.settimeout(TIMEOUT_S + 2)
        status, headers, _ = read_response(sock)
        return status == 408 and headers["connection"] == "close" and closed_within(sock, 2)


def test_stalled_body_is_408_closes_and_the_app_sees_a_disconnect() -> None:
    app = Recorder()
    with serve(HttpLimits(body_idle_timeout_s=TIMEOUT_S), app) as url:
        assert stalled_body_is_408(url)
        assert app.disconnected.wait(2)
    assert app.messages == ["http.request", "http.disconnect"]


def test_a_request_s_disconnect_signal_fires_when_its_client_closes_the_connection() -> None:
    app = SignalWatcher()
    with serve(HttpLimits(), app) as url:
        with open_request(url, "POST /watch HTTP/1.1\nhost: x\ncontent-length: 2\n") as sock:
            sock.sendall(b"ab")
            time.sleep(0.1)
            assert not app.left.is_set()  # the request is held until its client goes
        assert app.left.wait(2)
    assert app.had_signal


@contextmanager
def loop_held(loop: asyncio.AbstractEventLoop | None) -> Iterator[None]:
    """The server's event loop kept in one callback for the block's duration: what a client sends meanwhile waits
    in the server's socket, and the server reads it all at once afterwards."""
    assert loop is not None
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(10)

    loop.call_soon_threadsafe(hold)
    assert holding.wait(5)
    try:
        yield
    finally:
        release.set()


def wait_acknowledged_with_fin(sock: socket.socket) -> None:
    """Until the server's kernel has acknowledged everything `sock` sent and the FIN after it (`sock`, shut for
    writing, is in FIN_WAIT2; the server's queue holds the data and the FIN, whether or not it reads)."""
    deadline = time.monotonic() + 5
    while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_FIN_WAIT2:
        assert time.monotonic() < deadline, "the server's kernel did not take the body and the FIN"
        time.sleep(0.01)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_client_that_leaves_after_a_last_body_piece_past_the_high_water_mark_is_seen(loop: str) -> None:
    """uvicorn pauses reading once the unread body passes its high-water mark, and resumes it only when `receive()`
    is called, before that waits. A last piece past the mark read in one go while the app already waits in
    `receive()` leaves reading paused with the body whole; the app then watches only the `DisconnectSignal` and
    calls `receive()` no more, so the client's FIN behind the body is read only because the protocol resumes
    reading where the body ends. The server's loop is held while the piece and the FIN are sent: both are queued
    before the server reads, and one read (256,000 bytes at most in uvloop, 256 KiB in asyncio) takes the whole piece.
    (Had the app called `receive()` after the piece was read, that call would have resumed reading itself.)"""
    app = SignalWatcher()
    config = uvicorn_config(app, host="127.0.0.1", port=0, drain_timeout_s=1, log_level="warning")
    config.loop = loop
    server = ServerThread(app, config=config)
    # Room in the server's receive queue for the whole piece, whatever the system's default buffer size
    # (accepted connections inherit the listener's).
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    last_piece = HIGH_WATER_LIMIT + 4096
    head = f"POST /watch HTTP/1.1\nhost: x\ncontent-length: {1 + last_piece}\n"
    with server, open_request(server.url, head) as sock:
        sock.sendall(b"a")
        assert app.awaiting_rest.wait(5)
        with loop_held(app.loop):
            sock.sendall(b"b" * last_piece)
            sock.shutdown(socket.SHUT_WR)
            wait_acknowledged_with_fin(sock)
        assert app.left.wait(2), "the client's FIN behind the body was never read"


def test_a_request_s_disconnect_signal_fires_when_the_body_idle_timeout_ends_it() -> None:
    app = Recorder()
    signals: list[Any] = []

    async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            signals.append(disconnect_signal(scope))
        await app(scope, receive, send)

    config = uvicorn_config(
        recording,
        host="127.0.0.1",
        port=0,
        drain_timeout_s=1,
        log_level="warning",
        http_limits=HttpLimits(body_idle_timeout_s=TIMEOUT_S),
    )
    with ServerThread(recording, config=config) as server:
        assert stalled_body_is_408(server.url)
        assert app.disconnected.wait(2)
    assert len(signals) == 1
    assert signals[0] is not None
    assert signals[0].fired


def slow_steady_body(url: str) -> tuple[int, bytes]:
    with open_request(url, "POST /body HTTP/1.1\nhost: x\ncontent-length: 8\n") as sock:
        for _ in range(8):  # 8 x 0.4 timeouts: longer than the timeout in all, never idle that long
            time.sleep(TIMEOUT_S * 0.4)
            sock.sendall(b"x")
        status, _, body = read_response(sock)
        return status, body


def body_behind_a_busy_app(url: str) -> tuple[int, bytes]:
    # The app reads nothing for 2 timeouts: uvicorn stops reading once 64 KiB are buffered, and that wait is the
    # server's, not the client's.
    size = 4 << 20
    with open_request(url, f"POST /held HTTP/1.1\nhost: x\ncontent-length: {size}\n") as sock:
        sock.sendall(b"x" * size)
        status, _, body = read_response(sock)
        return status, body


def body_after_100_continue(url: str) -> tuple[int, bytes]:
    # The client waits for `100 Continue`, which goes out when the app (busy for 2 timeouts) first reads.
    with open_request(url, "POST /held HTTP/1.1\nhost: x\ncontent-length: 4\nexpect: 100-continue\n") as sock:
        assert read_response(sock)[0] == 100
        sock.sendall(b"abcd")
        status, _, body = read_response(sock)
        return status, body


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (slow_steady_body, (200, b"8")),
        (body_behind_a_busy_app, (200, b"4194304")),
        (body_after_100_continue, (200, b"4")),
    ],
)
def test_only_the_clients_pauses_count_toward_body_idle_timeout(
    send: Callable[[str], tuple[int, bytes]], expected: tuple[int, bytes]
) -> None:
    with serve(HttpLimits(body_idle_timeout_s=TIMEOUT_S), Recorder(hold_s=2 * TIMEOUT_S)) as url:
        assert send(url) == expected
        assert stalled_body_is_408(url)


def served(sock: socket.socket) -> bool:
    try:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        return read_response(sock)[0] == 200
    except (OSError, IndexError):
        return False


def test_connections_past_max_connections_are_refused_until_one_closes() -> None:
    with serve(HttpLimits(max_connections=3)) as url:
        held = [connect(url) for _ in range(3)]
        try:
            assert all(served(sock) for sock in held)
            with connect(url) as extra:
                status, headers, _ = read_response(extra)
                assert (status, headers["connection"]) == (503, "close")
                assert closed_within(extra, 2)
            assert all(served(sock) for sock in held)  # the held ones are undisturbed
            held.pop().close()
            deadline = time.monotonic() + 2
            while True:
                with connect(url) as again:
                    if served(again):
                        break
                assert time.monotonic() < deadline, "a freed slot was not reused"
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize("http", ["h11", "httptools", "auto"])
def test_the_draining_server_refuses_a_protocol_without_the_limits(http: str) -> None:
    config = uvicorn_config(Recorder(), host="127.0.0.1", port=0, drain_timeout_s=1, log_level="warning")
    DrainingServer(config, Draining())  # the limits protocol, even with no limit set
    config.http = http
    with pytest.raises(ValueError, match="would not apply the HTTP limits"):
        DrainingServer(config, Draining())


def test_each_listening_port_has_its_own_connection_cap() -> None:
    """One server on two ports (the gateway's API and metrics listeners): clients holding every connection of one
    port leave the other's served, and each port's cap holds on its own."""
    app = Recorder()
    config = uvicorn_config(
        app, host="127.0.0.1", port=0, drain_timeout_s=1, log_level="warning", http_limits=HttpLimits(max_connections=2)
    )
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    main_url, other_url = (f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in listeners)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": listeners}, daemon=True)
    thread.start()
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        held = [connect(main_url) for _ in range(2)]
        assert all(served(sock) for sock in held)
        with connect(main_url) as extra:
            assert read_response(extra)[0] == 503
        with connect(other_url) as probe:
            assert served(probe), "the other port is served while the main port is full"
        others = [connect(other_url) for _ in range(2)]
        held += others
        assert all(served(sock) for sock in others)
        with connect(other_url) as extra:
            assert read_response(extra)[0] == 503
    finally:
        for sock in held:
            sock.close()
        server.should_exit = True
        thread.join(15)
        for sock in listeners:
            sock.close()


RATE = HttpLimits(body_idle_timeout_s=10, body_min_rate=100, body_rate_grace_s=TIMEOUT_S)


def test_a_body_trickled_under_the_minimum_rate_is_408_after_the_grace_period() -> None:
    """A byte every tenth of a second never trips the idle timeout (10 s), but is 10 bytes a second against a
    minimum of 100: past the grace period and a second for each 100 bytes received, 408, and the app sees a
    disconnect."""
    app = Recorder()
    with serve(RATE, app) as url, open_request(url, "POST /body HTTP/1.1\nhost: x\ncontent-length: 1000\n") as sock:
        sock.settimeout(0.1)
        sent = 0
        status = None
        while status is None and sent < 1000:
            try:
                sock.sendall(b"x")
                sent += 1
                time.sleep(0.1)
                if sock.recv(1, socket.MSG_PEEK):
                    status, headers, body = read_response(sock)
            except TimeoutError:
                continue
            except OSError:
                break
        assert status == 408
        assert headers["connection"] == "close"
        assert b"request body slower than 100 bytes a second" in body
        assert sent < 100  # ended within a few seconds, long before the body could have arrived
        assert app.disconnected.wait(5)


def test_time_the_server_holds_back_reading_does_not_count_toward_the_rate() -> None:
    """The app reads nothing for 2 grace periods: uvicorn stops reading, so the client, sending at full speed, is
    not slow."""
    with serve(RATE, Recorder(hold_s=2 * TIMEOUT_S)) as url:
        assert body_behind_a_busy_app(url) == (200, b"4194304")
