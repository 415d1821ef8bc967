"""The drain deadline: once a process starts draining, the requests in flight have `server.drain_timeout_s` to
finish; past it each one is cut (cancelled at its next await) so that its `ErrorBoundary` answers it, before
uvicorn's own shutdown timeout would cancel it with a plain-text 500 and a traceback."""

from __future__ import annotations

import asyncio
import time

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
        """Bound the running task's handling of one request: `leave` it when the handling ends; `cut` says whether
        the drain deadline ended it."""
        return DrainBound(self)

    def _when(self, loop: asyncio.AbstractEventLoop) -> float | None:
        if self._deadline is None:
            return None
        return loop.time() + (self._deadline - time.monotonic())

    def _reschedule(self) -> None:
        for bound in list(self._bounds):
            bound.reschedule()


class DrainBound:
    """One request's handling, cut at the drain deadline: its task is cancelled then, and `leave` tells that
    cancellation from any other, as `asyncio.timeout` does. Until the drain starts it sets no timer: a request
    costs a set entry. Plain calls rather than `async with`: it is entered for every request."""

    __slots__ = ("_cancelling", "_drain", "_handle", "_task", "cut")

    def __init__(self, drain: Drain) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a DrainBound must be made inside a task")
        self._drain = drain
        self._task = task
        self._cancelling = task.cancelling()
        self._handle: asyncio.Handle | None = None
        self.cut = False
        drain._loop = task.get_loop()
        drain._bounds.add(self)
        if drain._deadline is not None:
            self.reschedule()

    def reschedule(self) -> None:
        """Set the timer for the drain deadline (on the request's loop)."""
        if self.cut:
            return
        task = self._task
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
        self._task.cancel()

    def leave(self, error: BaseException | None) -> bool:
        """The handling ended, with `error` (None: it returned). True when `error` is the drain's cancellation and
        no other: it is taken back, and the caller answers as for a cut. Whatever the handler raised once cut (its
        own error for the cancel, say), `cut` stays true."""
        self._drain._bounds.discard(self)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        return self.cut and self._task.uncancel() <= self._cancelling and isinstance(error, asyncio.CancelledError)
