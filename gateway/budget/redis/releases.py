"""Giving leases back to Redis: a release is written at once on the scripts' connection and its reply handled in a
callback; without a connection up, or when the written release fails, a task makes the call with its retry, and a
release Redis did not answer is sent again at each heartbeat until it does."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from gateway.budget.redis.background import Background
from gateway.budget.redis.client import BudgetMisconfigured, ScriptClient, Unavailable


class Releases:
    """Sends the releases of leases given back in this process; `unreleased` are those Redis did not answer (no
    longer renewed, so at worst they expire)."""

    __slots__ = ("_background", "_client", "unreleased")

    def __init__(self, client: ScriptClient, background: Background) -> None:
        self._client = client
        self._background = background
        self.unreleased: set[str] = set()

    def send(self, lease_id: str) -> None:
        """Release `lease_id`, from any thread; once the budget has closed the lease expires on its own."""
        self._background.call_soon(self._write, lease_id)

    async def retry(self) -> None:
        """Send the releases Redis did not answer again, until one fails."""
        for lease_id in list(self.unreleased):
            try:
                await self._client.call("release", lease_id)
            except (Unavailable, BudgetMisconfigured):
                return
            self.unreleased.discard(lease_id)

    def _write(self, lease_id: str) -> None:
        if self._background.closed:
            return
        client = self._client
        reply = client.send("release", lease_id)
        if reply is None:
            self._background.spawn(self._call(lease_id))
            return
        started = time.perf_counter()

        def answered(reply: asyncio.Future[Any]) -> None:
            if reply.cancelled() or reply.exception() is not None:
                self._background.spawn(self._call(lease_id))
            else:
                client.meters.round_trip("release", time.perf_counter() - started)
                with contextlib.suppress(BudgetMisconfigured):  # logged; the lease expires on its own
                    client.on_reply(reply.result())

        self._background.track(reply)
        reply.add_done_callback(answered)

    async def _call(self, lease_id: str) -> None:
        # Releasing a lease that has gone does nothing, so a retry is always safe.
        try:
            await self._client.call("release", lease_id)
        except (Unavailable, BudgetMisconfigured):
            self.unreleased.add(lease_id)
