"""Who shares a budget: each process names itself (who it is, the model server it fronts) with every renewal, for
three lease TTLs, and leaves when it closes (`lua/members.lua`); the start-up line names who shares it."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from gateway.budget.redis.metrics import Meters
from gateway.budget.redis.scripts import MEMBERS

logger = logging.getLogger(__name__)

# At most this many of the gateways sharing a budget are named in the start-up line.
_NAMED_MEMBERS = 16


class Members:
    """`member` is what this process says of itself, `sharing` what every process present said at its last call."""

    __slots__ = ("_base", "_meters", "_process", "_script", "_ttl_ms", "member", "sharing")

    def __init__(
        self, redis: aioredis.Redis, base: str, process: str, member: str, ttl_ms: int, meters: Meters
    ) -> None:
        self._script = redis.register_script(MEMBERS)
        self._base = base
        self._process = process
        self._ttl_ms = ttl_ms
        self._meters = meters
        self.member = member
        self.sharing: list[str] = []

    async def register(self, *, leaving: bool = False) -> None:
        """Say to the budget that this process shares it (for three lease TTLs), or that it leaves."""
        ttl = 0 if leaving else 3 * self._ttl_ms
        started = time.perf_counter()
        said = await self._script(keys=[self._base], args=[self._process, self.member, ttl])
        self._meters.round_trip("members", time.perf_counter() - started)
        self.sharing = [str(item) for item in said]

    def announce(self, budget: str, safe_url: str) -> None:
        """Log who shares `budget` now, and warn when they front different model servers."""
        sharing = self.sharing
        named = "; ".join(sharing[:_NAMED_MEMBERS])
        more = len(sharing) - _NAMED_MEMBERS
        logger.info(
            "shared media budget %s at %s: %d gateway process%s share%s it now (this one included): %s%s",
            budget,
            safe_url,
            len(sharing),
            "" if len(sharing) == 1 else "es",
            "s" if len(sharing) == 1 else "",
            named,
            f"; and {more} more" if more > 0 else "",
        )
        servers = sorted({said.rpartition(" -> ")[2] for said in sharing})
        if len(servers) > 1:
            logger.warning(
                "gateways in front of different model servers (%s) share the media budget %s: its cap protects no "
                "one server's memory; give each server a budget of its own (redis.scope)",
                ", ".join(servers),
                budget,
            )
