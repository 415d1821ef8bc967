"""The drain deadline: once a process starts draining, the requests in flight have `server.drain_timeout_s` to
finish; past it each one is cut (cancelled at its next await) so that its `ErrorBoundary` answers it, before
uvicorn's own shutdown timeout would cancel it with a plain-text 500 and a traceback."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

# How long after the drain deadline uvicorn still waits: time for the cut requests' answers to go out.
CUT_MARGIN_S = 2.0


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline: float | None = None  # time.monotonic()
        self._bounds: set[DrainBound] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the bounded requests run on

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def start(self) -> None:
        """Start the clock. Safe to call from a signal handler or another thread: the bounds move on their loop."""
        if self._deadline is not None:
            return
        self._deadline = time.monotonic() + self.timeout_s
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._reschedule)

    def bound(self) -> DrainBound:
        """`async with drain.bound() as bound:` around one request's handling; `bound.cut` afterwards says
        whether the drain deadline ended it."""
        return DrainBound(self)

    def _when(self, loop: asyncio.AbstractEventLoop) -> float | None:
        if self._deadline is None:
            return None
        return loop.time() + (self._deadline - time.monotonic())

    def _reschedule(self) -> None:
        for bound in list(self._bounds):
            bound.reschedule()


class DrainBound:
    """One request's handling, cut at the drain deadline: its task is cancelled then, and `async with` turns that
    cancellation into a TimeoutError, as `asyncio.timeout` does. Until the drain starts it sets no timer: a request
    costs a set entry."""

    __slots__ = ("_cancelling", "_drain", "_handle", "_task", "cut")

    def __init__(self, drain: Drain) -> None:
        self._drain = drain
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._handle: asyncio.Handle | None = None
        self.cut = False

    def reschedule(self) -> None:
        """Set the timer for the drain deadline (on the request's loop)."""
        task = self._task
        if task is None or self.cut:
            return
        if self._handle is not None:
            self._handle.cancel()
        loop = task.get_loop()
        when = self._drain._when(loop)
        if when is None:
            self._handle = None
        elif when <= loop.time():
            self._handle = loop.call_soon(self._expire)
        else:
            self._handle = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._handle = None
        self.cut = True
        assert self._task is not None
        self._task.cancel()

    async def __aenter__(self) -> DrainBound:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("DrainBound must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        drain = self._drain
        drain._loop = task.get_loop()
        drain._bounds.add(self)
        if drain._deadline is not None:
            self.reschedule()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._drain._bounds.discard(self)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Whatever the handler raised once cancelled (a TimeoutError, or its own error for the cancel), the drain is
        # what ended it (`cut`); a cancellation that is only the drain's leaves as a TimeoutError.
        if (
            self.cut
            and self._task is not None
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from error
