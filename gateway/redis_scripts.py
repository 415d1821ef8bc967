"""Calling the shared media budget's Lua scripts with as little client work as one round trip allows.

redis-py's command path (a pool checkout under a condition, a retry wrapper, every argument encoded through its
encoder, observability hooks) costs more CPU per call than Redis spends running the script, and on a request's
path that CPU is latency. `ScriptRunner` keeps connections of its own (redis-py's `Connection`, so AUTH, SELECT,
TLS and the socket timeouts follow the URL as before), packs `EVALSHA` itself, writes it to the connection's stream
(`send_packed_command` runs every write in a task of its own under `wait_for`) and reads the reply on the
connection it wrote to: one write and one read a call.

Failures are redis-py's: `ConnectionError` / `TimeoutError` (after one retry on a fresh connection: every budget
script is safe to run twice, a call names its ticket or lease), `ResponseError` from the script. A call cancelled
between its write and its reply drops its connection, whose next reply would belong to nobody.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Mapping
from typing import Any

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# A connection that failed this way is dropped and the call is tried once more on a fresh one.
_RETRIED = (RedisConnectionError, RedisTimeoutError, OSError)


def pack(*parts: bytes) -> bytes:
    """A command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%b\r\n" % (len(part), part))
    return b"".join(out)


def _arg(value: str | int) -> bytes:
    return str(value).encode() if isinstance(value, int) else value.encode()


class ScriptRunner:
    """Runs the named scripts with one key, on up to `max_connections` connections made like `pool`'s.

    A caller that finds every connection busy waits, FIFO, up to `wait_timeout_s`, then gets `ConnectionError`.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        scripts: Mapping[str, str],
        key: str,
        *,
        max_connections: int,
        wait_timeout_s: float,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._sources = {name: source.encode() for name, source in scripts.items()}
        self._shas = {name: hashlib.sha1(source).hexdigest().encode() for name, source in self._sources.items()}
        self._key = key.encode()
        self._max = max_connections
        self._wait_timeout_s = wait_timeout_s
        self._idle: list[AbstractConnection] = []
        self._open = 0  # connections made and not dropped: idle or in use
        self._waiters: collections.deque[asyncio.Future[AbstractConnection]] = collections.deque()
        self._closed = False
        self._closing: set[asyncio.Future[None]] = set()  # disconnects of connections given back after aclose

    @property
    def connections(self) -> int:
        return self._open

    async def __call__(self, name: str, *args: str | int) -> Any:
        """The reply of script `name` run with KEYS = [key] and ARGV = args."""
        tail = [b"1", self._key, *(_arg(arg) for arg in args)]
        command = pack(b"EVALSHA", self._shas[name], *tail)
        for attempt in (1, 2):
            connection = await self._acquire()
            try:
                try:
                    await _write(connection, command)
                    reply = await connection.read_response()
                except NoScriptError:
                    # Redis lost its script cache (a restart, SCRIPT FLUSH): EVAL sends the source and caches it.
                    await _write(connection, pack(b"EVAL", self._sources[name], *tail))
                    reply = await connection.read_response()
            except _RETRIED:
                await self._drop(connection)
                if attempt == 2:
                    raise
                continue
            except BaseException as exc:
                if isinstance(exc, ResponseError):
                    self._release(connection)  # the script's own error: its reply was read, the connection is fine
                else:
                    await self._drop(connection)
                raise
            self._release(connection)
            return reply
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await self._drop(connection)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RedisConnectionError("the script runner is closed"))

    async def _acquire(self) -> AbstractConnection:
        if self._closed:
            raise RedisConnectionError("the script runner is closed")
        if self._idle:
            return self._idle.pop()
        if self._open < self._max:
            self._open += 1
            return self._connection_class(**self._connection_kwargs)
        waiter: asyncio.Future[AbstractConnection] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._wait_timeout_s):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed over in the same turn as the wait ended
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise RedisConnectionError(
                    f"no connection to Redis free within {self._wait_timeout_s:g} s ({self._max} in use)"
                ) from None
            raise

    def _release(self, connection: AbstractConnection) -> None:
        if self._closed:
            self._open -= 1
            task = asyncio.ensure_future(connection.disconnect(nowait=True))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self._idle.append(connection)

    async def _drop(self, connection: AbstractConnection) -> None:
        self._open -= 1
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        # The place it held is free: a waiter gets a fresh connection.
        while self._waiters and not self._closed:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._open += 1
                waiter.set_result(self._connection_class(**self._connection_kwargs))
                return


# Past this many bytes waiting in a connection's send buffer, a write waits for it to drain.
_DRAIN_ABOVE_BYTES = 64 << 10


async def _write(connection: AbstractConnection, command: bytes) -> None:
    """Write `command` on `connection`, connecting it first if needed. A write to a connection that has gone
    shows as the read of its reply failing (a retried `ConnectionError`)."""
    if not connection.is_connected:
        await connection.connect()  # type: ignore[no-untyped-call]
    writer: asyncio.StreamWriter | None = getattr(connection, "_writer", None)
    if writer is None:  # a redis-py without the stream attribute: its own (slower) write
        await connection.send_packed_command(command, check_health=False)
        return
    writer.write(command)
    if writer.transport.get_write_buffer_size() > _DRAIN_ABOVE_BYTES:
        await connection.send_packed_command(b"", check_health=False)  # drains under the socket timeout
