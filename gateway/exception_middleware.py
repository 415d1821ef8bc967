"""The one place a `GatewayError` (or a gateway bug) becomes a response in the route's envelope."""

from __future__ import annotations

import logging
from typing import ClassVar

from gateway.envelopes import Dialect, client_message, error_body
from gateway.errors import DrainCut, GatewayError, InternalError
from gateway.request_info import request_info
from serving.asgi import ASGIApp, Scope
from serving.drain import Drain
from serving.errors import ErrorBoundary, ServingError

logger = logging.getLogger(__name__)


class ExceptionMiddleware(ErrorBoundary[GatewayError]):
    """Errors are answered in the route's dialect and recorded in the request's `RequestInfo` for the access log
    (the full message, always) and `mmgate_rejections_total`. Without `expose_internal` a failure of something
    behind the gateway is answered with `client_message`: the messages raised for them name internal addresses."""

    handles: ClassVar[type[ServingError]] = GatewayError

    def __init__(self, app: ASGIApp, *, expose_internal: bool = False, drain: Drain | None = None) -> None:
        super().__init__(app, logger, drain=drain)
        self.expose_internal = expose_internal

    def render(self, scope: Scope, error: GatewayError) -> bytes:
        info = request_info(scope)
        message = None if self.expose_internal else client_message(error, info.request_id)
        return error_body(error, info.dialect, message=message)

    def drain_cut(self, scope: Scope) -> GatewayError:
        timeout = self.drain.timeout_s if self.drain is not None else 0.0
        return DrainCut(f"the gateway shut down before the request finished (server.drain_timeout_s={timeout:g})")

    def stream_error(self, scope: Scope, error: GatewayError) -> bytes:
        # Anthropic's streams name their events; an OpenAI stream's error is a bare data event.
        event = b"event: error\n" if request_info(scope).dialect is Dialect.ANTHROPIC else b""
        return event + super().stream_error(scope, error)

    def internal_error(self, scope: Scope) -> GatewayError:
        return InternalError(f"internal gateway error (request id {request_info(scope).request_id})")

    def describe(self, scope: Scope) -> str:
        return f"request {request_info(scope).request_id}"

    def observe(self, scope: Scope, error: GatewayError) -> None:
        info = request_info(scope)
        info.rejection = error.reason
        info.error = error.message

    def client_left(self, scope: Scope) -> None:
        request_info(scope).client_disconnected = True
