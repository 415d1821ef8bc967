"""ASGI types and helpers shared by the gateway and the engine (both are raw ASGI apps under uvicorn)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from serving.headers import get_header

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

T = TypeVar("T")

logger = logging.getLogger("mmgate")


class ClientDisconnected(Exception):
    """The client went away before its request body arrived in full, or while it waited for an answer."""


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


async def read_body(
    receive: Receive, *, max_bytes: int | None = None, refuse: Callable[[int], Exception] | None = None
) -> bytearray:
    """The whole request body; past `max_bytes`, `refuse(count)` is raised as soon as the count passes it."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        body += message.get("body", b"")
        if max_bytes is not None and len(body) > max_bytes:
            raise (refuse(len(body)) if refuse is not None else ValueError(f"body passed {max_bytes:,} bytes"))
        if not message.get("more_body", False):
            return body


@dataclass(frozen=True)
class BodyCap:
    """A request-body cap, `knob` = `max_bytes`, with the errors each process refuses with: `too_large(message)`
    (413) and `malformed(message)` (400, a Content-Length that is not a non-negative integer)."""

    max_bytes: int
    knob: str
    too_large: Callable[[str], Exception]
    malformed: Callable[[str], Exception]

    def check_declared(self, scope: Scope) -> int | None:
        """Refuse the request by its Content-Length, before a byte of the body is read; the length it declares."""
        declared = get_header(scope["headers"], b"content-length")
        if declared is None:
            return None
        try:
            length = int(declared)
        except ValueError:
            length = -1
        if length < 0:
            raise self.malformed(f"invalid Content-Length header {declared.decode('latin-1')!r}")
        if length > self.max_bytes:
            raise self.too_large(
                f"request body is {length:,} bytes (Content-Length), over {self.knob}={self.max_bytes:,}"
            )
        return length

    def passed(self, count: int) -> Exception:
        """The error for a body whose count passed the cap at `count` bytes while it arrived."""
        return self.too_large(f"request body passed {self.knob}={self.max_bytes:,} at {count:,} bytes")

    async def read(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body: refused by its Content-Length before reading a byte, else as soon as the count
        passes the cap."""
        self.check_declared(scope)
        return bytes(await read_body(receive, max_bytes=self.max_bytes, refuse=self.passed))


async def serve_lifespan(
    receive: Receive, send: Send, startup: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]]
) -> None:
    """The ASGI lifespan protocol: a failed start-up is reported to the server, which then exits."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await startup()
            except Exception as exc:
                # Imported here: serving.errors builds on this module.
                from serving.errors import ServingError

                if isinstance(exc, ServingError):  # a refusal that says what is wrong: no traceback
                    logger.error("start-up failed: %s", exc.message)
                else:
                    logger.exception("start-up failed")
                # Without a message: the server would log it once more, the cause twice in the log.
                await send({"type": "lifespan.startup.failed", "message": ""})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


EXCHANGE_KEY = "mmgate.exchange"


class Exchange:
    """One request's `receive` and `send`, followed as they pass: the response's status and headers once it has
    started, whether it is complete, the body bytes received and the response bytes sent. `header`, when given, is
    set on the response, replacing one of the same name. Made by the outermost layer that needs it and kept in the
    scope (`exchange_of`), so that the layers inside read it instead of wrapping `send` again."""

    __slots__ = ("_header", "_receive", "_send", "body_bytes", "complete", "headers", "response_bytes", "status")

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, *, header: tuple[bytes, bytes] | None = None
    ) -> None:
        self._receive = receive
        self._send = send
        self._header = header
        self.status: int | None = None
        self.headers: Iterable[tuple[bytes, bytes]] = ()
        self.complete = False
        self.body_bytes = 0
        self.response_bytes = 0
        scope[EXCHANGE_KEY] = self

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.body_bytes += len(message.get("body", b""))
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self._header is not None:
                name = self._header[0]
                headers = [h for h in message.get("headers", ()) if h[0] != name]
                headers.append(self._header)
                message["headers"] = headers
            self.headers = message.get("headers", ())
        elif message["type"] == "http.response.body":
            self.response_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
        await self._send(message)

    def forget(self, scope: Scope) -> None:
        """The request has ended: `scope` names this exchange no more. Until then the two hold each other (the
        server's `receive` and `send` are methods of the object that holds the scope), and only the garbage
        collector could free them and all they hold."""
        if scope.get(EXCHANGE_KEY) is self:
            del scope[EXCHANGE_KEY]

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def event_stream(self) -> bool:
        """The response started is an event stream."""
        return any(
            name.lower() == b"content-type" and value.lower().startswith(b"text/event-stream")
            for name, value in self.headers
        )


