"""Raw-body caps: a pure ASGI middleware that refuses an over-cap body before anything parses or forwards it."""

from __future__ import annotations

from gateway.errors import BadRequest, RequestTooLarge
from gateway.request_info import request_info
from serving.asgi import ASGIApp, BodyCap, Message, Receive, Scope, Send
from serving.headers import get_header

_CLOSE = {"connection": "close"}
ADMISSION_KNOB = "limits.max_request_body_bytes"
OTHER_KNOB = "limits.max_other_body_bytes"


def _too_large(message: str) -> RequestTooLarge:
    return RequestTooLarge(message, reason="body_too_large", headers=_CLOSE)


def _malformed(message: str) -> BadRequest:
    return BadRequest(message, headers=_CLOSE)


def _cap(max_bytes: int | None, knob: str) -> BodyCap | None:
    return None if max_bytes is None else BodyCap(max_bytes, knob, _too_large, _malformed)


class RawBodyLimit:
    """`Content-Length` over the cap: 413 without reading a byte (within it, the server delivers no more than it
    declares). Chunked: 413 as soon as the count passes it.

    An admission request (`RequestInfo.admission`) is capped at `max_bytes`; every other request at
    `other_max_bytes`. Those others are forwarded as their body arrives: once the count passes, the app reads a
    client disconnect, so the upstream request is aborted as for a client that left, and the 413 is raised in
    place of what the app raises about it.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int | None,
        other_max_bytes: int | None = None,
        knob: str = ADMISSION_KNOB,
    ) -> None:
        """`knob`: the setting `max_bytes` comes from (the bound on buffered bodies, where it is the lower)."""
        self.app = app
        self.cap = _cap(max_bytes, knob)
        self.other_cap = _cap(other_max_bytes, OTHER_KNOB)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = request_info(scope).admission
        cap = self.cap if admission else self.other_cap
        if cap is None:
            await self.app(scope, receive, send)
            return
        if cap.check_declared(scope) is not None and get_header(scope["headers"], b"transfer-encoding") is None:
            # The server hands the app exactly the Content-Length it declared, which is within the cap.
            await self.app(scope, receive, send)
            return
        passed: Exception | None = None
        count = 0

        async def capped_receive() -> Message:
            nonlocal passed, count
            if passed is not None:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                count += len(message.get("body", b""))
            if count > cap.max_bytes:
                error = cap.passed(count)
                if admission:
                    raise error
                passed = error
                return {"type": "http.disconnect"}
            return message

        if admission:
            # Passing the cap raises from `receive`: nothing is forwarded before the whole body is counted.
            await self.app(scope, capped_receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, watched_send)
        except Exception:
            if passed is not None and not started:
                raise passed from None
            raise
        if passed is not None and not started:
            raise passed
