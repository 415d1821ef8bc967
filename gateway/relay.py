"""Work that must stop when the client goes away: waiting, loading, and streaming a response to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from gateway.asgi import ClientDisconnected, Receive, Send

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    # Any request body left unread (an upstream that answered early) is drained and dropped here.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Run `work` unless the client disconnects first; then cancel it and raise `ClientDisconnected`.

    Call only once the request body has been read: this listens on `receive`.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def relay_body(chunks: AsyncIterator[bytes], receive: Receive, send: Send) -> bool:
    """Send each chunk as it arrives, then end the body. False when the client left first (the stream is then
    abandoned mid-way); errors raised by `chunks` propagate."""

    async def pump() -> None:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    try:
        await until_disconnect(pump(), receive)
    except ClientDisconnected:
        return False
    return True
