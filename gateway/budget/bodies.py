"""The bound on raw request bodies this process holds (`limits.max_buffered_body_bytes`).

An admission request's body is held whole while it is read, parsed, waits for the media budget and is forwarded.
Every byte of it is taken from this bound before it is read: a body that would pass the bound is not read until
earlier ones end (the client is held by TCP flow control, as nginx's and Envoy's buffer limits hold it), waiting
FIFO for at most `limits.admission_timeout_s` (then a 429 naming the key). A body that declares its length takes
it at once; a chunked body takes `STEP_BYTES` at a time as it arrives. A body larger than the whole bound (with
`limits.max_request_body_bytes` above it, or off) takes the whole bound: it is read alone. A client that leaves
while its body waits leaves the queue once the kernel has its FIN (the rest of its body fit the socket buffers) or
its reset; otherwise its wait ends with its timeout.
"""

from __future__ import annotations

import time

from gateway.budget.base import BODY_BUFFER, BudgetGauges, MediaBudget, Reservation
from gateway.budget.local import LocalBudget, UnlimitedBudget
from gateway.metrics import GatewayMetrics
from gateway.request_info import request_info
from serving.asgi import ClientDisconnected, Receive, Scope, disconnect_signal, until_disconnect
from serving.headers import get_header

# What a chunked body takes from the bound before more of it is read. A server hands the app what its buffer
# holds (uvicorn reads on while it holds under 64 KiB), so a body passes what it took by one read at most.
STEP_BYTES = 1 << 20
# How often a body waiting for room asks its connection whether the client is still there: the server has
# stopped reading it, so it would otherwise learn of the client leaving only once the wait ends.
PROBE_S = 0.25


class BodyBuffer:
    def __init__(self, capacity: int | None, *, timeout_s: float | None, metrics: GatewayMetrics) -> None:
        self.capacity = capacity
        self.budget: MediaBudget = (
            UnlimitedBudget()
            if capacity is None
            else LocalBudget(
                capacity, timeout_s=timeout_s, max_queued=None, name=BODY_BUFFER, gauges=BudgetGauges.bodies(metrics)
            )
        )

    def read(self, scope: Scope, receive: Receive) -> HeldBody:
        """`async with` it: the whole request body, its bytes held against the bound until the block ends."""
        return HeldBody(self, scope, receive)

    async def _read(self, scope: Scope, receive: Receive, held: list[Reservation]) -> bytearray:
        declared = _declared_length(scope)
        taken = 0
        if declared:
            taken = await self._take(scope, receive, declared, taken, held)
        body = bytearray()
        while True:
            if len(body) >= taken and declared is None:
                taken += await self._take(scope, receive, STEP_BYTES, taken, held)
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            body += message.get("body", b"")
            if not message.get("more_body", False):
                return body

    async def _take(self, scope: Scope, receive: Receive, nbytes: int, taken: int, held: list[Reservation]) -> int:
        """Take `nbytes` more for a body that holds `taken`, never more than the whole bound; the bytes taken."""
        if self.capacity is not None:
            nbytes = min(nbytes, self.capacity - taken)
            if nbytes <= 0:
                return 0
        # While it waits, the body is not read: only the protocol's signal tells that the client left.
        reserve = self.budget.reserve(nbytes)
        signal = disconnect_signal(scope)
        info = request_info(scope)
        started = time.perf_counter()
        try:
            reservation = (
                await until_disconnect(reserve, receive, discard=Reservation.release, signal=signal, probe_s=PROBE_S)
                if signal is not None
                else await reserve
            )
        finally:
            info.body_wait_s = (info.body_wait_s or 0.0) + time.perf_counter() - started
        held.append(reservation)
        return nbytes


class HeldBody:
    """What `BodyBuffer.read` gives: a class rather than an `asynccontextmanager`, whose async generator would cost
    every admission request more than the rest of its reading."""

    __slots__ = ("_buffer", "_held", "_receive", "_scope")

    def __init__(self, buffer: BodyBuffer, scope: Scope, receive: Receive) -> None:
        self._buffer = buffer
        self._scope = scope
        self._receive = receive
        self._held: list[Reservation] = []

    async def __aenter__(self) -> bytearray:
        try:
            return await self._buffer._read(self._scope, self._receive, self._held)
        except BaseException:
            self._release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, []
        for reservation in held:
            reservation.release()


def _declared_length(scope: Scope) -> int | None:
    value = get_header(scope["headers"], b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:  # the server refuses such a request before the app sees it
        return None
