"""Raw-body cap: a pure ASGI middleware that refuses an over-cap body before anything parses it."""

from __future__ import annotations

from gateway.errors import BadRequest, RequestTooLarge
from gateway.request_info import request_info
from serving.asgi import ASGIApp, Message, Receive, Scope, Send
from serving.headers import get_header

_CLOSE = {"connection": "close"}


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
        declared = get_header(scope["headers"], b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise BadRequest(
                    f"invalid Content-Length header {declared.decode('latin-1')!r}", headers=_CLOSE
                ) from None
            if length > max_bytes:
                raise RequestTooLarge(
                    f"request body is {length:,} bytes (Content-Length), over "
                    f"limits.max_request_body_bytes={max_bytes:,}",
                    reason="body_too_large",
                    headers=_CLOSE,
                )
        info = request_info(scope)

        async def capped_receive() -> Message:
            message = await receive()
            if info.body_bytes > max_bytes:
                raise RequestTooLarge(
                    f"request body passed limits.max_request_body_bytes={max_bytes:,} at {info.body_bytes:,} bytes",
                    reason="body_too_large",
                    headers=_CLOSE,
                )
            return message

        await self.app(scope, capped_receive, send)
