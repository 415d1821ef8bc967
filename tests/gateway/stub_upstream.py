"""A stub upstream model server for the gateway tests: records what reached it and answers on cue."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tests.stub_asgi import lifespan, request_body


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StubState:
    requests: list[Seen] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    sse_release: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)
    disconnected_at: float | None = None
    hold_s: float = 0.0
    # Seconds to wait, once the body is in, before the response headers; the wait ends early (and nothing is
    # answered) when the client's connection closes. `stalling` is set when such a wait begins.
    stall_headers_s: float = 0.0
    stalling: threading.Event = field(default_factory=threading.Event)
    # Set when a request's headers reach the stub, before its body is read.
    arrived: threading.Event = field(default_factory=threading.Event)
    # While `gated`, every request whose body is in waits, before anything else, until `open_gate()` lets it
    # through: each call lets one more request pass, in the order they reached the gate. A request whose client
    # leaves while it waits is recorded as a disconnect and answered nothing.
    gated: bool = False
    at_gate: int = 0  # requests that reached the gate
    gate_passes: int = 0  # how many of them may pass
    # What `GET /v1/models` answers, as vLLM does: `{"object": "list", "data": [...]}`; None echoes it like any path.
    models: list[dict[str, Any]] | None = None

    def open_gate(self, count: int = 1) -> None:
        with self.lock:
            self.gate_passes += count

    def paths(self) -> list[str]:
        with self.lock:
            return [seen.path for seen in self.requests]


class StubUpstream:
    """Routes: `/status/<code>`, `/sse`, `/slow-headers`, `/stall-body`, `/set-cookie`, `/big`, `/health`,
    `/v1/models` (with `state.models` set);
    anything else echoes what it received as JSON (and SSE when the JSON body says `"stream": true`).

    A client that leaves before its body arrived in full, or while the stub waits, is recorded in
    `state.disconnected` and `state.disconnected_at`."""

    def __init__(self) -> None:
        self.state = StubState()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.state.arrived.set()
        body = await request_body(receive)
        if body is None:
            self._record_disconnect()
            return
        seen = Seen(
            method=scope["method"],
            path=scope["path"],
            query=scope["query_string"].decode(),
            headers={k.decode(): v.decode() for k, v in scope["headers"]},
            body=bytes(body),
        )
        state = self.state
        with state.lock:
            state.requests.append(seen)
            state.active += 1
            state.max_active = max(state.max_active, state.active)
        try:
            if state.gated:
                with state.lock:
                    place = state.at_gate
                    state.at_gate += 1
                await self._wait_disconnect_or(receive, 60.0, until=lambda: place < state.gate_passes)
                if place >= state.gate_passes:
                    return
            if state.hold_s:
                await asyncio.sleep(state.hold_s)
            if state.stall_headers_s:
                state.stalling.set()
                await self._wait_disconnect_or(receive, state.stall_headers_s)
                if state.disconnected.is_set():
                    return
            await self._answer(seen, receive, send)
        finally:
            with state.lock:
                state.active -= 1

    async def _answer(self, seen: Seen, receive: Any, send: Any) -> None:
        path = seen.path
        if path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            await _send(send, code, b'{"detail":"stub says %d"}' % code, [(b"x-stub", b"yes")])
        elif path == "/health":
            await _send(send, 200, b"{}")
        elif path == "/v1/models" and self.state.models is not None:
            await _send(send, 200, orjson.dumps({"object": "list", "data": self.state.models}))
        elif path == "/slow-headers":
            await asyncio.sleep(float(seen.query.split("=")[1]) if seen.query else 5.0)
            await _send(send, 200, b"late")
        elif path == "/stall-body":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await self._wait_disconnect_or(receive, 30.0)
        elif path == "/set-cookie":
            await _send(send, 200, b"{}", [(b"set-cookie", b"session=secret; Path=/")])
        elif path == "/big":
            size = int(seen.query.split("=")[1])
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream")],
                }
            )
            sent = 0
            block = bytes(range(256)) * 256
            while sent < size:
                chunk = block[: min(len(block), size - sent)]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
            await send({"type": "http.response.body", "body": b""})
        elif path == "/sse" or (seen.body[:1] == b"{" and orjson.loads(seen.body).get("stream") is True):
            await self._sse(receive, send)
        else:
            await _send(send, 200, _echo(seen), [(b"x-upstream-header", b"kept")])

    async def _sse(self, receive: Any, send: Any) -> None:
        """One event at once, then hold the stream open until the test releases it (or the client leaves)."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True})
        released = await self._wait_disconnect_or(receive, 30.0, release=self.state.sse_release)
        if released:
            await send({"type": "http.response.body", "body": b'data: {"n": 2}\n\n', "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _record_disconnect(self) -> None:
        self.state.disconnected_at = time.monotonic()
        self.state.disconnected.set()

    async def _wait_disconnect_or(
        self,
        receive: Any,
        wait_s: float,
        release: threading.Event | None = None,
        until: Callable[[], bool] | None = None,
    ) -> bool:
        """True when `release` fired or `until()` holds; False when the client disconnected (recorded) or time ran
        out."""

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._record_disconnect()

        watcher = asyncio.ensure_future(watch())
        deadline = time.monotonic() + wait_s
        try:
            while time.monotonic() < deadline and not watcher.done():
                if release is not None and release.is_set():
                    return True
                if until is not None and until():
                    return True
                await asyncio.sleep(0.005 if until is not None else 0.01)
            return False
        finally:
            watcher.cancel()


def _echo(seen: Seen) -> bytes:
    return orjson.dumps(
        {
            "method": seen.method,
            "path": seen.path,
            "query": seen.query,
            "headers": seen.headers,
            "body_sha256": hashlib.sha256(seen.body).hexdigest(),
            "body_bytes": len(seen.body),
        }
    )


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + (headers or [])
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
