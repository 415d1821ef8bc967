"""Calling the shared media budget's Lua scripts with as little client work as one round trip allows.

redis-py's command path (a pool checkout under a condition, a retry wrapper, every argument encoded through its
encoder, a timeout context and a stream read per reply) costs more CPU per call than Redis spends running the
script, and on a request's path that CPU is latency. `ScriptRunner` pipelines every call on one connection:
redis-py opens it (so AUTH, SELECT, TLS and the connect timeout follow the URL), then a protocol of this module
takes its transport (what that takes of redis-py's internals is in `redis_private`). A call packs `EVALSHA`, writes
it, and waits on a future that the protocol resolves when the call's reply arrives; Redis answers one connection's
commands in the order they were written, so the replies that one read brings resolve their callers in turn. `send`
writes a call without waiting, for a caller that handles the reply in a callback.

A caller that gives up leaves its future behind; the reply still arrives in its turn and is dropped, so the
connection never falls out of step. Past the socket timeout without the oldest call's reply, the connection fails
and so does every call on it.

Failures are redis-py's exceptions: `ConnectionError` / `TimeoutError` (after one retry on a fresh connection:
every budget script is safe to run twice, a call names its ticket or lease), `ResponseError` from the script.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Mapping
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.budget import redis_private

# A connection that failed this way is dropped and the call is tried once more on a fresh one.
_RETRIED = (RedisConnectionError, RedisTimeoutError, OSError)


def pack(*parts: bytes) -> bytes:
    """A command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%b\r\n" % (len(part), part))
    return b"".join(out)


def _bulk(value: str | int) -> bytes:
    data = str(value).encode() if isinstance(value, int) else value.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _reply_error(message: str) -> ResponseError:
    # The error classes redis-py gives the same replies.
    return NoScriptError(message) if message.startswith("NOSCRIPT ") else ResponseError(message)


