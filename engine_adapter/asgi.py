"""ASGI type aliases and the few helpers the engine's raw ASGI app needs (it does not import the gateway)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from engine_adapter.errors import TooLarge
from engine_adapter.headers import get_header

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The caller went away before its request body arrived, or while it waited for an answer."""


async def send_response(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def read_body(scope: Scope, receive: Receive, max_bytes: int, knob: str) -> bytes:
    """The whole request body, refused (413) past `max_bytes`: by Content-Length before reading, else as it
    arrives."""
    declared = get_header(scope["headers"], b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"request body of {int(declared):,} bytes is over {knob}={max_bytes:,}", reason="body_too_large")
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        body += message.get("body", b"")
        if len(body) > max_bytes:
            raise TooLarge(f"request body passed {knob}={max_bytes:,} bytes", reason="body_too_large")
        if not message.get("more_body", False):
            return bytes(body)


async def wait_for_disconnect(receive: Receive) -> None:
    # Whatever body is left unread is drained and dropped here.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(awaitable: Awaitable[T], receive: Receive) -> T:
    """Await `awaitable` unless the caller disconnects first (ClientDisconnected).

    A coroutine is cancelled on disconnect; a future is left alone, since someone else owns it.
    """
    owned = not asyncio.isfuture(awaitable)
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    if owned:
        work.cancel()
    raise ClientDisconnected


async def relay(chunks: AsyncIterator[bytes], receive: Receive, send: Send) -> bool:
    """Send `chunks` as the response body until they end (True) or the caller disconnects (False)."""

    async def pump() -> None:
        async for chunk in chunks:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    pump_task = asyncio.ensure_future(pump())
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((pump_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        pump_task.cancel()
        watcher.cancel()
        await asyncio.gather(pump_task, watcher, return_exceptions=True)
    if pump_task.cancelled():
        return False
    error = pump_task.exception()
    if error is not None:
        raise error
    return True
