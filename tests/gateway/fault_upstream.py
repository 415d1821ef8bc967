"""A raw HTTP/1.1 upstream for fault injection: what an ASGI stub cannot do (reset a connection mid-stream, close
one without an answer), and a record of when the gateway closed an upstream connection it no longer needed.

The request header `x-fault` picks the behaviour of each request (the gateway forwards it like any end-to-end
header):

| `x-fault` | behaviour |
| --- | --- |
| (none) | 200 JSON `{"path", "body_bytes"}` with Content-Length, keep-alive |
| `sse` | 200 `text/event-stream`, three events, a complete chunked body |
| `reset` | 200 `text/event-stream`, one event, then a TCP reset (SO_LINGER 0) |
| `hang` | reads the request and never answers, until the peer closes (at most 30 s) |
| `slow=<s>` | answers like (none) after `<s>` seconds, unless the peer closes first |
| `stall` | 200 `text/event-stream`, one event, then waits for the peer to close (at most 30 s) |
| `close` | closes the connection without answering |
| `garbage` | answers bytes that are not HTTP, then closes |
| `big_header` | answers a response header line of 64 KiB, then closes |
| `short_body` | 200 with Content-Length 100 and 5 bytes of body, then closes |

`peer_closed[mode]` counts the requests whose connection the gateway closed while the stub was still waiting.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType

import orjson

MAX_WAIT_S = 30.0


class FaultUpstream:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: collections.Counter[str] = collections.Counter()
        self.peer_closed: collections.Counter[str] = collections.Counter()
        self.waiting: collections.Counter[str] = collections.Counter()
        self.open_connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-upstream", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    def __enter__(self) -> FaultUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def wait_until(self, condition: Callable[[FaultUpstream], bool], timeout_s: float) -> bool:
        """Poll `condition(self)` (under the lock) until it holds or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if condition(self):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._accepted, "127.0.0.1", 0, backlog=1024)

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self.lock:
            self.open_connections += 1
        aborted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {
                    name.strip().lower(): value.strip()
                    for name, _, value in (line.partition(":") for line in lines[1:] if line)
                }
                body_bytes = await _read_body(reader, headers)
                fault = headers.get("x-fault", "")
                mode = fault.split("=")[0]
                with self.lock:
                    self.received[mode] += 1
                keep, aborted = await self._answer(mode, fault, path, body_bytes, reader, writer)
                if not keep:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            return
        finally:
            with self.lock:
                self.open_connections -= 1
            if not aborted:
                writer.close()
            self._tasks.discard(task)

    async def _answer(
        self,
        mode: str,
        fault: str,
        path: str,
        body_bytes: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> tuple[bool, bool]:
        """(keep the connection, the connection was aborted)."""
        if mode == "close":
            return False, False
        if mode in _BROKEN:
            writer.write(_BROKEN[mode])
            await writer.drain()
            return False, False
        if mode == "hang":
            await self._wait_peer_close(mode, reader, MAX_WAIT_S)
            return False, False
        if mode == "slow" and await self._wait_peer_close(mode, reader, float(fault.split("=")[1])):
            return False, False
        if mode in ("sse", "reset", "stall"):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + _chunk(b'data: {"n": 1}\n\n')
            )
            await writer.drain()
            if mode == "sse":
                writer.write(_chunk(b'data: {"n": 2}\n\n') + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
                return True, False
            if mode == "stall":
                await self._wait_peer_close(mode, reader, MAX_WAIT_S)
                return False, False
            await asyncio.sleep(0.05)  # let the first event reach the client before the reset
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False, True
        body = orjson.dumps({"path": path, "body_bytes": body_bytes})
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        return True, False

    async def _wait_peer_close(self, mode: str, reader: asyncio.StreamReader, wait_s: float) -> bool:
        """True when the peer closed the connection within `wait_s` (recorded in `peer_closed`)."""
        with self.lock:
            self.waiting[mode] += 1
        try:
            try:
                data = await asyncio.wait_for(reader.read(1), wait_s)
            except TimeoutError:
                return False
            except ConnectionError:
                data = b""
            if data:
                return False  # a pipelined request: not something the gateway sends
            with self.lock:
                self.peer_closed[mode] += 1
            return True
        finally:
            with self.lock:
                self.waiting[mode] -= 1


_BROKEN = {
    "garbage": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "big_header": b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (64 << 10) + b"\r\ncontent-length: 0\r\n\r\n",
    "short_body": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\nshort",
}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> int:
    if "content-length" in headers:
        return len(await reader.readexactly(int(headers["content-length"])))
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return 0
    total = 0
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return total
        total += len(await reader.readexactly(size))
        await reader.readexactly(2)