class _Pipeline(asyncio.Protocol):
    """One connection's calls, written as they come, resolved in the order their replies arrive."""

    def __init__(self, connection: AbstractConnection, transport: asyncio.Transport, timeout_s: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._connection = connection  # owns the transport: closing it closes the socket
        self._transport = transport
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader(encoding="utf-8")
        self._pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._unwritten: list[bytes] = []  # commands of this loop turn, written together at its end
        self.failure: RedisConnectionError | RedisTimeoutError | None = None

    @property
    def waiting(self) -> int:
        """Calls written whose reply has not arrived."""
        return len(self._pending)

    def call(self, command: bytes) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        if self.failure is not None:
            future.set_exception(type(self.failure)(str(self.failure)))
            return future
        if self._timeout_s is not None:
            deadline = self._loop.time() + self._timeout_s
            self._pending.append((future, deadline))
            if self._timer is None:
                self._timer = self._loop.call_at(deadline, self._check_deadline)
        else:
            self._pending.append((future, 0.0))
        if not self._unwritten:
            self._loop.call_soon(self._write)
        self._unwritten.append(command)
        return future

    def _write(self) -> None:
        # One send for every call made in a loop turn: a send on loopback costs more than a script run in Redis.
        unwritten, self._unwritten = self._unwritten, []
        if self.failure is None:
            self._transport.write(unwritten[0] if len(unwritten) == 1 else b"".join(unwritten))

    def close(self) -> None:
        self._fail(RedisConnectionError("the script runner is closed"))

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        pending = self._pending
        try:
            while (reply := self._reader.gets()) is not False:
                future, _ = pending.popleft()
                if future.done():
                    continue  # its caller gave up
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(_reply_error(str(reply)))
                else:
                    future.set_result(reply)
        except IndexError:
            self._fail(RedisConnectionError("Redis sent a reply to no command"))
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"Redis sent a reply that is not RESP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._fail(RedisConnectionError(f"Redis closed the connection{reason}"))

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._pending or self.failure is not None:
            return
        deadline = self._pending[0][1]
        if deadline <= self._loop.time():
            self._fail(RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g} s (redis.socket_timeout_s)"))
        else:
            self._timer = self._loop.call_at(deadline, self._check_deadline)

    def _fail(self, failure: RedisConnectionError | RedisTimeoutError) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        redis_private.close_now(self._connection)
        pending, self._pending = self._pending, collections.deque()
        for future, _ in pending:
            if not future.done():
                future.set_exception(type(failure)(str(failure)))


class ScriptRunner:
    """Runs the named scripts with one key, pipelined on one connection made like `pool`'s."""

    def __init__(self, pool: ConnectionPool, scripts: Mapping[str, str], key: str) -> None:
        self._pool = pool
        self._timeout_s = redis_private.socket_timeout(pool)
        self._sources = {name: source.encode() for name, source in scripts.items()}
        self._shas = {name: hashlib.sha1(source).hexdigest().encode() for name, source in self._sources.items()}
        key_bytes = key.encode()
        self._key = key_bytes
        # Every command starts with the same parts: the name, the script (by SHA or source), one key, the key.
        self._evalsha_heads = {name: pack(b"EVALSHA", sha, b"1", key_bytes)[4:] for name, sha in self._shas.items()}
        self._eval_heads = {name: pack(b"EVAL", source, b"1", key_bytes)[4:] for name, source in self._sources.items()}
        self._pipeline: _Pipeline | None = None
        self._connecting: asyncio.Future[_Pipeline] | None = None
        self._closed = False
        self.connections_made = 0

    @property
    def connected(self) -> bool:
        return self._pipeline is not None and self._pipeline.failure is None

    async def __call__(self, name: str, *args: str | int) -> Any:
        """The reply of script `name` run with KEYS = [key] and ARGV = args."""
        header, tail = self._header_and_tail(args)
        command = header + self._evalsha_heads[name] + tail
        for attempt in (1, 2):
            try:
                pipeline = self._pipeline
                if pipeline is None or pipeline.failure is not None:
                    pipeline = await self._connected()
                try:
                    return await pipeline.call(command)
                except NoScriptError:
                    # Redis lost its script cache (a restart, SCRIPT FLUSH): EVAL sends the source and caches it.
                    return await pipeline.call(header + self._eval_heads[name] + tail)
            except _RETRIED:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def send(self, name: str, *args: str | int) -> asyncio.Future[Any] | None:
        """Write the call now and return the future of its reply, without a retry or a script load; None when no
        connection is up (the caller uses `__call__`)."""
        pipeline = self._pipeline
        if pipeline is None or pipeline.failure is not None or self._closed:
            return None
        header, tail = self._header_and_tail(args)
        return pipeline.call(header + self._evalsha_heads[name] + tail)

    async def aclose(self) -> None:
        self._closed = True
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    @staticmethod
    def _header_and_tail(args: tuple[str | int, ...]) -> tuple[bytes, bytes]:
        """The array header of a command with these arguments after its head, and the arguments in RESP."""
        return b"*%d\r\n" % (4 + len(args)), b"".join(map(_bulk, args))

    async def _connected(self) -> _Pipeline:
        """The live pipeline, connecting once for every caller that needs it."""
        if self._closed:
            raise RedisConnectionError("the script runner is closed")
        if self._connecting is None:
            connecting = asyncio.ensure_future(self._connect())
            self._connecting = connecting
            connecting.add_done_callback(self._connected_or_not)
        # Shielded: a caller that gives up does not stop the connection the others wait for.
        return await asyncio.shield(self._connecting)

    def _connected_or_not(self, connecting: asyncio.Future[_Pipeline]) -> None:
        self._connecting = None
        if not connecting.cancelled():
            connecting.exception()  # retrieved: the callers that waited got it

    async def _connect(self) -> _Pipeline:
        connection = await redis_private.connect_like(self._pool)
        transport = redis_private.transport_of(connection)
        pipeline = _Pipeline(connection, transport, self._timeout_s)
        transport.set_protocol(pipeline)
        self.connections_made += 1
        if self._closed:
            pipeline.close()
            raise RedisConnectionError("the script runner is closed")
        if self._pipeline is not None:
            self._pipeline.close()
        self._pipeline = pipeline
        return pipeline
