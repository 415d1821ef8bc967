"""Serving a raw ASGI app under uvicorn with a drain on SIGTERM, and logging set-up; both processes use it."""

from __future__ import annotations

import logging
import math
import sys
from types import FrameType
from typing import Protocol

import uvicorn

from serving.access_log import JsonFormatter, LineHandler
from serving.drain import CUT_MARGIN_S
from serving.http_limits import HttpLimits, LimitedHttpToolsProtocol, protocol_class


class Drainable(Protocol):
    def start_draining(self) -> None: ...


class DrainingServer(uvicorn.Server):
    """On SIGTERM the app is told to drain first (its readiness turns 503, new work is refused, the drain deadline
    starts); then uvicorn stops accepting and lets in-flight responses finish, which the app cuts at the deadline.

    Only the limits protocol of `uvicorn_config` is served: another `http` (h11, plain httptools) would serve
    without the connection and request-head limits, so it is refused here."""

    def __init__(self, config: uvicorn.Config, app: Drainable) -> None:
        if not (isinstance(config.http, type) and issubclass(config.http, LimitedHttpToolsProtocol)):
            raise ValueError(f"http={config.http!r} would not apply the HTTP limits; use uvicorn_config's protocol")
        super().__init__(config)
        self.drainable = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.drainable.start_draining()
        super().handle_exit(sig, frame)


def uvicorn_config(
    app: object,
    *,
    host: str,
    port: int,
    drain_timeout_s: float,
    log_level: str,
    http_limits: HttpLimits | None = None,
) -> uvicorn.Config:
    """uvicorn's settings for either process; without `http_limits` no connection or request-head limit applies."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        lifespan="on",
        # Always the httptools protocol with the limits (none by default): never h11, which would not apply them.
        http=protocol_class(http_limits or HttpLimits()),
        # Neither process serves WebSocket: an upgrade request is served as plain HTTP, under the HTTP limits,
        # instead of being handed to a websocket protocol that applies none of them.
        ws="none",
        # Relayed Server and Date headers pass through unchanged.
        server_header=False,
        date_header=False,
        access_log=False,
        # The gateway appends the peer to X-Forwarded-For itself; uvicorn must not rewrite the peer from it.
        proxy_headers=False,
        log_config=None,
        # The app cuts what is still running at the drain timeout and answers it; uvicorn waits that long more.
        timeout_graceful_shutdown=math.ceil(drain_timeout_s + CUT_MARGIN_S),
        log_level=log_level,
    )


def configure_logging(level: str, *, access_logger: str | None = None) -> None:
    """Log lines to stderr, uvicorn's as JSON lines (`serving.access_log.JsonFormatter`); the records of
    `access_logger`, when named, go to stdout as their bare message (one JSON line a request) and nowhere else."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # No format here shows the caller's file and line, its thread or its process: a record that skips finding them
    # costs a third less, and at info there is one (the access log line) for every request.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    server_log = logging.getLogger("uvicorn")
    if not any(isinstance(handler.formatter, JsonFormatter) for handler in server_log.handlers):
        json_handler = logging.StreamHandler(sys.stderr)
        json_handler.setFormatter(JsonFormatter())
        server_log.addHandler(json_handler)
    server_log.propagate = False
    if access_logger is not None:
        access = logging.getLogger(access_logger)
        access.propagate = False
        access.addHandler(LineHandler(sys.stdout))
