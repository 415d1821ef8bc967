"""The engine's internal HTTP API on Starlette's router, with raw ASGI endpoints (docs/engine.md, "The engine process").

- `POST /internal/v1/requests` — a submit file (`engine_adapter.client.wire`) -> `202 {"id": ...}` once admitted;
  400 malformed or off-geometry, 413 over `server.max_request_body_bytes` or never fitting
  `encoder.max_resident_bytes` / `encoder.max_pending_input_bytes`, 429 pending inputs at their cap, 503 draining.
- `GET /internal/v1/requests/{id}/response` — waits for encoding and the hand-off backend's answer, then relays
  it (status, end-to-end headers, body chunk by chunk). A caller that disconnects cancels the request.
  404 unknown, 409 already claimed, 410 gone (finished, cancelled); the request's own failure comes back as its
  error (500 encoder, 502/504 backend).
- `GET /internal/v1/requests/{id}/embeddings` — the buffer as safetensors once ready, while it exists (410 after).
- `DELETE /internal/v1/requests/{id}` — cancel in any state and free the buffer: `200 {"id", "cancelled",
  "freed_bytes"}` (idempotent; 404 for an id never seen).
- `GET /internal/v1/status` (JSON), `GET /metrics` (Prometheus), `GET /healthz`.

An unknown path, or a path with a method it is not served with, is 404 (never a redirect, no `Allow`); HEAD is
answered on `/healthz` and `/metrics` only. With `server.auth_token` set every call but `/healthz` needs
`Authorization: Bearer <token>`, else 401 (checked before routing).
Every error is `{"error": {"message", "code", "reason"}}` with header `X-Mmgate-Engine-Error: 1`, so a caller
tells the engine's own refusals from an LLM error it relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar

import orjson
from starlette.exceptions import HTTPException
from starlette.routing import Route, Router

from engine_adapter.client.wire import EMBEDDINGS_CONTENT_TYPE
from engine_adapter.config import BackendKind, EngineSettings
from engine_adapter.embeddings_file import embeddings_file
from engine_adapter.engine import Engine
from engine_adapter.errors import BadRequest, EngineError, InternalError, NotFound, TooLarge, Unauthorized, Unavailable
from engine_adapter.jobs import JobState
from engine_adapter.metrics import PROMETHEUS_CONTENT_TYPE
from engine_adapter.reference import reference_models, text_only_response
from engine_adapter.runtime import IterationHook
from serving.app import ServedApp
from serving.asgi import (
    BodyCap,
    ClientDisconnected,
    DisconnectSignal,
    Receive,
    Scope,
    Send,
    disconnect_signal,
    relay_body,
    send_response,
    until_disconnect,
)
from serving.drain import Drain
from serving.errors import ErrorBoundary, ServingError
from serving.headers import RawHeaders, get_header

logger = logging.getLogger("mmgate.engine")

PREFIX = "/internal/v1/requests"
ENGINE_ERROR_HEADER = (b"x-mmgate-engine-error", b"1")
# Answered without the bearer token.
PUBLIC_PATHS = frozenset({"/healthz"})


class EngineApp(ServedApp):
    def __init__(self, settings: EngineSettings, *, on_iteration: IterationHook | None = None) -> None:
        self.settings = settings
        self.engine = Engine(settings, on_iteration=on_iteration)
        token = settings.server.auth_token
        self._expected_auth = None if token is None else f"Bearer {token}".encode()
        self._router = Router(
            self._routes(settings), redirect_slashes=False, default=_no_route, lifespan=self._lifespan
        )
        self.drain = Drain(settings.server.drain_timeout_s)
        self.http = EngineErrorBoundary(self._authorized_route, logger, drain=self.drain)
        self._body_cap = body_cap(settings.server.max_request_body_bytes)

    def _routes(self, settings: EngineSettings) -> list[Route]:
        routes = [
            _route("/healthz", self._healthz, "GET", "HEAD"),
            _route(PREFIX, self._submit, "POST"),
            _route(PREFIX + "/{job_id}", self._cancel, "DELETE"),
            _route(PREFIX + "/{job_id}/response", self._response, "GET"),
            _route(PREFIX + "/{job_id}/embeddings", self._embeddings, "GET"),
            _route("/internal/v1/status", self._status, "GET"),
            _route("/metrics", self._metrics, "GET", "HEAD"),
        ]
        if settings.handoff.backend is BackendKind.REFERENCE:
            # With the reference backend the engine also answers text-only chat itself, as an OpenAI server
            # would: the embedded stack's gateway uses it as its upstream.
            routes.append(_route("/v1/chat/completions", self._reference_chat, "POST"))
            routes.append(_route("/v1/models", self._reference_models, "GET"))
        return routes

    async def handle_lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._router(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: object) -> AsyncIterator[None]:
        await self.startup()
        yield
        await self.shutdown()

    async def startup(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.aclose()

    def start_draining(self) -> None:
        self.engine.start_draining()
        self.drain.start()

    async def _authorized_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] not in PUBLIC_PATHS:
            self._authorize(scope)
        # With `app` in the scope, a route that matches the path but not the method raises Starlette's 405
        # HTTPException instead of answering in plain text.
        scope["app"] = self
        try:
            await self._router(scope, receive, send)
        except HTTPException as exc:
            if exc.status_code != 405:
                raise
            raise NotFound(f"no route {scope['method']} {scope['path']} on the engine") from None

    def _authorize(self, scope: Scope) -> None:
        expected = self._expected_auth
        if expected is None:
            return
        given = get_header(scope["headers"], b"authorization") or b""
        if not hmac.compare_digest(given, expected):
            what = "no Authorization header" if not given else "a wrong bearer token"
            raise Unauthorized(f"the engine needs server.auth_token as a bearer token; the call carried {what}")

    async def _healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, b'{"status":"ok"}')

    async def _status(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, orjson.dumps(self.engine.status()))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, self.engine.metrics.render(), content_type=PROMETHEUS_CONTENT_TYPE.encode())

    async def _submit(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._body_cap.read(scope, receive)
        except EngineError as error:
            self.engine.count_rejection(error.reason)
            raise
        job = await self.engine.submit(body)
        del body
        await send_response(
            send, 202, orjson.dumps({"id": job.id}), headers=[(b"x-request-id", job.request_id.encode())]
        )

    async def _response(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        job_id = _job_id(scope)
        signal = await self._body_read(scope, receive)
        job = engine.claim(job_id)
        try:
            result = await until_disconnect(job.outcome, receive, signal=signal)
        except ClientDisconnected:
            engine.cancel(job, "the caller of /response disconnected")
            raise
        if isinstance(result, EngineError):
            engine.finish(job, f"failed: {result.message}")
            raise result
        job.state = JobState.RELAYING
        headers = list(result.headers)
        if get_header(headers, b"x-request-id") is None:
            headers.append((b"x-request-id", job.request_id.encode()))
        completed = False
        try:
            await send({"type": "http.response.start", "status": result.status, "headers": headers})
            completed = await relay_body(result.chunks(), receive, send, signal=signal)
        finally:
            await result.aclose()
            if completed:
                engine.finish(job, "completed")
            else:
                engine.cancel(job, "the caller of /response disconnected mid-response, or the backend broke off")

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        job_id = _job_id(scope)
        signal = await self._body_read(scope, receive)
        job = engine.lookup(job_id)
        tensor, offsets = await until_disconnect(engine.embeddings(job), receive, signal=signal)
        data = await asyncio.to_thread(embeddings_file, tensor, offsets)
        del tensor
        await send_response(
            send,
            200,
            data,
            content_type=EMBEDDINGS_CONTENT_TYPE.encode(),
            headers=[(b"x-request-id", job.request_id.encode())],
        )

    async def _cancel(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        job_id = _job_id(scope)
        job = engine.jobs.get(job_id)
        if job is None:
            if engine.tombstones.get(job_id) is None:
                raise NotFound(f"no request {job_id} on this engine")
            body = {"id": job_id, "cancelled": False, "freed_bytes": 0}
        else:
            body = {"id": job_id, "cancelled": True, "freed_bytes": engine.cancel(job, "DELETE by the caller")}
        await send_response(send, 200, orjson.dumps(body))

    async def _reference_chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body_cap.read(scope, receive)
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed") from None
        if not isinstance(document, dict):
            raise BadRequest("request body must be a JSON object", reason="malformed")
        request_id = (get_header(scope["headers"], b"x-request-id") or uuid.uuid4().hex.encode()).decode("latin-1")
        answer = text_only_response(document, request_id)
        await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
        await relay_body(answer.chunks(), receive, send, signal=disconnect_signal(scope))

    async def _body_read(self, scope: Scope, receive: Receive) -> DisconnectSignal | None:
        """The request's `DisconnectSignal`, once its body is read: a GET's is empty, and one sent all the same is
        read under `server.max_request_body_bytes` and dropped. From then on `receive` reports only the client
        leaving, which the signal tells without a task per wait."""
        await self._body_cap.read(scope, receive)
        return disconnect_signal(scope)

    async def _reference_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The reference responder answers any model name; it lists the name it answers with when given none.
        await send_response(send, 200, orjson.dumps(reference_models()))


class EngineErrorBoundary(ErrorBoundary[EngineError]):
    """Every error is `{"error": {"message", "code", "reason"}}` with `X-Mmgate-Engine-Error: 1`."""

    handles: ClassVar[type[ServingError]] = EngineError
    error_headers: ClassVar[RawHeaders] = [ENGINE_ERROR_HEADER]

    def render(self, scope: Scope, error: EngineError) -> bytes:
        return error.body()

    def internal_error(self, scope: Scope) -> EngineError:
        return InternalError(f"internal engine error on {scope['method']} {scope['path']}")

    def drain_cut(self, scope: Scope) -> EngineError:
        timeout = self.drain.timeout_s if self.drain is not None else 0.0
        return Unavailable(
            f"the engine shut down before {scope['method']} {scope['path']} finished "
            f"(server.drain_timeout_s={timeout:g})",
            reason="drain_timeout",
        )


Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Endpoint:
    """A handler as a raw ASGI endpoint: Starlette's `Route` would wrap a plain function or method as
    `request -> response`, and the handlers stream and watch for disconnects on `receive` themselves."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def _route(path: str, handler: Handler, *methods: str) -> Route:
    route = Route(path, _Endpoint(handler), methods=methods)
    # Starlette adds HEAD to every GET route; the engine answers HEAD only where it is listed.
    route.methods = set(methods)
    return route


def _job_id(scope: Scope) -> str:
    job_id: str = scope["path_params"]["job_id"]
    return job_id


async def _no_route(scope: Scope, receive: Receive, send: Send) -> None:
    raise NotFound(f"no route {scope['method']} {scope['path']} on the engine")


def _too_large(message: str) -> TooLarge:
    return TooLarge(message, reason="body_too_large")


def _malformed(message: str) -> BadRequest:
    return BadRequest(message, reason="malformed")


def body_cap(max_bytes: int) -> BodyCap:
    """`server.max_request_body_bytes`: 413 by Content-Length before a byte is read, else as soon as the count
    passes it; 400 for a malformed Content-Length."""
    return BodyCap(max_bytes, "server.max_request_body_bytes", _too_large, _malformed)
