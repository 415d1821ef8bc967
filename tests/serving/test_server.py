"""`serving.server.uvicorn_config`: what both processes' uvicorn serves, through a real server on loopback."""

from __future__ import annotations

import socket
from typing import Any

from serving.http_limits import HttpLimits
from serving.server import uvicorn_config
from tests.gateway.rawhttp import read_response
from tests.servers import ServerThread
from tests.stub_asgi import lifespan

UPGRADE = (
    b"GET /chat HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
    b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)


class Scopes:
    """Answers every HTTP request 200 and keeps the type of each scope it was called with."""

    def __init__(self) -> None:
        self.types: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.types.append(scope["type"])
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_a_websocket_upgrade_is_served_as_plain_http_under_the_http_limits() -> None:
    # Neither process speaks WebSocket: an upgrade handed to a websocket protocol would leave the HTTP limits
    # (header count, timeouts) behind. The request reaches the app as HTTP and is answered without a 101.
    app = Scopes()
    config = uvicorn_config(
        app, host="127.0.0.1", port=0, drain_timeout_s=1, log_level="warning", http_limits=HttpLimits(max_headers=5)
    )
    with ServerThread(app, config=config) as server:
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(UPGRADE)
            status, _, body = read_response(sock)
        assert (status, body) == (200, b"ok")
        assert app.types == ["http"]
        # The HTTP limits apply to an upgrade request as to any other: a sixth header is a 431.
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(UPGRADE.replace(b"\r\n\r\n", b"\r\nx-sixth: 1\r\n\r\n"))
            status, _, _ = read_response(sock)
        assert status == 431
