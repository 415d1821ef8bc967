"""The script client: runs the budget's scripts with what every call carries (the cap, the lease TTL, the epoch
this process knows, the fairness window and the tenant bound) and keeps the cluster's state from their replies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from gateway.budget.redis.metrics import Meters
from gateway.budget.redis.scripts import OWN
from gateway.budget.redis_pipeline import ScriptRunner
from gateway.errors import ServiceUnavailable

logger = logging.getLogger(__name__)


class BudgetBackendUnavailable(ServiceUnavailable):
    """The shared media budget's Redis does not answer (`redis.on_unavailable: reject`, or at start-up)."""

    default_reason = "budget_unavailable"
    public = "the shared media budget does not answer"


class BudgetMisconfigured(BudgetBackendUnavailable):
    """The shared budget under this key prefix has another cap than this gateway's."""

    default_reason = "budget_misconfigured"
    public = "the shared media budget is misconfigured"


class Unavailable(Exception):
    """A Redis call failed; carries the cause."""


class ScriptClient:
    """Calls the scripts through `scripts` (pipelined on a connection of their own). After each reply:
    `cluster_in_use`, `cluster_waiting` and `cluster_tenants` are the whole cluster's, `next_expiry_at` (loop time)
    when the earliest lease or ticket in Redis expires, `backend_ok` whether Redis answered, `misconfigured` the
    cap mismatch while Redis reports one. `on_state_lost()` is called when a reply names another epoch than the one
    this process knew: Redis lost the state, and the leases this process holds must be re-asserted."""

    def __init__(
        self,
        scripts: ScriptRunner,
        *,
        capacity: int,
        key_prefix: str,
        safe_url: str,
        lease_ttl_s: float,
        socket_timeout_s: float,
        window_s: float,
        max_tenants: int,
        meters: Meters,
        on_state_lost: Callable[[], None],
    ) -> None:
        self.scripts = scripts
        self.capacity = capacity
        self.key_prefix = key_prefix
        self.safe_url = safe_url
        self.ttl_ms = max(1, round(lease_ttl_s * 1000))
        # How long an abandoned id stays refused: past any reserve call of it still on its way.
        self.tombstone_ms = 2 * self.ttl_ms + round(4000 * socket_timeout_s)
        self.window = repr(float(window_s))
        self.max_tenants = max_tenants
        self.meters = meters
        self.on_state_lost = on_state_lost
        self.cluster_in_use = 0
        self.cluster_waiting = 0
        self.cluster_tenants = 0  # tenant records in Redis
        self.next_expiry_at: float | None = None
        self.backend_ok = True  # the last call to Redis answered
        self.misconfigured: str | None = None
        # The epoch of the budget's record in Redis as of the last reply ("" before the first). Another one in a
        # reply means Redis lost the state: the next renewal, still naming the old epoch, re-asserts the leases.
        self.epoch = ""
        self.epoch_changed = False

    async def call(self, name: str, *args: str | int) -> list[Any]:
        """The reply of script `name`; `Unavailable` when Redis does not answer, `BudgetMisconfigured` when it holds
        another cap."""
        started = time.perf_counter()
        try:
            reply = await self.scripts(name, *self._common(), *args)
        except (RedisError, OSError) as exc:
            self.meters.stats.backend_errors += 1
            self.backend_ok = False
            self.meters.round_trip(name, time.perf_counter() - started)
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc
        self.meters.round_trip(name, time.perf_counter() - started)
        return self.on_reply(reply)

    def send(self, name: str, *args: str | int) -> asyncio.Future[Any] | None:
        """Write the call now and return the future of its raw reply (for `on_reply`); None when no connection is
        up (then `call` it)."""
        return self.scripts.send(name, *self._common(), *args)

    async def abandon(self, ticket: str) -> list[Any] | None:
        """The abandon script's own answers, or None when Redis did not answer: then the ticket (or the lease it
        was granted) expires on its own."""
        try:
            reply = await self.call("abandon", ticket, self.tombstone_ms)
        except (Unavailable, BudgetMisconfigured):
            return None
        return reply[OWN:]

    def reasserted(self, epoch: str) -> None:
        """A heartbeat named the epoch this process knew and Redis re-asserted its leases under `epoch`."""
        self.epoch, self.epoch_changed = epoch, False

    def on_reply(self, reply: Any) -> list[Any]:
        """Take the cluster's state from a script's reply; `BudgetMisconfigured` when Redis holds another cap."""
        self.backend_ok = True
        answer: list[Any] = list(reply)
        if answer[0] == "cap":
            raise self._mismatch(int(answer[1]))
        self.misconfigured = None
        epoch = str(answer[5])
        stats = self.meters.stats
        if not self.epoch:
            self.epoch = epoch
        elif epoch != self.epoch and not self.epoch_changed:
            self.epoch_changed = True
            stats.state_losses += 1
            self.on_state_lost()
        self.cluster_in_use = int(answer[0])
        self.cluster_waiting = int(answer[1])
        next_expiry_ms = int(answer[2])
        self.next_expiry_at = (
            None if next_expiry_ms < 0 else asyncio.get_running_loop().time() + next_expiry_ms / 1000 + 0.002
        )
        stats.leases_reaped += int(answer[3])
        stats.tickets_reaped += int(answer[4])
        if int(answer[6]) >= 0:  # counted by the heartbeat and the snapshot
            self.cluster_tenants = int(answer[6])
        stats.tenant_evictions += int(answer[7])
        return answer

    def _common(self) -> tuple[str | int, ...]:
        """ARGV[1..5] of every script."""
        return self.capacity, self.ttl_ms, self.epoch, self.window, self.max_tenants

    def _mismatch(self, stored: int) -> BudgetMisconfigured:
        message = (
            f"the shared media budget {self.key_prefix!r} has a cap of {stored:,} bytes and this gateway "
            f"{self.capacity:,} (limits.max_multimodal_cpu_bytes): every gateway sharing a budget needs the same "
            "cap (stop the others, or give this one its own redis.key_prefix or redis.scope)"
        )
        if self.misconfigured != message:
            logger.error("%s", message)
        self.misconfigured = message
        return BudgetMisconfigured(message)
