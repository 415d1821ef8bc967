"""One JSON access-log line per request, for both processes: the fields every line has, and `RequestLog`, the ASGI
wrapper that logs them for an app that keeps no log of its own (the engine)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

from serving.asgi import ASGIApp, Exchange, Receive, Scope, Send
from serving.headers import get_header

ACCESS_LOGGER = "mmgate.access"
# What a request that ended without a response is logged with: nginx's "client closed request".
CLIENT_CLOSED = 499


def timestamp(epoch_s: float) -> str:
    """ISO 8601 in UTC with milliseconds: `2025-06-01T12:00:00.123Z`."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").removesuffix("+00:00") + "Z"


def round_to_microsecond(seconds: float) -> float:
    """A duration as a log line writes it."""
    return round(seconds, 6)


def request_id(scope: Scope) -> str:
    """The caller's `X-Request-ID` when it is short printable ASCII, else a new one."""
    given = get_header(scope["headers"], b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.decode().isprintable():
        return given.decode()
    return uuid.uuid4().hex


class EndedRequest:
    """What an access-log line tells of a request that has ended, taken from its scope and `Exchange` as it ends.
    A line made later keeps only this: the scope and the exchange, and everything they hold, are freed with the
    request rather than counted by the garbage collector as live objects until the line is made."""

    __slots__ = ("body_bytes", "client", "duration_s", "method", "path", "response_bytes", "status", "user_agent")

    def __init__(self, scope: Scope, exchange: Exchange, duration_s: float) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.client: tuple[str, int] | None = scope.get("client")
        self.user_agent = get_header(scope["headers"], b"user-agent")
        # 499 without a response.
        self.status = CLIENT_CLOSED if exchange.status is None else exchange.status
        self.body_bytes = exchange.body_bytes
        self.response_bytes = exchange.response_bytes
        self.duration_s = duration_s


def request_fields(ended: EndedRequest, *, started_epoch_s: float, request_id: str) -> dict[str, Any]:
    """The fields that open every access-log line: when the request came, from where, with what."""
    client, agent = ended.client, ended.user_agent
    return {
        "ts": timestamp(started_epoch_s),
        "request_id": request_id,
        "client": None if not client else f"{client[0]}:{client[1]}",
        "method": ended.method,
        "path": ended.path,
        "user_agent": None if agent is None else agent.decode("latin-1"),
    }


def exchange_fields(ended: EndedRequest) -> dict[str, Any]:
    """The fields that close every access-log line: status, bytes, duration."""
    return {
        "status": ended.status,
        "body_bytes": ended.body_bytes,
        "response_bytes": ended.response_bytes,
        "duration_s": round_to_microsecond(ended.duration_s),
    }


class RequestLog:
    """ASGI middleware: one JSON line per HTTP request on `logger` with the request's fields, status, body and
    response bytes and duration. Requests to `skip_paths` are not logged; other scope types pass through."""

    def __init__(self, app: ASGIApp, *, logger: logging.Logger | None = None, skip_paths: Collection[str] = ()) -> None:
        self.app = app
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        self.skip_paths = frozenset(skip_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        started_epoch_s = time.time()
        started = time.perf_counter()
        exchange = Exchange(scope, receive, send)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            exchange.forget(scope)
            if self.logger.isEnabledFor(logging.INFO):
                ended = EndedRequest(scope, exchange, time.perf_counter() - started)
                record = request_fields(ended, started_epoch_s=started_epoch_s, request_id=request_id(scope))
                record |= exchange_fields(ended)
                log_line(self.logger, orjson.dumps(record).decode())


class LineHandler(logging.StreamHandler[TextIO]):
    """Each record's message as one line, nothing added. Lines logged on an event loop's thread are written together
    at the end of the loop's turn, so the requests that end in one turn cost one write (the stream may be unbuffered,
    as under `PYTHONUNBUFFERED`); elsewhere each is written and flushed at once."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._lines: list[str] = []  # logged in this loop turn, not yet written

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(record.getMessage())
        except Exception:
            self.handleError(record)

    def write_line(self, message: str) -> None:
        """What `emit` writes for a record whose message is `message`."""
        line = message + "\n"
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.stream.write(line)
            super().flush()
            return
        if not self._lines:
            loop.call_soon(self._write_turn)
        self._lines.append(line)

    def flush(self) -> None:
        """Write the lines held for this turn, and flush the stream."""
        with self.lock:  # type: ignore[union-attr]
            lines, self._lines = self._lines, []
            if lines:
                self.stream.write("".join(lines))
            super().flush()

    def _write_turn(self) -> None:
        try:
            self.flush()
        except Exception:
            self.handleError(logging.makeLogRecord({"name": ACCESS_LOGGER, "msg": "access log lines lost"}))


def log_line(logger: logging.Logger, line: str) -> None:
    """`logger.info(line)`, for a logger enabled at info. Where nothing but one `LineHandler` would see the record (the
    access logger as `serving.server.configure_logging` sets it up), the line goes to the handler without a record
    being made: the same line, at a fraction of the cost, and there is one a request."""
    handlers = logger.handlers
    if len(handlers) == 1 and not logger.propagate and not logger.filters and not logger.disabled:
        handler = handlers[0]
        if type(handler) is LineHandler and not handler.filters and handler.level <= logging.INFO:
            with handler.lock:  # type: ignore[union-attr]
                try:
                    handler.write_line(line)
                except Exception:
                    handler.handleError(logging.makeLogRecord({"name": logger.name, "msg": line}))
            return
    logger.info(line)
