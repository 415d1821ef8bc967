"""Outermost middleware: request id, body/response byte counts, request metrics and one JSON log line."""

from __future__ import annotations

import logging
import time

import orjson

from gateway.config import OpenAIEnvelope
from gateway.envelopes import dialect_for
from gateway.metrics import KNOWN_ROUTES, GatewayMetrics
from gateway.request_info import SCOPE_KEY, RequestInfo
from serving.access_log import ACCESS_LOGGER, CLIENT_CLOSED, request_fields, request_id
from serving.asgi import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(ACCESS_LOGGER)

# The gateway's own endpoints besides the metrics path: load balancers and orchestrators poll them.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class AccessLog:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: GatewayMetrics,
        openai_envelope: OpenAIEnvelope,
        metrics_path: str,
        enabled: bool,
        log_probes: bool = True,
    ) -> None:
        """`log_probes` false: requests to `/healthz`, `/readyz` and `metrics_path` are counted in the metrics
        but not logged."""
        self.app = app
        self.metrics = metrics
        self.openai_envelope = openai_envelope
        self.known_routes = frozenset({*KNOWN_ROUTES, metrics_path})
        self.enabled = enabled
        self.unlogged_paths = frozenset() if log_probes else PROBE_PATHS | {metrics_path}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        info = RequestInfo(
            request_id=request_id(scope),
            route=path if path in self.known_routes else "other",
            dialect=dialect_for(path, self.openai_envelope),
        )
        scope[SCOPE_KEY] = info
        request_id_header = (b"x-request-id", info.request_id.encode())

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                info.body_bytes += len(message.get("body", b""))
            return message

        async def tagging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                info.status = message["status"]
                headers = [h for h in message.get("headers", ()) if h[0] != b"x-request-id"]
                headers.append(request_id_header)
                message["headers"] = headers
            elif message["type"] == "http.response.body":
                info.response_bytes += len(message.get("body", b""))
            await send(message)

        self.metrics.inflight_requests.inc()
        try:
            await self.app(scope, counting_receive, tagging_send)
        finally:
            self.metrics.inflight_requests.dec()
            self._finish(scope, info)

    def _finish(self, scope: Scope, info: RequestInfo) -> None:
        duration = time.perf_counter() - info.started
        status = info.status if info.status is not None else CLIENT_CLOSED
        metrics = self.metrics
        metrics.requests_by(info.route, str(status)).inc()
        metrics.request_duration_by(info.route).observe(duration)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            metrics.request_body_bytes_by(info.route).observe(info.body_bytes)
        if info.rejection is not None:
            metrics.rejections_by(info.route, info.rejection).inc()
        if self.enabled and scope["path"] not in self.unlogged_paths and logger.isEnabledFor(logging.INFO):
            record = request_fields(scope, started_epoch_s=info.started_epoch_s, request_id=info.request_id)
            record |= {
                "route": info.route,
                "model": info.model,
                "status": status,
                "body_bytes": info.body_bytes,
                "response_bytes": info.response_bytes,
                "duration_s": round(duration, 6),
                "upstream_ttfb_s": None if info.upstream_ttfb_s is None else round(info.upstream_ttfb_s, 6),
                "rejection": info.rejection,
                "error": info.error,
            }
            if info.client_disconnected:
                record["client_disconnected"] = True
            if info.media_items:
                record["media_items"] = info.media_items
                record["media_counted_bytes"] = info.media_counted_bytes
                record["budget_wait_s"] = None if info.budget_wait_s is None else round(info.budget_wait_s, 6)
            logger.info(orjson.dumps(record).decode())
