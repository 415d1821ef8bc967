"""Running work on a request's media bytes on the media threads (`media.load_workers`).

A thread cannot be stopped from outside, and a decode that runs on after its request is gone holds memory the
budget no longer counts. So work cancelled before it starts never starts; work cancelled while it runs is told to
stop (its `DecodeControl`) and is waited for, so the caller returns, and gives back the budget it holds, only
once the thread has let go of the item. Whatever a client's bytes make a decoder raise is the client's error: a
400 naming the item, never a 500.

Work too small to be worth a hop (the submit, the thread's wake-up, the loop's wake-up for the result cost more CPU
than decoding a tiny image) runs on the calling thread instead, under the same error rules
(`run_here`). Which work is small is the caller's rule, bounded by its own thresholds; work on an item's pixels
stays inline only for a request's only item (its plan's `sole`, gateway/media/plan.py), so what one request runs
on the event loop's thread is one item's bounded work, however many items it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.errors import BadRequest, GatewayError, RequestTooLarge

T = TypeVar("T")


class DecodeCancelled(Exception):
    """The decode was stopped because its request is gone."""


class DeadlinePassed(Exception):
    """The decode ran past its control's timeout."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.timeout_s = timeout_s


class DecodeControl:
    """Stops a running decode from another thread: the decode checks it at every chunk of input it reads."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._cancelled = threading.Event()
        self._deadline: float | None = None

    def cancel(self) -> None:
        """Thread-safe; the running or future decode raises DecodeCancelled at its next check."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Called by the decode at every chunk; the first call starts the deadline (one control per decode)."""
        if self._cancelled.is_set():
            raise DecodeCancelled
        if self.timeout_s is None:
            return
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.timeout_s
        elif now > self._deadline:
            raise DeadlinePassed(self.timeout_s)


async def run_on_worker(
    executor: ThreadPoolExecutor, locator: str, call: Callable[[], T], *, control: DecodeControl | None = None
) -> T:
    """`call()` on a media thread; the item's `locator` names it in errors."""
    future = executor.submit(_as_client_error, locator, call)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not future.cancel():  # already running
            if control is not None:
                control.cancel()
            await _finished(future)
        raise


@dataclass(frozen=True, slots=True)
class Worker:
    """The media threads (`media.load_workers`), as the loaders call them."""

    executor: ThreadPoolExecutor

    async def run(self, locator: str, call: Callable[[], T], *, control: DecodeControl | None = None) -> T:
        return await run_on_worker(self.executor, locator, call, control=control)


def run_here(locator: str, call: Callable[[], T]) -> T:
    """`call()` on the calling thread, its errors turned into the client's as `run_on_worker` turns them."""
    return _as_client_error(locator, call)


async def _finished(future: Future[Any]) -> None:
    """Wait until the thread is done with `future`, through any further cancellation of the caller."""
    waiter = asyncio.wrap_future(future)
    while not waiter.done():
        # `wait` never raises the work's own error here (of no use to a caller that is cancelled): this frame,
        # on that error's traceback and holding the waiter that holds the error, would be a reference cycle.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((waiter,))
    if not waiter.cancelled():
        waiter.exception()  # retrieved, so it is never reported as unhandled


def _as_client_error(locator: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except (GatewayError, DecodeCancelled):
        raise
    except MemoryError:
        raise RequestTooLarge(f"{locator}: decoding this item ran out of memory", reason="media_too_large") from None
    except Exception as exc:
        raise BadRequest(
            f"{locator}: media cannot be decoded ({type(exc).__name__}: {exc})", reason="bad_media"
        ) from exc
