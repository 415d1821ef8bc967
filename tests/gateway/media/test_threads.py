"""Work on media threads: cancelled work never starts or is stopped and waited for; client bytes never 500, on a
media thread or on the calling thread; the sole-item mark holds in its task only."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.threads import DecodeCancelled, DecodeControl, run_here, run_on_worker

T = TypeVar("T")
WHERE = ["media thread", "here"]


async def run(where: str, executor: ThreadPoolExecutor, locator: str, call: Callable[[], T]) -> T:
    if where == "here":
        return run_here(locator, call)
    return await run_on_worker(executor, locator, call)


async def test_work_cancelled_while_queued_never_starts() -> None:
    executor = ThreadPoolExecutor(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        first = asyncio.ensure_future(run_on_worker(executor, "a", lambda: gate.wait(5)))
        second = asyncio.ensure_future(run_on_worker(executor, "b", lambda: ran.append("b")))
        await asyncio.sleep(0.05)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        gate.set()
        assert await first is True
        await asyncio.sleep(0.05)
        assert ran == []
    finally:
        executor.shutdown()


async def test_work_cancelled_while_running_is_stopped_and_waited_for() -> None:
    executor = ThreadPoolExecutor(1)
    control = DecodeControl(None)
    started = threading.Event()
    finished: list[float] = []

    def decode() -> None:
        started.set()
        try:
            while True:  # a decode that checks its control at every chunk
                control.check()
                time.sleep(0.01)
        finally:
            time.sleep(0.1)  # letting go of its buffers takes a while
            finished.append(time.monotonic())

    try:
        task = asyncio.ensure_future(run_on_worker(executor, "a", decode, control=control))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        returned = time.monotonic()
        # The caller got its cancellation only once the thread had finished with the item.
        assert finished
        assert finished[0] <= returned
    finally:
        executor.shutdown()


async def test_a_second_cancellation_does_not_cut_the_wait_short() -> None:
    executor = ThreadPoolExecutor(1)
    release = threading.Event()
    done = threading.Event()

    def stubborn() -> None:
        release.wait(5)  # no control to stop it: it must be waited for
        done.set()

    try:
        task = asyncio.ensure_future(run_on_worker(executor, "a", stubborn))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set()
    finally:
        executor.shutdown()


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    "error",
    [TypeError("bad"), IndexError("x"), ZeroDivisionError(), KeyError("k"), EOFError(), RuntimeError("r"), OSError()],
)
async def test_whatever_a_decoder_raises_on_client_bytes_is_a_400_naming_the_item(error: Exception, where: str) -> None:
    def fail() -> None:
        raise error

    with ThreadPoolExecutor(1) as executor, pytest.raises(BadRequest) as raised:
        await run(where, executor, "messages[0].content[1].image_url", fail)
    assert raised.value.message.startswith("messages[0].content[1].image_url: media cannot be decoded")
    assert type(error).__name__ in raised.value.message


@pytest.mark.parametrize("where", WHERE)
async def test_memory_error_is_a_413_and_gateway_errors_pass_through(where: str) -> None:
    def out_of_memory() -> None:
        raise MemoryError

    def too_large() -> None:
        raise RequestTooLarge("over limits.x=1")

    def cancelled() -> None:
        raise DecodeCancelled

    with ThreadPoolExecutor(1) as executor:
        with pytest.raises(RequestTooLarge, match="ran out of memory"):
            await run(where, executor, "item", out_of_memory)
        with pytest.raises(RequestTooLarge, match=r"over limits\.x=1"):
            await run(where, executor, "item", too_large)
        with pytest.raises(DecodeCancelled):
            await run(where, executor, "item", cancelled)
    assert run_here("item", threading.current_thread) is threading.current_thread()
