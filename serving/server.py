"""Serving a raw ASGI app under uvicorn with a drain on SIGTERM, and logging set-up; both processes use it."""

from __future__ import annotations

import logging
import math
import sys
import threading
from types import FrameType, TracebackType
from typing import Protocol

import uvicorn

from serving.access_log import LineHandler
from serving.drain import CUT_MARGIN_S
from serving.http_limits import HttpLimits, LimitedHttpToolsProtocol, protocol_class
from serving.log_format import LogFormat, formatter

logger = logging.getLogger("mmgate")


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


# Marks the handlers `configure_logging` installs: another call replaces them instead of adding more.
_INSTALLED = "mmgate_installed"


def configure_logging(level: str, *, log_format: LogFormat = LogFormat.JSON, access_logger: str | None = None) -> None:
    """Every log line on stderr in `log_format` (`serving.log_format`): the processes' own loggers, uvicorn's,
    Python warnings and uncaught exceptions. The records of `access_logger`, when named, go to stdout as their bare
    message (one JSON line a request) and nowhere else."""
    root = logging.getLogger()
    _install(root, logging.StreamHandler(sys.stderr), formatter(log_format))
    root.setLevel(level.upper())
    # No format here shows the caller's file and line, its thread or its process: a record that skips finding them
    # costs a third less, and at info there is one (the access log line) for every request.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # uvicorn's lines go through the root handler like every other (uvicorn is given no log config of its own).
    for name in ("uvicorn", "uvicorn.error"):
        served = logging.getLogger(name)
        served.handlers.clear()
        served.propagate = True
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    if access_logger is not None:
        access = logging.getLogger(access_logger)
        access.propagate = False
        _install(access, LineHandler(sys.stdout), None)


def _install(logger: logging.Logger, handler: logging.Handler, line_format: logging.Formatter | None) -> None:
    for installed in [each for each in logger.handlers if getattr(each, _INSTALLED, False)]:
        logger.removeHandler(installed)
    if line_format is not None:
        handler.setFormatter(line_format)
    setattr(handler, _INSTALLED, True)
    logger.addHandler(handler)


def _log_uncaught(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, trace)
        return
    logger.critical("uncaught exception: %s", error or kind.__name__, exc_info=(kind, error, trace))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    error = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else "unknown"
    trace = (args.exc_type, error, args.exc_traceback)
    logger.error("uncaught exception in thread %s: %s", name, error, exc_info=trace)
