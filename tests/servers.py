"""Real uvicorn servers on loopback ephemeral ports, each in a thread with its own event loop."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends.

    `bind=(host, port)` picks another loopback address or a fixed port (default: 127.0.0.1, any free port).
    """

    def __init__(
        self,
        app: Any,
        config: uvicorn.Config | None = None,
        *,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        **config_kwargs: Any,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(bind)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        if config is None:
            options: dict[str, Any] = {"lifespan": "on", "log_level": "warning", "access_log": False}
            options.update(config_kwargs)
            config = uvicorn.Config(app, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
