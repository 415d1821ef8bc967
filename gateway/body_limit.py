"""Raw-body cap: a pure ASGI middleware that refuses an over-cap body before anything parses it."""

from __future__ import annotations

from gateway.errors import BadRequest, RequestTooLarge
from gateway.request_info import request_info
from serving.asgi import ASGIApp, Message, Receive, Scope, Send, check_declared_length, passed_cap

_CLOSE = {"connection": "close"}
_KNOB = "limits.max_request_body_bytes"


def _too_large(message: str) -> RequestTooLarge:
    return RequestTooLarge(message, reason="body_too_large", headers=_CLOSE)


def _malformed(message: str) -> BadRequest:
    return BadRequest(message, headers=_CLOSE)


class RawBodyLimit:
    """`Content-Length` over the cap: 413 without reading a byte. Chunked: 413 as soon as the count passes it.

    `AccessLog` keeps the byte count in the request's `RequestInfo`, where media accounting reads it.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int | None, routes: tuple[str, ...]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        max_bytes = self.max_bytes
        if max_bytes is None or scope["method"] != "POST" or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        check_declared_length(scope, max_bytes, _KNOB, too_large=_too_large, malformed=_malformed)
        info = request_info(scope)

        async def capped_receive() -> Message:
            message = await receive()
            if info.body_bytes > max_bytes:
                raise _too_large(passed_cap(_KNOB, max_bytes, info.body_bytes))
            return message

        await self.app(scope, capped_receive, send)
