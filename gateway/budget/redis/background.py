"""What a Redis budget runs besides its callers' requests: the calls it makes in the background (abandons, releases,
requeues), on the event loop that first used it, until it closes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class Background:
    """The background calls (tasks, and the replies of releases written without one) and the loop they run on;
    `closed` once the budget closes."""

    __slots__ = ("closed", "loop", "tasks")

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coroutine)
        self.track(task)
        return task

    def track(self, future: asyncio.Future[Any]) -> None:
        """Keep `future` until it is done, for `flush`."""
        self.tasks.add(future)
        future.add_done_callback(self.tasks.discard)

    def call_soon(self, callback: Callable[[str], None], argument: str) -> None:
        """Run `callback(argument)` on the budget's loop: now when called from it, else soon (thread-safe); never
        before the loop is known, nor once the budget or its loop has closed."""
        loop = self.loop
        if loop is None or self.closed or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            callback(argument)
        else:
            loop.call_soon_threadsafe(callback, argument)

    async def flush(self) -> None:
        """Wait for the calls sent in the background so far."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