def exchange_of(scope: Scope) -> Exchange | None:
    """The request's `Exchange`, where a layer outside made one."""
    exchange: Exchange | None = scope.get(EXCHANGE_KEY)
    return exchange


DISCONNECT_KEY = "mmgate.disconnect"


class DisconnectSignal:
    """The moment one request's client is gone, for callbacks: the server's protocol fires it where the request's
    `receive()` starts to return `http.disconnect` (the connection lost, or the request ended by a server timeout).
    Watching it costs a list entry where watching `receive` costs a task.

    A server that holds back reading a request body (its buffer full while the app does not read) only notices the
    client leaving when it reads again: `probe()` asks the connection itself, and fires the signal if the client
    has closed its end."""

    __slots__ = ("_callbacks", "_probe", "fired")

    def __init__(self, probe: Callable[[], None] | None = None) -> None:
        """`probe`: the protocol's check of its connection, which ends the request when the client has gone."""
        self.fired = False
        self._callbacks: list[Callable[[], None]] = []
        self._probe = probe

    def probe(self) -> None:
        if not self.fired and self._probe is not None:
            self._probe()

    def detach(self) -> None:
        """The connection is gone: there is nothing left to probe."""
        self._probe = None

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` when the signal fires (in the next loop turn if it already has); the returned function
        stops the watch."""
        if self.fired:
            return asyncio.get_running_loop().call_soon(callback).cancel
        self._callbacks.append(callback)
        return lambda: self._unwatch(callback)

    def _unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)


def disconnect_signal(scope: Scope) -> DisconnectSignal | None:
    """The request's `DisconnectSignal`, where the server's protocol set one."""
    signal: DisconnectSignal | None = scope.get(DISCONNECT_KEY)
    return signal


async def wait_for_disconnect(receive: Receive) -> None:
    # Any request body left unread (an upstream that answered early) is drained and dropped here.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(
    awaitable: Awaitable[T],
    receive: Receive,
    *,
    discard: Callable[[T], object] | None = None,
    signal: DisconnectSignal | None = None,
    probe_s: float | None = None,
) -> T:
    """Await `awaitable` unless the client disconnects first; then raise `ClientDisconnected`.

    Call only once the request body has been read: this listens on `receive`. A coroutine runs in the caller's
    task and is cancelled on disconnect (its clean-up runs before this returns); a future is left alone, since
    someone else owns it. Work that finished with a result all the same (the disconnect and the result arrived in
    the same loop turn) returns it: the result may hold a resource (a budget reservation, an engine request) that
    only the caller can give back. When the caller itself is cancelled after a future produced its result,
    `discard(result)` gives it back.

    One task watches `receive`; on disconnect it cancels the caller's task, and the cancellation is told apart from
    any other by the task's cancellation count, as `asyncio.timeout` does. With `signal` (the request's
    `DisconnectSignal`) the signal is watched instead, without a task: pass it only where `receive` would report
    nothing but the protocol's disconnect (the body read in full by the app, no wrapper making up a disconnect, or
    not read at all while this waits). `probe_s`: with `signal`, `signal.probe()` runs at least this often while it
    waits (where the server may have stopped reading the connection).
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("until_disconnect must run in a task")
    # Not asyncio.isfuture: its hasattr raises and clears an AttributeError for every coroutine.
    future = awaitable if isinstance(awaitable, asyncio.Future) else None
    left = False
    watching = True

    def client_left() -> None:
        nonlocal left
        if watching:
            left = True
            task.cancel()

    def watcher_done(watcher: asyncio.Task[None]) -> None:
        if watcher.cancelled():
            return
        watcher.exception()  # retrieved: a receive that raised counts as the client gone, as a disconnect
        client_left()

    cancelling = task.cancelling()
    stop_watching: Callable[[], object]
    if signal is not None:
        stop_watching = signal.watch(client_left)
        if probe_s is not None:
            stop_watching = _probing(task.get_loop(), signal, probe_s, stop_watching)
    else:
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        watcher.add_done_callback(watcher_done)
        stop_watching = watcher.cancel
    try:
        try:
            # A future is shielded: the disconnect cancels only this wait for it.
            result = await (asyncio.shield(future) if future is not None else awaitable)
        finally:
            watching = False
            stop_watching()
    except BaseException as exc:
        if not left:
            if future is not None and discard is not None and _succeeded(future):
                discard(future.result())
            raise
        # Only our own cancellation is taken back; one from elsewhere still stands.
        task.uncancel()
        externally_cancelled = task.cancelling() > cancelling
        if future is not None and _succeeded(future):
            if not externally_cancelled:
                return cast(T, future.result())
            if discard is not None:
                discard(future.result())
        if externally_cancelled:
            raise
        raise ClientDisconnected from exc
    if left:
        task.uncancel()  # the work finished all the same, having absorbed the cancellation: its result stands
    return result


class _Prober:
    """`probe()` every `interval_s` for the signals of every wait on one loop that asked for it: one timer for them
    all, which stops when none is left, so that a wait costs a dict entry rather than a timer of its own."""

    __slots__ = ("_handle", "_interval_s", "_loop", "_signals")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self._loop = loop
        self._interval_s = interval_s
        self._signals: dict[DisconnectSignal, int] = {}  # how many waits probe each
        self._handle: asyncio.TimerHandle | None = None

    def add(self, signal: DisconnectSignal, stop_watching: Callable[[], object]) -> Callable[[], None]:
        """Probe `signal` until the returned function, which also calls `stop_watching`, is called."""
        signals = self._signals
        signals[signal] = signals.get(signal, 0) + 1
        if self._handle is None:
            self._handle = self._loop.call_later(self._interval_s, self._tick)

        def stop() -> None:
            count = signals.pop(signal, 1) - 1
            if count:
                signals[signal] = count
            stop_watching()

        return stop

    def _tick(self) -> None:
        self._handle = None
        for signal in list(self._signals):
            signal.probe()
        if self._signals:
            self._handle = self._loop.call_later(self._interval_s, self._tick)


_probers: dict[tuple[asyncio.AbstractEventLoop, float], _Prober] = {}


def _probing(
    loop: asyncio.AbstractEventLoop, signal: DisconnectSignal, interval_s: float, stop_watching: Callable[[], object]
) -> Callable[[], None]:
    """`signal.probe()` at least every `interval_s` until the returned function, which also stops the watch, is
    called. A wait that begins between two ticks of the interval's timer is first probed at the next one."""
    prober = _probers.get((loop, interval_s))
    if prober is None:
        for key in [key for key in _probers if key[0].is_closed()]:
            del _probers[key]
        prober = _probers[(loop, interval_s)] = _Prober(loop, interval_s)
    return prober.add(signal, stop_watching)


def _succeeded(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


async def relay_body(
    chunks: AsyncIterator[bytes], receive: Receive, send: Send, *, signal: DisconnectSignal | None = None
) -> bool:
    """Send each chunk as it arrives, then end the body. False when the client left first (the stream is then
    abandoned mid-way); errors raised by `chunks` propagate. `signal`: as for `until_disconnect`."""

    async def pump() -> None:
        async for chunk in chunks:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    try:
        await until_disconnect(pump(), receive, signal=signal)
    except ClientDisconnected:
        return False
    return True
