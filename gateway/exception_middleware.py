"""The one place a `GatewayError` (or a gateway bug) becomes a response in the route's envelope."""

from __future__ import annotations

import logging

from gateway.envelopes import error_body, error_headers
from gateway.errors import GatewayError, InternalError
from gateway.request_info import RequestInfo, request_info
from serving.asgi import ASGIApp, ClientDisconnected, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class ExceptionMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        info = request_info(scope)
        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnected:
            info.client_disconnected = True
        except GatewayError as error:
            info.rejection = error.reason
            if started:
                # Headers are out: the only honest signal left is an aborted connection.
                logger.warning("request %s failed mid-response: %s", info.request_id, error.message)
                raise
            await _send_error(send, error, info)
        except Exception:
            logger.exception("request %s: gateway bug", info.request_id)
            info.rejection = "internal"
            if started:
                raise
            await _send_error(send, InternalError(f"internal gateway error (request id {info.request_id})"), info)


async def _send_error(send: Send, error: GatewayError, info: RequestInfo) -> None:
    body = error_body(error, info.dialect)
    await send({"type": "http.response.start", "status": error.status_code, "headers": error_headers(error, body)})
    await send({"type": "http.response.body", "body": body})
