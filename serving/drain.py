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
    __slots__ = ("_drain", "_timeout", "cut")

    def __init__(self, drain: Drain) -> None:
        self._drain = drain
        self._timeout: asyncio.Timeout | None = None
        self.cut = False

    def reschedule(self) -> None:
        if self._timeout is not None:
            self._timeout.reschedule(self._drain._when(asyncio.get_running_loop()))

    async def __aenter__(self) -> DrainBound:
        loop = self._drain._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout_at(self._drain._when(loop))
        await self._timeout.__aenter__()
        self._drain._bounds.add(self)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._drain._bounds.discard(self)
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(kind, error, traceback)
        finally:
            # Whatever the handler raised once cancelled (a TimeoutError, or its own error for the cancel),
            # the drain is what ended it.
            self.cut = self._timeout.expired()
