"""Limits on what one HTTP/1.1 client may hold open: connections, request-head size and count, head and body timeouts.

`protocol_class(limits)` gives uvicorn's httptools protocol with these limits, for `uvicorn.Config(http=...)`:

- `max_connections`: connections the server holds on one listening port (a second listener, such as the gateway's
  metrics port, has a cap of its own, so clients holding every connection of one port never lock out the other's
  health probe). A connection accepted past the cap is answered at once with a 503 (`connection: close`, nothing
  of its request read) and closed, so a client or load balancer learns immediately and may retry elsewhere; the
  held connections are not disturbed, and new ones are served again as soon as one closes.
- `max_header_bytes`: bytes of one request's head (request line, header lines, the blank line), counted as they
  are read, before the parser buffers them; one byte past it is a 431 and the connection closes. A head that
  begins in the same read as the end of the previous request (pipelining) is, for that read, counted by its
  parsed URL, header names and values; a refusal then follows the answer in progress.
- `max_headers`: header lines of one request; one past it is a 431 and the connection closes.
- `header_timeout_s`: from the connection's start, or its previous response, to the end of the next request's
  head. When it passes with part of a request read, a 408 is sent; on an idle connection nothing is (the client
  may be about to reuse it); either way the connection closes.
- `body_idle_timeout_s`: the longest pause between two pieces of a request body while the server is reading
  (time during which uvicorn's flow control has paused reading, or a client waits for `100 Continue`, does not
  count). When it passes, a 408 is sent if no response has started, the connection closes, and the app's
  pending `receive()` returns `http.disconnect`.
- `body_min_rate` (bytes a second) after `body_rate_grace_s`: a body must keep arriving at least this fast, as
  Apache's mod_reqtimeout `MinRate`: the body may take `body_rate_grace_s` plus one second for every
  `body_min_rate` bytes received, counting only the time the server reads it. A client that sends a byte just
  often enough to pass the idle timeout is ended as the idle timeout ends one.

Each request's scope carries a `serving.asgi.DisconnectSignal` under `DISCONNECT_KEY`, fired when its `receive()`
starts to return `http.disconnect` (the connection lost, or a timeout above ended the request).

`None` turns each off; with all off the protocol behaves as uvicorn's own. What the protocol takes of uvicorn's
internals is in `serving.uvicorn_private`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import httptools
import orjson
from uvicorn import Config

from serving.asgi import DISCONNECT_KEY, DisconnectSignal
from serving.uvicorn_private import (
    STATUS_LINE,
    FlowControl,
    HttpToolsProtocol,
    ServerState,
    disconnected,
    end_request,
    stop_keep_alive,
    upgrades,
)

logger = logging.getLogger("mmgate.http")

# Refused connections are logged at most once per this many seconds, with a count.
REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int | None = None
    max_header_bytes: int | None = None
    max_headers: int | None = None
    header_timeout_s: float | None = None
    body_idle_timeout_s: float | None = None
    body_min_rate: int | None = None
    body_rate_grace_s: float = 10.0


class _Refusal(Exception):
    """Raised from a parser callback to stop parsing; the protocol answers `status` and closes."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _RefusalLog:
    """One warning per interval for connections refused at the cap, however many there were."""

    def __init__(self) -> None:
        self.count = 0
        self.logged_at = -REFUSAL_LOG_INTERVAL_S

    def note(self, held: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("connection cap reached (%d held): refused %d connection(s)", held, self.count)
            self.count = 0
            self.logged_at = now


def _nothing() -> None:
    pass


class _Deadline:
    """A timeout that moves on every request (the head and body timeouts). Moving or dropping it only records the
    new time: the one timer handle behind it is made when none is pending, and when it fires before the recorded
    time it sets itself again for that time. A connection keeps at most one handle per deadline in the loop."""

    __slots__ = ("_at", "_handle", "_loop", "_on_expiry")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self._loop = loop
        self._on_expiry = on_expiry
        self._at: float | None = None
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._at is not None

    def arm(self, seconds: float) -> None:
        self._at = self._loop.time() + seconds
        if self._handle is None:
            self._handle = self._loop.call_at(self._at, self._fire)

    def disarm(self) -> None:
        self._at = None

    def close(self) -> None:
        """For good (the connection is gone): the timer is cancelled and the protocol let go of, so that the
        protocol and this deadline are no reference cycle holding the connection's last request."""
        self._at = None
        self._on_expiry = _nothing
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if self._at is None:
            return
        if self._loop.time() < self._at:
            self._handle = self._loop.call_at(self._at, self._fire)
            return
        self._at = None
        self._on_expiry()


class _ReadingFlow(FlowControl):
    """uvicorn's flow control, telling the protocol whenever reading is paused or resumed, and when reading is
    requested while a body that is not yet being read waits for it (after `100 Continue`)."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedHttpToolsProtocol) -> None:
        super().__init__(transport)
        self._protocol: LimitedHttpToolsProtocol | None = protocol

    def detach(self) -> None:
        """The connection is gone: nothing is news to the protocol any more, and letting go of it leaves the
        protocol and this flow no reference cycle holding the connection's last request."""
        self._protocol = None

    def pause_reading(self) -> None:
        paused = self.read_paused
        super().pause_reading()
        if not paused and self._protocol is not None:
            self._protocol._reading_changed(False)

    def resume_reading(self) -> None:
        # uvicorn asks for reading at every receive and every response: only a change is news to the protocol.
        protocol = self._protocol
        if self.read_paused:
            super().resume_reading()
            if protocol is not None:
                protocol._reading_changed(True)
        elif protocol is not None and protocol._in_body and protocol._reading_since is None:
            protocol._reading_changed(True)


# Linux TCP states (include/net/tcp_states.h) in which the peer has sent its FIN or reset the connection.
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8


def _peer_closed(transport: asyncio.Transport) -> bool:
    """Whether the kernel has the client's FIN or reset for this connection, read from TCP_INFO's state (Linux;
    elsewhere, or for a non-TCP socket, False)."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return False
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, option, 1)[0]
    except OSError:
        return False
    return state in (_TCP_CLOSE, _TCP_CLOSE_WAIT)


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` that enforces `limits` (one class per server)."""
    namespace = {"limits": limits, "refusals": _RefusalLog(), "held": Counter()}
    return cast(
        type[LimitedHttpToolsProtocol], type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), namespace)
    )


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `HttpLimits` (see the module docstring)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    refusals: ClassVar[_RefusalLog] = _RefusalLog()
    # Connections held per local (listening) port.
    held: ClassVar[Counter[int]] = Counter()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._refused = False
        self._listener_port = 0
        # Between the end of one request (or the connection's start) and the end of the next request's head.
        self._in_head = True
        # Some byte of the next request has been parsed.
        self._head_begun = False
        self._head_read = 0
        self._head_parsed = 0
        self._header_count = 0
        # Between the end of a request's head and the end of its body.
        self._in_body = False
        self._head_deadline = _Deadline(self.loop, self._head_timed_out)
        self._body_deadline = _Deadline(self.loop, self._body_timed_out)
        self._rate_deadline = _Deadline(self.loop, self._body_too_slow)
        # The body so far: bytes received, seconds the server read it, and since when it reads (None: paused).
        self._body_received = 0
        self._body_read_s = 0.0
        self._reading_since: float | None = None
        # Body arrived in the read being parsed: its timers are to be armed once the read is parsed.
        self._body_arrived = False
        self._pending_refusal: _Refusal | None = None
        # The limits as numbers (no limit: never passed), so that the parser callbacks compare without a None test.
        self._max_head = math.inf if self.limits.max_header_bytes is None else self.limits.max_header_bytes
        self._max_headers = math.inf if self.limits.max_headers is None else self.limits.max_headers

    # Connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        cap = self.limits.max_connections
        sockname = transport.get_extra_info("sockname")
        self._listener_port = sockname[1] if isinstance(sockname, tuple) else 0
        if cap is not None and self.held[self._listener_port] >= cap:
            self._refused = True
            self.transport = transport
            self.refusals.note(self.held[self._listener_port])
            self._write_error(503, "too many connections")
            return
        self.held[self._listener_port] += 1
        super().connection_made(transport)
        self.flow = _ReadingFlow(transport, self)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.close()
        self._body_deadline.close()
        self._rate_deadline.close()
        if self._refused:
            return
        self.held[self._listener_port] -= 1
        super().connection_lost(exc)
        self._signal_disconnect()
        self._let_go()

    def data_received(self, data: bytes) -> None:
        # After a refusal the parser has stopped; what else arrives is dropped.
        if self._refused or self._pending_refusal is not None or self.transport.is_closing():
            return
        stop_keep_alive(self)
        limit = self.limits.max_header_bytes
        try:
            if limit is None or not self._in_head or self._head_read + len(data) < limit:
                # Most reads: nothing in them can take a head past the limit.
                if self._in_head:
                    self._head_read += len(data)
                self.parser.feed_data(data)
            else:
                self._feed_limited(memoryview(data), limit)
        except _Refusal as refusal:
            self._refuse(refusal)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Refusal):
                self._refuse(exc.__context__)
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)
        except httptools.HttpParserUpgrade:
            if upgrades(self):
                self.handle_websocket_upgrade()
            else:
                self._upgrade_served_as_http()
        else:
            if self._body_arrived:
                # The body timers restart once per read, however many pieces of body the read held.
                self._body_arrived = False
                if self._in_body and not self.flow.read_paused:
                    self._arm_body_timer()
                    self._arm_rate_timer()

    def _feed_limited(self, rest: memoryview, limit: int) -> None:
        """Within a head only what may still belong to it is fed, so an oversized head is never buffered."""
        while rest:
            if not self._in_head:
                self.parser.feed_data(rest)
                return
            piece, rest = rest[: limit - self._head_read], rest[limit - self._head_read :]
            self._head_read += len(piece)
            self.parser.feed_data(piece)
            if self._in_head and self._head_read >= limit:
                # The head has `limit` bytes and has not ended: it is longer than the limit.
                raise self._head_too_large()

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_KEY] = DisconnectSignal(self._probe_peer)  # type: ignore[literal-required]
        self._head_begun = True
        self._head_parsed = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._head_parsed += len(url)
        if self._head_parsed > self._max_head:
            raise self._head_too_large()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._max_headers:
            raise _Refusal(431, f"more than {self.limits.max_headers} headers")
        self._head_parsed += len(name) + len(value) + 4
        if self._head_parsed > self._max_head:
            raise self._head_too_large()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_begun = False
        self._head_deadline.disarm()
        super().on_headers_complete()
        if self.parser.should_upgrade() and upgrades(self):
            return
        self._in_body = True
        self._body_received = 0
        self._body_read_s = 0.0
        self._reading_since = None
        # Before `100 Continue` is sent the client is waiting for the server, not idle.
        if not self.expect_100_continue and not self.flow.read_paused:
            self._reading_since = self.loop.time()
            self._body_arrived = True  # the timers are armed once the read is parsed

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_received += len(body)
        self._body_arrived = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # Out of the body first, so that resuming reading below arms no body timer only to drop it.
        self._in_body = False
        self._body_deadline.disarm()
        self._rate_deadline.disarm()
        if not self.pipeline:
            # The running request's body is whole. uvicorn pauses reading once the unread body passes its
            # high-water mark and resumes it only when `receive()` is called, before that waits: a last piece
            # past the mark, read while the app waits in `receive()`, leaves reading paused, and an app that then
            # watches the `DisconnectSignal` calls `receive()` no more, so the client's leaving would never be
            # seen. (A pipelined request stays paused.)
            self.flow.resume_reading()
        self._in_head = True
        self._head_read = 0

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if pipelined or self.transport.is_closing():
            return
        if self._pending_refusal is not None:
            self._write_error(self._pending_refusal.status, self._pending_refusal.reason)
        else:
            self._arm_head_timer()

    def _upgrade_served_as_http(self) -> None:
        # Where uvicorn warns of a missing websocket library: here WebSocket is off on purpose and the request is
        # served as plain HTTP, so a client sending upgrades cannot fill the log.
        logger.debug("%s: upgrade request served as plain HTTP", self._peer())

    # Limits

    def _head_too_large(self) -> _Refusal:
        return _Refusal(431, f"request head over {self.limits.max_header_bytes} bytes")

    def _reading_changed(self, reading: bool) -> None:
        if not self._in_body:
            return
        if not reading:
            self._body_deadline.disarm()
            if self._reading_since is not None:
                self._body_read_s += self.loop.time() - self._reading_since
                self._reading_since = None
            self._rate_deadline.disarm()
        else:
            if not self._body_deadline.armed:
                self._arm_body_timer()
            if self._reading_since is None:
                self._reading_since = self.loop.time()
            self._arm_rate_timer()

    def _arm_head_timer(self) -> None:
        if self.limits.header_timeout_s is not None:
            self._head_deadline.arm(self.limits.header_timeout_s)

    def _arm_body_timer(self) -> None:
        if self.limits.body_idle_timeout_s is not None:
            self._body_deadline.arm(self.limits.body_idle_timeout_s)

    def _arm_rate_timer(self) -> None:
        """The body may take the grace period plus a second for every `body_min_rate` bytes, of reading time."""
        rate = self.limits.body_min_rate
        if rate is None or self._reading_since is None:
            return
        read = self._body_read_s + self.loop.time() - self._reading_since
        allowed = self.limits.body_rate_grace_s + self._body_received / rate
        self._rate_deadline.arm(max(0.0, allowed - read))

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self._in_head and self._head_begun:
            logger.info("%s: request head not received within %ss: 408", self._peer(), self.limits.header_timeout_s)
            self._write_error(408, "request head not received in time")
        else:
            logger.debug("%s: idle for %ss: closed", self._peer(), self.limits.header_timeout_s)
            self._end_cycle()
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._end_slow_body(
            f"request body paused for over {self.limits.body_idle_timeout_s}s", "request body not received in time"
        )

    def _body_too_slow(self) -> None:
        rate = self.limits.body_min_rate
        self._end_slow_body(
            f"request body slower than {rate} bytes a second after {self.limits.body_rate_grace_s}s",
            f"request body slower than {rate} bytes a second",
        )

    def _end_slow_body(self, logged: str, answer: str) -> None:
        """408 with `answer`, or a close when the response has started already."""
        if self.transport.is_closing():
            return
        answered = self.cycle is not None and self.cycle.response_started
        logger.info("%s: %s: %s", self._peer(), logged, "closed" if answered else "408")
        self._end_cycle()
        if answered:
            self.transport.close()
        else:
            self._write_error(408, answer)

    def _refuse(self, refusal: _Refusal) -> None:
        logger.info("%s: %s: %d", self._peer(), refusal.reason, refusal.status)
        if self.cycle is not None and not self.cycle.response_complete:
            # A request pipelined behind one still being answered: that answer goes out first, then the refusal.
            self._pending_refusal = refusal
            self.flow.pause_reading()
        else:
            self._write_error(refusal.status, refusal.reason)

    def _probe_peer(self) -> None:
        """End the request (and the connection) if the client has closed its end of the connection, which the
        transport does not see while reading is paused with the client's data unread."""
        if not self.transport.is_closing() and _peer_closed(self.transport):
            logger.debug("%s: the client closed the connection while its body was not read", self._peer())
            self._end_cycle()
            self.transport.close()

    def _end_cycle(self) -> None:
        # The app's pending or next `receive()` returns `http.disconnect` and what it sends is dropped.
        if self.cycle is not None and not self.cycle.response_complete:
            end_request(self.cycle)
            self._signal_disconnect()

    def _let_go(self) -> None:
        """Once the connection is gone, drop what refers back to this protocol (the flow control and the last
        request's disconnect signal): while the protocol refers to them, the pair is a reference cycle holding
        the last request's scope, which only the cyclic collector would free."""
        if isinstance(self.flow, _ReadingFlow):
            self.flow.detach()
        signal = self.scope.get(DISCONNECT_KEY) if self.scope is not None else None
        if isinstance(signal, DisconnectSignal):
            signal.detach()

    def _signal_disconnect(self) -> None:
        # The request whose `receive()` now returns `http.disconnect` tells those watching its `DisconnectSignal`.
        if self.cycle is not None and disconnected(self.cycle):
            signal = self.cycle.scope.get(DISCONNECT_KEY)
            if isinstance(signal, DisconnectSignal):
                signal.fire()

    def _write_error(self, status: int, reason: str) -> None:
        body = orjson.dumps({"error": reason})
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"
