"""Forwarding to the upstream model server: one pooled client session, streaming both ways, SSE untouched.

The client is aiohttp's rather than httpx's: on this path httpx cost 0.95 ms per request against aiohttp's
0.27 ms, and its connection pool scans every pooled connection on each request, so it fell to 2 ms per
request at 16 concurrent streams (measured with tests/bench/bench_proxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp
from yarl import URL

from gateway.config import UpstreamSettings
from gateway.errors import BadGateway, BadRequest, GatewayError, GatewayTimeout
from gateway.metrics import GatewayMetrics
from gateway.request_info import RequestInfo, request_info
from serving.asgi import (
    ClientDisconnected,
    DisconnectSignal,
    Message,
    Receive,
    Scope,
    Send,
    disconnect_signal,
    relay_body,
    until_disconnect,
)
from serving.forwarded import direct_peer
from serving.headers import end_to_end, get_header
from serving.http_client_errors import HTTP_CLIENT_ERRORS, Failure, connect_cause, described, failure_of

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Set by the proxy itself: host from the upstream URL, our request id and forwarding headers.
_HEADERS_WE_SET = frozenset({b"host", b"x-request-id", b"expect", b"x-forwarded-proto", b"x-forwarded-host"})
_HEADERS_WE_SET_WITH_BODY = _HEADERS_WE_SET | {b"content-length"}
# A read body larger than this goes upstream in slices of this size. Given whole, aiohttp joins it to the request
# head (one copy) and the event loop buffers what the socket does not take at once (a second copy).
BODY_SLICE_BYTES = 1 << 20
# aiohttp would add these on its own; a transparent proxy adds none of them.
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def upstream_session(settings: UpstreamSettings, keepalive_s: float = 30.0) -> aiohttp.ClientSession:
    """A pooled session for a trusted upstream: no cookies kept, no decompression, no auto headers."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=settings.max_connections, limit_per_host=0, keepalive_timeout=keepalive_s),
        # No total timeout: a stream may last as long as it keeps sending.
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=settings.pool_timeout_s,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.read_timeout_s,
        ),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=_NO_AUTO_HEADERS,
        trust_env=False,
    )


