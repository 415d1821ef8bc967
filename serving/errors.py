"""The error base both processes' exception trees subclass, and the one boundary where an error raised while
serving a request becomes a response (each process renders its own error body)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar, cast

from serving.asgi import ASGIApp, ClientDisconnected, Exchange, Receive, Scope, Send, exchange_of, send_response
from serving.drain import Drain, DrainBound
from serving.headers import RawHeaders


def drop_tracebacks(error: BaseException) -> None:
    """Drop the tracebacks of `error` and of every error it chains, once it is answered.

    A traceback holds the frames an error passed through, and they hold the request: its body, parsed document,
    media, scope. An error kept by one of those frames (a failed future or task, an error wrapped in another) or
    by a third party's own reference cycle (a stream reader keeps the error it ended with) would hold all of it
    until the cyclic collector ran; without the tracebacks, reference counting frees it when the request ends.
    An error raised on from here gets a new traceback from the frames it still passes."""
    pending = [error]
    seen: set[int] = set()
    while pending:
        each = pending.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        each.__traceback__ = None
        pending.extend(chained for chained in (each.__cause__, each.__context__) if chained is not None)
        if isinstance(each, BaseExceptionGroup):
            pending.extend(each.exceptions)


class ServingError(Exception):
    """A refusal or failure the caller is told about: an HTTP status, a short stable `reason` label (metrics,
    logs) and headers the error response carries (Retry-After, WWW-Authenticate, Connection)."""

    status_code: int = 500
    default_reason: str = "internal"

    def __init__(self, message: str, *, reason: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.headers: dict[str, str] = dict(headers or {})

    def raw_headers(self) -> RawHeaders:
        return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]


ErrorT = TypeVar("ErrorT", bound=ServingError)


class ErrorBoundary(ABC, Generic[ErrorT]):
    """ASGI middleware: an `ErrorT` raised by the app is answered with `render`'s body, any other exception is
    logged as a bug and answered with `internal_error`'s. Once the response has started, the headers are out and
    the only honest signal left is an aborted connection: the error is logged and re-raised. A client that left
    (`ClientDisconnected`) gets no answer.

    With a `drain`, a request still running at the drain deadline is cut and answered with `drain_cut`'s error:
    in full before its response started, as a terminal `stream_error` event in an event stream, and otherwise by
    closing the connection; a shutdown logs no traceback."""

    handles: ClassVar[type[ServingError]]
    # Headers every error response of this process carries, before the error's own.
    error_headers: ClassVar[RawHeaders] = []

    def __init__(self, app: ASGIApp, logger: logging.Logger, *, drain: Drain | None = None) -> None:
        self.app = app
        self.logger = logger
        self.drain = drain

    @abstractmethod
    def render(self, scope: Scope, error: ErrorT) -> bytes:
        """The error's JSON body in this process's envelope."""

    @abstractmethod
    def internal_error(self, scope: Scope) -> ErrorT:
        """The error a bug is answered with."""

    @abstractmethod
    def drain_cut(self, scope: Scope) -> ErrorT:
        """The error a request cut by the drain deadline is answered with."""

    def stream_error(self, scope: Scope, error: ErrorT) -> bytes:
        """The server-sent event that ends an event stream with `error`."""
        return b"data: " + self.render(scope, error) + b"\n\n"

    def describe(self, scope: Scope) -> str:
        """How log lines name the request."""
        return f"{scope['method']} {scope['path']}"

    def observe(self, scope: Scope, error: ErrorT) -> None:
        """Called with every error the request ends with, answered or not."""

    def client_left(self, scope: Scope) -> None:
        """Called when the client went away before its answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # What of the response has gone out: from the exchange a layer outside follows, else followed here.
        response = exchange_of(scope)
        owned = response is None
        if response is None:
            response = Exchange(scope, receive, send)
            send = response.send
        bound = self.drain.bound() if self.drain is not None else None
        try:
            await self.app(scope, receive, send)
        except BaseException as caught:
            try:
                await self._handle(scope, send, response, caught, bound)
            finally:
                drop_tracebacks(caught)
        else:
            if bound is not None:
                bound.leave(None)
        finally:
            if owned:
                response.forget(scope)

    async def _handle(
        self, scope: Scope, send: Send, response: Exchange, caught: BaseException, bound: DrainBound | None
    ) -> None:
        """Answer `caught`, or raise it on (`raise caught`)."""
        # The drain's own cancellation is taken back here; what the handler raised once cut counts as the cut.
        drained = bound is not None and bound.leave(caught)
        if isinstance(caught, ClientDisconnected):
            self.client_left(scope)
        elif drained or (bound is not None and bound.cut and isinstance(caught, Exception)):
            await self._cut(scope, send, response)
        elif not isinstance(caught, Exception):
            raise caught
        elif isinstance(caught, self.handles):
            error = cast(ErrorT, caught)  # `handles` is ErrorT's class
            self.observe(scope, error)
            if response.started:
                self.logger.warning("%s failed mid-response: %s", self.describe(scope), error.message)
                raise caught
            await self._answer(scope, send, error)
        else:
            self.logger.error("%s: unexpected error (a bug)", self.describe(scope), exc_info=caught)
            internal = self.internal_error(scope)
            self.observe(scope, internal)
            if response.started:
                raise caught
            await self._answer(scope, send, internal)

    async def _answer(self, scope: Scope, send: Send, error: ErrorT) -> None:
        headers = [*self.error_headers, *error.raw_headers()]
        await send_response(send, error.status_code, self.render(scope, error), headers=headers)

    async def _cut(self, scope: Scope, send: Send, response: Exchange) -> None:
        error = self.drain_cut(scope)
        self.observe(scope, error)
        if not response.started:
            await self._answer(scope, send, error)
        elif response.complete:
            pass
        elif response.event_stream:
            self.logger.warning("%s: cut by the drain mid-stream, ended with an error event", self.describe(scope))
            await send({"type": "http.response.body", "body": self.stream_error(scope, error), "more_body": False})
        else:
            # Returning with the body incomplete makes the server close the connection: the client sees a
            # truncated response, never one that looks whole.
            self.logger.warning("%s: cut by the drain mid-response, connection closed", self.describe(scope))
