"""The bound on raw request bodies this process holds (`limits.max_buffered_body_bytes`).

An admission request's body is held whole while it is read, parsed, waits for the media budget and is forwarded.
Every byte of it is taken from this bound before it is read: a body that would pass the bound is not read until
earlier ones end (the client is held by TCP flow control, as nginx's and Envoy's buffer limits hold it), waiting
FIFO for at most `limits.admission_timeout_s` (then a 429 naming the key). A body that declares its length takes
it at once; a chunked body takes `STEP_BYTES` at a time as it arrives. A body larger than the whole bound (with
`limits.max_request_body_bytes` above it, or off) takes the whole bound: it is read alone. A client that leaves
while its body waits leaves the queue once the kernel has its FIN (the rest of its body fit the socket buffers) or
its reset; otherwise its wait ends with its timeout.

A body's room is kept in a `BodyHold` its request passes in, with the time it waited for it; what parsing the body
allocates is kept in another, released when the parsed body is gone. The bound queues on a `LocalBudget` of its own
(one tenant): it is not the media budget, which a request with media reserves after its body is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.budget.base import BODY_BUFFER, BudgetGauges, Reservation
from gateway.budget.local import LocalBudget
from gateway.config import Band
from gateway.errors import RequestTooLarge
from gateway.metrics import GatewayMetrics
from serving.asgi import ClientDisconnected, Receive, Scope, disconnect_signal, until_disconnect
from serving.headers import get_header

# What a chunked body takes from the bound before more of it is read. A server hands the app what its buffer
# holds (uvicorn reads on while it holds under 64 KiB), so a body passes what it took by one read at most.
STEP_BYTES = 1 << 20
# A body read has its parse waiting ahead of every body not yet read (bands are served in that order): behind them
# in one queue, a small parse would wait for room that only its own request's end can give, while the bodies ahead
# of it wait for that room too.
_PARSE = Band.INTERACTIVE
_READ = Band.BATCH
# How often a body waiting for room asks its connection whether the client is still there: the server has
# stopped reading it, so it would otherwise learn of the client leaving only once the wait ends.
PROBE_S = 0.25


@dataclass(slots=True)
class BodyHold:
    """What one request holds of the bound (its body, or what parsing it allocates) and the seconds it waited for
    room: None until it takes some of a bound that is on."""

    reservations: list[Reservation] = field(default_factory=list)
    wait_s: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(reservation.nbytes for reservation in self.reservations)

    def release(self) -> None:
        for reservation in self.reservations:
            reservation.release()
        self.reservations.clear()


def wait_s(*holds: BodyHold) -> float | None:
    """The seconds `holds` waited for room in all; None where none took any of the bound."""
    waits = [hold.wait_s for hold in holds if hold.wait_s is not None]
    return sum(waits) if waits else None


class BodyBuffer:
    def __init__(self, capacity: int | None, *, timeout_s: float | None, metrics: GatewayMetrics) -> None:
        self.capacity = capacity
        self.budget: LocalBudget | None = (
            None
            if capacity is None
            else LocalBudget(
                capacity,
                timeout_s=timeout_s,
                batch_timeout_s=timeout_s,
                max_queued=None,
                name=BODY_BUFFER,
                gauges=BudgetGauges.bodies(metrics),
                one_tenant=True,
            )
        )

    @property
    def in_use(self) -> int:
        return 0 if self.budget is None else self.budget.in_use

    @property
    def waiting(self) -> int:
        return 0 if self.budget is None else self.budget.waiting

    async def read(self, scope: Scope, receive: Receive, hold: BodyHold) -> bytearray:
        """The whole request body, its bytes held against the bound in `hold`, which the caller releases when the
        request ends, whatever happens here."""
        declared = _declared_length(scope)
        taken = 0
        if declared:
            now = self._take_now(declared, taken, hold)
            taken = now if now is not None else await self._wait(scope, receive, declared, taken, hold)
        body = bytearray()
        while True:
            if len(body) >= taken and declared is None:
                now = self._take_now(STEP_BYTES, taken, hold)
                taken += now if now is not None else await self._wait(scope, receive, STEP_BYTES, taken, hold)
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            body += message.get("body", b"")
            if not message.get("more_body", False):
                return body

    async def take(
        self, scope: Scope, receive: Receive, nbytes: int, hold: BodyHold, *, holding: int, what: str
    ) -> None:
        """Hold `nbytes` more in `hold` for a request that already holds `holding` bytes of the bound (its body),
        waiting for room as a body does: what parsing its body allocates. Past what the bound leaves the request,
        a 413 naming it."""
        if self.capacity is not None and holding + nbytes > self.capacity:
            raise RequestTooLarge(
                f"{what} would hold about {nbytes:,} bytes beside the body's {holding:,}, over this process's share "
                f"of limits.max_buffered_body_bytes ({self.capacity:,} bytes)",
                reason="body_too_large",
            )
        if self._take_now(nbytes, 0, hold) is None:
            await self._wait(scope, receive, nbytes, 0, hold, band=_PARSE)

    def _size(self, nbytes: int, taken: int) -> int:
        """What a body that holds `taken` takes when it asks for `nbytes` more: never more than the whole bound."""
        return nbytes if self.capacity is None else min(nbytes, self.capacity - taken)

    def _take_now(self, nbytes: int, taken: int, hold: BodyHold) -> int | None:
        """Take `nbytes` more at once if they are free and nobody waits: the bytes taken; None when they must be
        waited for (`_wait`)."""
        budget = self.budget
        if budget is None:
            return nbytes
        nbytes = self._size(nbytes, taken)
        if nbytes <= 0:
            return 0
        reservation = budget.try_reserve(nbytes)
        if reservation is None:
            return None
        hold.wait_s = hold.wait_s or 0.0
        hold.reservations.append(reservation)
        return nbytes

    async def _wait(
        self, scope: Scope, receive: Receive, nbytes: int, taken: int, hold: BodyHold, *, band: Band = _READ
    ) -> int:
        """Wait for `nbytes` more: the bytes taken."""
        assert self.budget is not None
        nbytes = self._size(nbytes, taken)
        # While it waits, the body is not read: only the protocol's signal tells that the client left.
        reserve = self.budget.reserve(nbytes, band=band)
        signal = disconnect_signal(scope)
        started = time.perf_counter()
        try:
            reservation = (
                await until_disconnect(reserve, receive, discard=Reservation.release, signal=signal, probe_s=PROBE_S)
                if signal is not None
                else await reserve
            )
        finally:
            hold.wait_s = (hold.wait_s or 0.0) + time.perf_counter() - started
        hold.reservations.append(reservation)
        return nbytes


def _declared_length(scope: Scope) -> int | None:
    value = get_header(scope["headers"], b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:  # the server refuses such a request before the app sees it
        return None
