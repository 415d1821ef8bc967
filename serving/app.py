"""The outer shape of both processes' ASGI apps: HTTP to the process's handler, the lifespan protocol to its
start-up and shut-down, websockets refused; `start_draining` is what `DrainingServer` calls on SIGTERM."""

from __future__ import annotations

from abc import ABC, abstractmethod

from serving.asgi import ASGIApp, Receive, Scope, Send, serve_lifespan


class ServedApp(ABC):
    http: ASGIApp
    """What serves one HTTP request: the outermost of the process's middleware (awaited directly, not through a
    method of the app, as it is the path of every request)."""

    @abstractmethod
    async def startup(self) -> None:
        """Before the first request; an exception fails the start and the server exits."""

    @abstractmethod
    async def shutdown(self) -> None:
        """After the last response."""

    @abstractmethod
    def start_draining(self) -> None:
        """From now on the process takes no new work; in-flight responses go on."""

    async def handle_lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The lifespan protocol, around `startup` and `shutdown`."""
        await serve_lifespan(receive, send, self.startup, self.shutdown)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.http(scope, receive, send)
        elif kind == "lifespan":
            await self.handle_lifespan(scope, receive, send)
        else:  # websocket: neither process speaks it
            await receive()
            await send({"type": "websocket.close", "code": 1003})
