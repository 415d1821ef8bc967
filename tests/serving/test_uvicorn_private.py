"""`serving.uvicorn_private`: what the HTTP limits take of uvicorn's internals, against uvicorn's own httptools
protocol in a real server on loopback (`make newest-deps` runs it on the newest uvicorn)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from serving.uvicorn_private import HttpToolsProtocol, disconnected, end_request, stop_keep_alive, upgrades
from tests.gateway.rawhttp import open_request, read_response
from tests.servers import ServerThread
from tests.stub_asgi import lifespan

# Long enough that the test's call lands well before it passes, even on a loaded machine.
KEEP_ALIVE_S = 3


class App:
    """`GET` answers at once; `POST` reads its body and answers its length, or 499 when `receive()` returned
    `http.disconnect`. `started` is set when a POST waits for its body; `loop` is the server's event loop."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Event()
        self.received: list[str] = []
        self.finished = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.loop = asyncio.get_running_loop()
        status, body = 200, b""
        if scope["method"] == "POST":
            self.started.set()
            message = await receive()
            self.received.append(message["type"])
            if message["type"] == "http.disconnect":
                status = 499
            body = str(len(message.get("body", b""))).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-length", b"%d" % len(body))]}
        )
        await send({"type": "http.response.body", "body": body})
        self.finished.set()


def served(app: App) -> ServerThread:
    """uvicorn's plain httptools protocol, without the HTTP limits."""
    return ServerThread(app, http="httptools", ws="none", timeout_keep_alive=KEEP_ALIVE_S)


def protocols(server: ServerThread) -> list[HttpToolsProtocol]:
    return [p for p in server.server.server_state.connections if isinstance(p, HttpToolsProtocol)]


def on_loop(app: App, call: Callable[[], Any]) -> Any:
    """`call()` run on the server's event loop, and what it returned."""
    assert app.loop is not None

    async def run() -> Any:
        return call()

    return asyncio.run_coroutine_threadsafe(run(), app.loop).result(timeout=10)


def test_end_request_makes_the_pending_receive_return_disconnect() -> None:
    app = App()
    with served(app) as server:
        sock = open_request(server.url, "POST /wait HTTP/1.1\nhost: x\ncontent-length: 10\n")
        try:
            assert app.started.wait(10)
            (protocol,) = protocols(server)
            assert not on_loop(app, lambda: disconnected(protocol.cycle))
            on_loop(app, lambda: end_request(protocol.cycle))
            assert app.finished.wait(10)
            assert app.received == ["http.disconnect"]
            assert on_loop(app, lambda: disconnected(protocol.cycle))
        finally:
            sock.close()


def test_an_upgrade_is_not_handed_over_without_a_websocket_protocol() -> None:
    app = App()
    with served(app) as server:
        head = "POST /up HTTP/1.1\nhost: x\nconnection: upgrade\nupgrade: websocket\ncontent-length: 10\n"
        sock = open_request(server.url, head)
        try:
            assert app.started.wait(10)
            (protocol,) = protocols(server)
            assert on_loop(app, lambda: upgrades(protocol)) is False
        finally:
            sock.close()


@pytest.mark.slow
def test_stop_keep_alive_keeps_an_idle_connection_past_the_keep_alive_timeout() -> None:
    app = App()
    with served(app) as server:
        kept = open_request(server.url, "GET / HTTP/1.1\nhost: x\n")
        idle = open_request(server.url, "GET / HTTP/1.1\nhost: x\n")
        try:
            assert read_response(kept)[0] == 200
            assert read_response(idle)[0] == 200
            port = kept.getsockname()[1]
            (protocol,) = [p for p in protocols(server) if p.client is not None and p.client[1] == port]

            def stop() -> bool:
                open_still = not protocol.transport.is_closing()
                stop_keep_alive(protocol)
                return open_still

            assert on_loop(app, stop), "the keep-alive timeout passed before the test's call"
            # uvicorn closes the idle connection its timeout is left to; the other stays open.
            idle.settimeout(10 + KEEP_ALIVE_S)
            assert idle.recv(1) == b""
            time.sleep(0.5)
            kept.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert read_response(kept)[0] == 200
        finally:
            kept.close()
            idle.close()