class UpstreamProxy:
    def __init__(self, settings: UpstreamSettings, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.base_url = str(settings.url).rstrip("/")
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use, inside the server's event loop.
        if self._session is None:
            self._session = upstream_session(self.settings)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        body: bytes | bytearray | Sequence[bytes | memoryview] | None = None,
        on_response: Callable[[], None] | None = None,
    ) -> None:
        """Send the request upstream and relay the answer. `body`: the already-read body, whole or as pieces to send
        in order (else it streams).

        `on_response` runs when the upstream's response headers arrive (its first byte), before relaying.
        A client that leaves before then raises `ClientDisconnected` once the upstream request is closed, and
        `on_response` does not run.
        """
        info = request_info(scope)
        path = scope.get("raw_path") or scope["path"].encode()
        if not path.startswith(b"/"):
            # uvicorn's h11 protocol passes absolute-form and other non-path targets through as the path.
            raise BadRequest(
                f"request target {path.decode('latin-1')!r} cannot be forwarded: "
                "the gateway forwards only targets that are a path starting with '/'"
            )
        # A body that streams upstream has one reader of `receive`, which the disconnect watch and the relay wait
        # behind; otherwise they read `receive` themselves.
        client = _Client(receive) if body is None and _has_body(scope["headers"]) else None
        data: bytes | bytearray | AsyncIterator[bytes | memoryview] | None = None
        listen = receive
        # With the body read (or none), `receive` reports only the client leaving: the protocol's signal says so
        # without a task per wait.
        signal = disconnect_signal(scope)
        if client is not None:
            data = client.body()
            listen = client.receive
            signal = None
        url = self.base_url + path.decode("latin-1")
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        headers = self._request_headers(scope, info, body_known=body is not None)
        upload = None
        if body is not None:
            pieces = [body] if isinstance(body, bytes | bytearray) else body
            size = sum(len(piece) for piece in pieces)
            if size > BODY_SLICE_BYTES:
                headers.append(("content-length", str(size)))
                upload = _Upload(pieces)
                data = upload.slices()
            elif isinstance(body, bytes | bytearray):
                data = body
            else:
                data = b"".join(pieces)
        started = time.perf_counter()
        # encoded=True: the path and query reach the upstream exactly as the client wrote them.
        # A disconnect cancels the request, and aiohttp closes its connection, so the upstream sees it too.
        response = await until_disconnect(
            self._send(scope["method"], URL(url, encoded=True), headers, data, client, upload), listen, signal=signal
        )
        info.upstream_ttfb_s = time.perf_counter() - started
        self.metrics.upstream_ttfb_by(info.route).observe(info.upstream_ttfb_s)
        try:
            if on_response is not None:
                on_response()
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": end_to_end(response.raw_headers),
                }
            )
            await self._relay(response, listen, send, info, signal)
        finally:
            response.close()

    async def _send(
        self,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: bytes | bytearray | AsyncIterator[bytes | memoryview] | None,
        client: _Client | None,
        upload: _Upload | None = None,
    ) -> aiohttp.ClientResponse:
        request = self.session.request(
            method,
            url,
            headers=headers,
            data=data,
            allow_redirects=False,
            compress=None,
            auto_decompress=False,
        )
        try:
            if upload is None:
                return await request
            return await upload.within(request, self.settings.read_timeout_s)
        except UploadStalled:
            raise self._read_timeout("took none of the request body") from None
        except HTTP_CLIENT_ERRORS as exc:
            if client is not None and client.left:
                # The body stopped because the client left; aiohttp reports that as a connection error.
                raise ClientDisconnected from exc
            raise self._request_failure(exc) from exc

    def _read_timeout(self, stalled: str, where: str = "") -> GatewayTimeout:
        """The upstream `stalled` for `upstream.read_timeout_s`: counted, and a 504 naming the key."""
        self.metrics.upstream_errors_by("read_timeout").inc()
        message = f"upstream {self.base_url} {stalled} for upstream.read_timeout_s={self.settings.read_timeout_s:g}"
        return GatewayTimeout(f"{message} {where}" if where else message, reason="upstream_timeout")

    def _request_failure(self, exc: Exception) -> GatewayError:
        label, error = _REQUEST_FAILURES[failure_of(exc)]
        self.metrics.upstream_errors_by(label).inc()
        return error(self, exc)

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        receive: Receive,
        send: Send,
        info: RequestInfo,
        signal: DisconnectSignal | None,
    ) -> None:
        content = response.content
        if content.is_eof():
            # The whole body came with the headers (most small answers): nothing left to wait for.
            await send({"type": "http.response.body", "body": content.read_nowait()})
            return
        try:
            completed = await relay_body(content.iter_any(), receive, send, signal=signal)
        except HTTP_CLIENT_ERRORS as exc:
            if failure_of(exc).timed_out:
                raise self._read_timeout("sent nothing", "in the middle of its response") from exc
            self.metrics.upstream_errors_by("protocol").inc()
            raise BadGateway(f"upstream {self.base_url} broke off its response: {exc}") from exc
        if not completed:
            info.client_disconnected = True

    def _request_headers(self, scope: Scope, info: RequestInfo, *, body_known: bool) -> list[tuple[str, str]]:
        raw = scope["headers"]
        # The chain a trusted proxy sent (TrustedProxies removed any other), then the peer this connection came from.
        client = direct_peer(scope)
        headers: list[tuple[str, str]] = []
        forwarded_for: list[str] = []
        for name, value in end_to_end(raw, drop=_HEADERS_WE_SET_WITH_BODY if body_known else _HEADERS_WE_SET):
            if client and name == b"x-forwarded-for":
                forwarded_for.append(value.decode("latin-1"))
            else:
                headers.append((name.decode("latin-1"), value.decode("latin-1")))
        if client:
            forwarded_for.append(client[0])
            headers.append(("x-forwarded-for", ", ".join(forwarded_for)))
        headers.append(("x-forwarded-proto", scope.get("scheme", "http")))
        host = get_header(raw, b"host")
        if host:
            headers.append(("x-forwarded-host", host.decode("latin-1")))
        headers.append(("x-request-id", info.request_id))
        return headers


