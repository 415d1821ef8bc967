"""Raw-body cap: a pure ASGI middleware that refuses an over-cap body before anything parses it."""

from __future__ import annotations

from gateway.errors import BadRequest, RequestTooLarge
from gateway.request_info import request_info
from serving.asgi import ASGIApp, BodyCap, Message, Receive, Scope, Send

_CLOSE = {"connection": "close"}


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
        self.cap = (
            None if max_bytes is None else BodyCap(max_bytes, "limits.max_request_body_bytes", _too_large, _malformed)
        )
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cap = self.cap
        if cap is None or scope["method"] != "POST" or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        cap.check_declared(scope)
        info = request_info(scope)

        async def capped_receive() -> Message:
            message = await receive()
            if info.body_bytes > cap.max_bytes:
                raise cap.passed(info.body_bytes)
            return message

        await self.app(scope, capped_receive, send)
