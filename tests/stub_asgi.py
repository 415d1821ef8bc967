"""The ASGI plumbing every stub server in the tests needs (the stubs are edges, not code under test)."""

from __future__ import annotations

from typing import Any


async def lifespan(receive: Any, send: Any) -> None:
    """Accept start-up and shut-down."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


async def request_body(receive: Any) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


async def answer_ok(scope: Any, receive: Any, send: Any) -> None:
    """An HTTP app that answers every request 200 `ok`."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