def _timed_out(knob: str) -> Callable[[UpstreamProxy, Exception], GatewayError]:
    def error(proxy: UpstreamProxy, exc: Exception) -> GatewayError:
        value = getattr(proxy.settings, knob)
        return GatewayTimeout(
            f"upstream {proxy.base_url} timed out after upstream.{knob}={value:g}", reason="upstream_timeout"
        )

    return error


def _unreachable(proxy: UpstreamProxy, exc: Exception) -> GatewayError:
    return BadGateway(f"upstream {proxy.base_url} unreachable: {connect_cause(exc)}")


def _failed(proxy: UpstreamProxy, exc: Exception) -> GatewayError:
    return BadGateway(f"upstream {proxy.base_url} failed: {described(exc)}")


# A request that got no response: its label in upstream_errors_total and the error the client gets.
_REQUEST_FAILURES: dict[Failure, tuple[str, Callable[[UpstreamProxy, Exception], GatewayError]]] = {
    Failure.CONNECT_TIMEOUT: ("connect_timeout", _timed_out("connect_timeout_s")),
    Failure.READ_TIMEOUT: ("read_timeout", _timed_out("read_timeout_s")),
    Failure.DNS: ("connect", _unreachable),
    Failure.CONNECT: ("connect", _unreachable),
    Failure.PROTOCOL: ("protocol", _failed),
}


class UploadStalled(Exception):
    """The upstream took no slice of the request body for its idle time."""


class _Upload:
    """A read body (its pieces, in order) sent in views of at most `BODY_SLICE_BYTES` (no copy), and when aiohttp
    last took one: aiohttp pulls the next slice once the last is written and drained, and its read timeout starts
    only with the response, so an upstream that stops reading the body is caught here."""

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        self.pieces = pieces
        self.taken_at: float | None = None
        self.sent = False

    async def slices(self) -> AsyncIterator[memoryview]:
        for piece in self.pieces:
            view = memoryview(piece)
            for start in range(0, len(view), BODY_SLICE_BYTES):
                self.taken_at = time.monotonic()
                yield view[start : start + BODY_SLICE_BYTES]
        self.sent = True

    async def within(self, request: Awaitable[T], idle_s: float) -> T:
        """`request`'s result; `UploadStalled` when no slice is taken for `idle_s` before the body is sent.
        (Until the first slice is taken the connect timeout applies.)"""
        task = asyncio.ensure_future(request)
        try:
            while not self.sent:
                waited_from = self.taken_at if self.taken_at is not None else time.monotonic()
                done, _ = await asyncio.wait({task}, timeout=max(0.0, waited_from + idle_s - time.monotonic()))
                if done:
                    return task.result()
                if self.taken_at is not None and not self.sent and time.monotonic() - self.taken_at >= idle_s:
                    raise UploadStalled
            return await task
        finally:
            if not task.done():
                task.cancel()
                # Closing the upstream request runs to its end before the caller goes on.
                with contextlib.suppress(BaseException):
                    await task


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    length = get_header(headers, b"content-length")
    if length is not None:
        return length.strip() != b"0"
    return get_header(headers, b"transfer-encoding") is not None


class _Client:
    """The one reader of the client's `receive` for a forwarded request.

    A streamed request body is read by `body()`, which aiohttp iterates in its own task while it sends the
    request. `receive()`, for the disconnect watch and the response relay, reads nothing until that body has
    ended, so two readers never wait on `receive` at once and neither takes the other's message.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._body_over = asyncio.Event()
        self.left = False  # the client's `http.disconnect` has been read

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    self.left = True
                    # aiohttp aborts the upstream request (its connection closes) rather than end the body.
                    raise ClientDisconnected
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
        finally:
            self._body_over.set()

    async def receive(self) -> Message:
        await self._body_over.wait()
        if self.left:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.left = True
        return message
