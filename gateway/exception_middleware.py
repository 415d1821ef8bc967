"""The one place a `GatewayError` (or a gateway bug) becomes a response in the route's envelope."""

from __future__ import annotations

import logging
from typing import ClassVar

from gateway.envelopes import error_body
from gateway.errors import GatewayError, InternalError
from gateway.request_info import request_info
from serving.asgi import ASGIApp, Scope
from serving.errors import ErrorBoundary, ServingError

logger = logging.getLogger(__name__)


class ExceptionMiddleware(ErrorBoundary[GatewayError]):
    """Errors are answered in the route's dialect and recorded in the request's `RequestInfo` for the access log
    and `mmgate_rejections_total`."""

    handles: ClassVar[type[ServingError]] = GatewayError

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, logger)

    def render(self, scope: Scope, error: GatewayError) -> bytes:
        return error_body(error, request_info(scope).dialect)

    def internal_error(self, scope: Scope) -> GatewayError:
        return InternalError(f"internal gateway error (request id {request_info(scope).request_id})")

    def describe(self, scope: Scope) -> str:
        return f"request {request_info(scope).request_id}"

    def observe(self, scope: Scope, error: GatewayError) -> None:
        request_info(scope).rejection = error.reason

    def client_left(self, scope: Scope) -> None:
        request_info(scope).client_disconnected = True
