"""serving.asgi: BodyCap (the Content-Length is checked before a byte is read, the count as the body arrives) and
until_disconnect (work given up when the client leaves, and only then), watching `receive` or a DisconnectSignal."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from serving.asgi import BodyCap, ClientDisconnected, DisconnectSignal, Message, until_disconnect

T = TypeVar("T")


class Refused(Exception):
    pass


class Malformed(Exception):
    pass


CAP = BodyCap(100, "x.cap", Refused, Malformed)


def receiver(chunks: list[bytes]) -> tuple[Any, list[int]]:
    reads: list[int] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> Message:
        reads.append(1)
        return messages.pop(0)

    return receive, reads


async def read(chunks: list[bytes], headers: list[tuple[bytes, bytes]], max_bytes: int = 100) -> bytes:
    receive, _ = receiver(chunks)
    scope = {"type": "http", "headers": headers}
    return await BodyCap(max_bytes, "x.cap", Refused, Malformed).read(scope, receive)


async def test_a_body_within_the_cap_is_read_whole() -> None:
    assert await read([b"ab", b"cd"], [(b"content-length", b"4")]) == b"abcd"
    assert await read([b"ab", b"cd"], []) == b"abcd"


async def test_declared_length_over_the_cap_is_refused_before_reading() -> None:
    receive, reads = receiver([b"a" * 101])
    scope = {"type": "http", "headers": [(b"Content-Length", b"101")]}
    with pytest.raises(Refused, match=r"request body is 101 bytes \(Content-Length\), over x.cap=100"):
        await CAP.read(scope, receive)
    assert reads == []


@pytest.mark.parametrize("value", [b"ten", b"-5", b"", b"1e3"])
async def test_a_malformed_content_length_is_refused_before_reading(value: bytes) -> None:
    receive, reads = receiver([b"a"])
    scope = {"type": "http", "headers": [(b"content-length", value)]}
    with pytest.raises(Malformed, match="invalid Content-Length header"):
        await CAP.read(scope, receive)
    assert reads == []


async def test_an_undeclared_body_is_refused_as_soon_as_it_passes_the_cap() -> None:
    receive, reads = receiver([b"a" * 60, b"b" * 60, b"c" * 60])
    scope = {"type": "http", "headers": []}
    with pytest.raises(Refused, match=r"request body passed x.cap=100 at 120 bytes"):
        await CAP.read(scope, receive)
    assert len(reads) == 2


class Client:
    """A client that leaves when `leave()` is called. Watched through `receive` (whose `http.disconnect` comes
    then) or, with `by_signal`, through its `DisconnectSignal` (`receive` then only counts calls, never answers)."""

    def __init__(self, by_signal: bool = False) -> None:
        self.gone = asyncio.Event()
        self.signal = DisconnectSignal() if by_signal else None
        self.receives = 0

    def leave(self) -> None:
        self.gone.set()
        if self.signal is not None:
            self.signal.fire()

    async def receive(self) -> Message:
        self.receives += 1
        if self.signal is not None:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def until(self, awaitable: Awaitable[T], discard: Callable[[T], object] | None = None) -> T:
        return await until_disconnect(awaitable, self.receive, discard=discard, signal=self.signal)


WATCHES = pytest.mark.parametrize("by_signal", [False, True], ids=["receive", "signal"])


@WATCHES
async def test_work_that_finishes_returns_its_result_and_leaves_no_cancellation_behind(by_signal: bool) -> None:
    client = Client(by_signal)

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await client.until(work()) == 7
    client.leave()  # a watch left behind would cancel this task now
    await asyncio.sleep(0.01)
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


@WATCHES
async def test_a_disconnect_cancels_the_work_runs_its_clean_up_and_raises_client_disconnected(by_signal: bool) -> None:
    client = Client(by_signal)
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()

    asyncio.get_running_loop().call_later(0.01, client.leave)
    with pytest.raises(ClientDisconnected):
        await client.until(work())
    assert cleaned.is_set()
    if by_signal:
        assert client.receives == 0  # watched without a task reading receive
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation is still pending


async def test_with_a_signal_that_already_fired_the_work_is_cancelled() -> None:
    client = Client(by_signal=True)
    client.leave()
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(client.until(asyncio.sleep(30)), 5)


@WATCHES
async def test_a_cancellation_from_elsewhere_stays_a_cancellation_even_if_the_client_also_left(
    by_signal: bool,
) -> None:
    client = Client(by_signal)
    task = asyncio.ensure_future(client.until(asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    client.leave()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@WATCHES
async def test_a_future_is_left_alone_and_a_result_it_had_is_returned(by_signal: bool) -> None:
    client = Client(by_signal)
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, client.leave)
    with pytest.raises(ClientDisconnected):
        await client.until(pending)
    assert not pending.done()  # someone else owns it

    # The result and the disconnect arrive in the same loop turn: the result is handed over.
    client = Client(by_signal)
    ready: asyncio.Future[int] = loop.create_future()

    def both() -> None:
        client.leave()
        ready.set_result(3)

    loop.call_later(0.01, both)
    assert await client.until(ready) == 3


async def test_a_future_result_the_cancelled_caller_cannot_take_is_discarded() -> None:
    client = Client()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    discarded: list[int] = []
    task = asyncio.ensure_future(client.until(ready, discard=discarded.append))
    await asyncio.sleep(0.01)
    ready.set_result(5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert discarded == [5]


def test_a_signal_runs_each_callback_once_and_not_after_its_watch_stopped() -> None:
    signal = DisconnectSignal()
    calls: list[str] = []
    signal.watch(lambda: calls.append("kept"))
    stop = signal.watch(lambda: calls.append("stopped"))
    stop()
    signal.fire()
    signal.fire()
    assert calls == ["kept"]
    assert signal.fired
