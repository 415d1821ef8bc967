"""The grant listener: each script that grants publishes the granted ticket ids on `<base>:granted`; every process
listens there and hands the reservation to its waiter at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.budget.redis.background import Background
from gateway.budget.redis.leases import Holdings
from gateway.budget.redis.metrics import RedisBudgetStats


class GrantListener:
    """Listens on `channel` while the budget is open, resubscribing after a failure (backing off up to
    `max_backoff_s`, which is also how long one read waits); `subscribed` is set while it is subscribed."""

    def __init__(
        self,
        redis: aioredis.Redis,
        channel: str,
        *,
        holdings: Holdings,
        background: Background,
        stats: RedisBudgetStats,
        max_backoff_s: float,
    ) -> None:
        self._redis = redis
        self._holdings = holdings
        self._background = background
        self._stats = stats
        self.channel = channel
        self.max_backoff_s = max_backoff_s
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        backoff = 0.05
        background = self._background
        while not background.closed:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while not background.closed:
                    message = await pubsub.get_message(timeout=self.max_backoff_s)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self.subscribed.set()
                        backoff = 0.05
                    elif message["type"] == "message":
                        self.on_granted(str(message["data"]).split())
            except (RedisError, OSError):
                self.subscribed.clear()
                self._stats.backend_errors += 1
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.max_backoff_s)

    def on_granted(self, tickets: Sequence[str]) -> None:
        holdings = self._holdings
        for ticket in tickets:
            waiter = holdings.waiters.get(ticket)
            if waiter is not None:
                holdings.hand_over(waiter, by_message=True)
