"""Edges for the fetch tests: a stub media server that records what reached it and how it ended, and a fake DNS.

Routes (query parameters in brackets):
- `/bytes?size=N[&length=0][&chunk=K][&delay=S][&close=1]`: N bytes of `payload(N)` in K-byte chunks, with a
  Content-Length unless `length=0`, S seconds between chunks, `Connection: close` with `close=1`.
- `/declare?size=N`: declares Content-Length N, sends one chunk and then waits for the client to leave.
- `/redirect?to=URL[&status=302]`: a redirect to URL (sent as given, so it may be relative).
- `/slow-headers?delay=S`: answers only after S seconds.
- `/stall?after=N`: sends N bytes of a body, then nothing until the client leaves.
- `/loop` (redirects to itself), `/no-location` (a 302 without Location), `/status/<code>`, `/gzip` (a gzip-encoded
  body), `/set-cookie`.
- `/files/<name>`: `files[name]`; when `others` has the name, what it holds to any User-Agent other than `agent`.

Each request is a `Hit`: path, query, headers, client address, bytes sent, whether the body finished, whether the
client left.
`FakeDNS` is an inner resolver for `GuardedResolver` that answers chosen addresses per host name.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any
from urllib.parse import parse_qsl

from aiohttp.abc import AbstractResolver, ResolveResult

from tests.stub_asgi import lifespan

# A second loopback address that tests permit through media.fetch.allowed_networks: it plays a public host.
PUBLIC = "127.0.0.2"

# Long enough for any test, short enough that a server shutdown never waits on a forgotten handler for long.
_MAX_HOLD_S = 10.0


def payload(size: int) -> bytes:
    """The bytes `/bytes?size=N` serves: a repeating 0..255 pattern, so truncation or reordering shows."""
    block = bytes(range(256))
    return (block * (size // 256 + 1))[:size]


@dataclass
class Hit:
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    client: tuple[str, int]
    sent: int = 0
    finished: bool = False
    # Set when the client left, and also once the response is complete (uvicorn reports that as a disconnect).
    disconnected: threading.Event = field(default_factory=threading.Event)


class MediaStub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits: list[Hit] = []
        self.hit_event = threading.Event()
        self.files: dict[str, bytes] = {}
        self.others: dict[str, bytes] = {}
        self.agent = "mmgate-media-fetch/0.1"

    def reset(self) -> None:
        with self.lock:
            self.hits.clear()
            self.hit_event.clear()
            self.files.clear()
            self.others.clear()

    def paths(self) -> list[str]:
        with self.lock:
            return [hit.path for hit in self.hits]

    def only_hit(self) -> Hit:
        with self.lock:
            assert len(self.hits) == 1, [hit.path for hit in self.hits]
            return self.hits[0]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        hit = Hit(
            path=scope["path"],
            query=dict(parse_qsl(scope["query_string"].decode())),
            headers={name.decode(): value.decode() for name, value in scope["headers"]},
            client=tuple(scope["client"]),
        )
        with self.lock:
            self.hits.append(hit)
            self.hit_event.set()
        await receive()  # the (empty) request body

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            hit.disconnected.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._answer(hit, send, watcher)
        finally:
            watcher.cancel()

    async def _answer(self, hit: Hit, send: Any, watcher: asyncio.Future[None]) -> None:
        path, query = hit.path, hit.query
        if path == "/bytes":
            size = int(query["size"])
            headers = [(b"content-type", b"application/octet-stream")]
            if query.get("length", "1") == "1":
                headers.append((b"content-length", str(size).encode()))
            if query.get("close") == "1":
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._body(
                hit, send, watcher, payload(size), int(query.get("chunk", 65536)), float(query.get("delay", 0))
            )
        elif path == "/declare":
            headers = [(b"content-length", query["size"].encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._send_chunk(hit, send, payload(1024))
            await _wait(watcher, _MAX_HOLD_S)
        elif path == "/redirect":
            status = int(query.get("status", 302))
            await _respond(send, status, b"", [(b"location", query["to"].encode())])
        elif path == "/loop":
            await _respond(send, 302, b"", [(b"location", b"/loop")])
        elif path == "/no-location":
            await _respond(send, 302, b"")
        elif path == "/slow-headers":
            if not await _wait(watcher, float(query.get("delay", 5))):
                await _respond(send, 200, b"late")
        elif path == "/stall":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await self._send_chunk(hit, send, payload(int(query.get("after", 5))))
            await _wait(watcher, _MAX_HOLD_S)
        elif path.startswith("/status/"):
            status = int(path.rsplit("/", 1)[1])
            await _respond(send, status, b"" if status in (204, 304) else b"stub error")
        elif path == "/gzip":
            await _respond(send, 200, gzip.compress(payload(4096)), [(b"content-encoding", b"gzip")])
        elif path == "/set-cookie":
            await _respond(send, 200, b"ok", [(b"set-cookie", b"session=secret; Path=/")])
        elif path.startswith("/files/") and path[7:] in self.files:
            name = path[7:]
            trusted = hit.headers.get("user-agent") == self.agent
            await _respond(send, 200, self.files[name] if trusted else self.others.get(name, self.files[name]))
        else:
            await _respond(send, 404, b"no such route")
        if not watcher.done():
            hit.finished = True

    async def _body(
        self, hit: Hit, send: Any, watcher: asyncio.Future[None], body: bytes, chunk: int, delay: float
    ) -> None:
        for start in range(0, len(body), chunk):
            if watcher.done():
                return
            await self._send_chunk(hit, send, body[start : start + chunk])
            # Yield even without a delay, so a client's disconnect is seen between chunks.
            await asyncio.sleep(delay)
        await send({"type": "http.response.body", "body": b""})

    async def _send_chunk(self, hit: Hit, send: Any, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        hit.sent += len(chunk)


async def _wait(watcher: asyncio.Future[None], seconds: float) -> bool:
    """True when the client left within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watcher.done():
            return True
        await asyncio.sleep(0.01)
    return False


async def _respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class FakeDNS(AbstractResolver):
    """Answers `records[host]` on a host's first lookup and `later[host]` (when given) on every one after it,
    the way a rebinding DNS server would. Unknown hosts fail like NXDOMAIN. `lookups` lists every question."""

    def __init__(
        self,
        records: Mapping[str, Sequence[str]],
        *,
        later: Mapping[str, Sequence[str]] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.records = records
        self.later = later or {}
        self.delay_s = delay_s
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        first = host not in self.lookups
        self.lookups.append(host)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if host not in self.records:
            raise OSError(f"fake DNS: no such host {host}")
        answers = self.records[host] if first or host not in self.later else self.later[host]
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ip_address(address).version == 6 else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for address in answers
        ]

    async def close(self) -> None:
        pass
