"""The error base both processes' exception trees subclass, and the one boundary where an error raised while
serving a request becomes a response (each process renders its own error body)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

from serving.asgi import ASGIApp, ClientDisconnected, Message, Receive, Scope, Send, send_response
from serving.headers import RawHeaders


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
    (`ClientDisconnected`) gets no answer."""

    handles: ClassVar[type[ServingError]]
    # Headers every error response of this process carries, before the error's own.
    error_headers: ClassVar[RawHeaders] = []

    def __init__(self, app: ASGIApp, logger: logging.Logger) -> None:
        self.app = app
        self.logger = logger

    @abstractmethod
    def render(self, scope: Scope, error: ErrorT) -> bytes:
        """The error's JSON body in this process's envelope."""

    @abstractmethod
    def internal_error(self, scope: Scope) -> ErrorT:
        """The error a bug is answered with."""

    def describe(self, scope: Scope) -> str:
        """How log lines name the request."""
        return f"{scope['method']} {scope['path']}"

    def observe(self, scope: Scope, error: ErrorT) -> None:
        """Called with every error the request ends with, answered or not."""

    def client_left(self, scope: Scope) -> None:
        """Called when the client went away before its answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnected:
            self.client_left(scope)
        except self.handles as caught:
            error: ErrorT = caught  # type: ignore[assignment]  # `handles` is ErrorT's class
            self.observe(scope, error)
            if started:
                self.logger.warning("%s failed mid-response: %s", self.describe(scope), error.message)
                raise
            await self._answer(scope, send, error)
        except Exception:
            self.logger.exception("%s: unexpected error (a bug)", self.describe(scope))
            internal = self.internal_error(scope)
            self.observe(scope, internal)
            if started:
                raise
            await self._answer(scope, send, internal)

    async def _answer(self, scope: Scope, send: Send, error: ErrorT) -> None:
        headers = [*self.error_headers, *error.raw_headers()]
        await send_response(send, error.status_code, self.render(scope, error), headers=headers)
