"""Outermost middleware: the request's path in normal form and its `RequestInfo` (id, route and whether it is an
admission route, for every step inside), request metrics and one JSON log line. Its receive and send are counted by
`serving`'s `Exchange`.

A request that ends is only noted; its metrics and log line follow with those of the other requests that ended
within `SETTLE_S`, at most that long after it ended, or sooner when the metrics are rendered or the gateway stops.
Made one at a time, between requests, they cost several times as much: each one finds the code and data it uses
gone from the processor's caches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import orjson

from gateway.config import OpenAIEnvelope
from gateway.envelopes import dialect_for
from gateway.metrics import KNOWN_ROUTES, GatewayMetrics
from gateway.paths import normalize_scope
from gateway.request_info import SCOPE_KEY, RequestInfo
from gateway.tenants import Tenants
from serving.access_log import (
    ACCESS_LOGGER,
    EndedRequest,
    exchange_fields,
    log_line,
    request_fields,
    request_id,
    round_to_microsecond,
)
from serving.asgi import ASGIApp, Exchange, Receive, Scope, Send

logger = logging.getLogger(ACCESS_LOGGER)

# The gateway's own health endpoints: load balancers and orchestrators poll them.
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})
# How long after a request ends its metrics and log line may wait for those of others (seconds).
SETTLE_S = 0.005


class AccessLog:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: GatewayMetrics,
        openai_envelope: OpenAIEnvelope,
        admission_routes: Collection[str],
        metrics_path: str,
        enabled: bool,
        log_probes: bool = True,
        tenants: Tenants | None = None,
    ) -> None:
        """`admission_routes`: `POST` to one of them is an admission request (`RequestInfo.admission`).
        `tenants`: with fair queueing on, the lines of requests with media name their tenant and band.
        `log_probes` false: requests to `/healthz`, `/readyz` and `metrics_path` are counted in the metrics but
        not logged."""
        self.app = app
        self.metrics = metrics
        self.openai_envelope = openai_envelope
        self.admission_routes = frozenset(admission_routes)
        # The admission routes are labelled by name too: they are the operator's few.
        self.known_routes = frozenset({*KNOWN_ROUTES, metrics_path, *admission_routes})
        self.enabled = enabled
        self.unlogged_paths = frozenset() if log_probes else HEALTH_PATHS | {metrics_path}
        self.tenants = tenants if tenants is not None and tenants.enabled else None
        # Requests ended since the last settle, and the timer that settles them.
        self._ended: list[tuple[RequestInfo, EndedRequest]] = []
        self._settling: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        normal = normalize_scope(scope)  # before anything reads the path
        path: str = scope["path"]
        info = RequestInfo(
            request_id=request_id(scope),
            route=path if path in self.known_routes else "other",
            dialect=dialect_for(path, self.openai_envelope),
            admission=scope["method"] == "POST" and path in self.admission_routes,
            normal_path=normal,
        )
        scope[SCOPE_KEY] = info
        exchange = Exchange(scope, receive, send, header=(b"x-request-id", info.request_id.encode()))
        self.metrics.inflight.inc()
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            exchange.forget(scope)
            self.metrics.inflight.dec()
            info.duration_s = time.perf_counter() - info.started
            if self._settling is None:
                self._settling = asyncio.get_running_loop().call_later(SETTLE_S, self.settle)
            self._ended.append((info, EndedRequest(scope, exchange, info.duration_s)))

    def settle(self) -> None:
        """The metrics and log lines of the requests that ended since the last settle."""
        if self._settling is not None:
            self._settling.cancel()
            self._settling = None
        ended, self._ended = self._ended, []
        for info, request in ended:
            self._finish(info, request)

    def _finish(self, info: RequestInfo, ended: EndedRequest) -> None:
        route = info.route
        metrics = self.metrics
        metrics.requests_by(route, str(ended.status)).inc()
        metrics.request_duration_by(route).observe(ended.duration_s)
        if ended.method in ("POST", "PUT", "PATCH"):
            metrics.request_body_bytes_by(route).observe(ended.body_bytes)
        if info.rejection is not None:
            metrics.rejections_by(route, info.rejection).inc()
        if self.enabled and ended.path not in self.unlogged_paths and logger.isEnabledFor(logging.INFO):
            record = request_fields(ended, started_epoch_s=info.started_epoch_s, request_id=info.request_id)
            record["route"] = route
            record["model"] = info.model
            record |= exchange_fields(ended)
            record["upstream_ttfb_s"] = (
                None if info.upstream_ttfb_s is None else round_to_microsecond(info.upstream_ttfb_s)
            )
            record["rejection"] = info.rejection
            record["error"] = info.error
            if info.client_disconnected:
                record["client_disconnected"] = True
            if info.body_wait_s is not None:
                record["body_wait_s"] = round_to_microsecond(info.body_wait_s)
            if info.media_items:
                record["media_items"] = info.media_items
                record["media_counted_bytes"] = info.media_counted_bytes
                record["budget_wait_s"] = (
                    None if info.budget_wait_s is None else round_to_microsecond(info.budget_wait_s)
                )
                if self.tenants is not None:
                    record |= {"tenant": info.tenant.label, "tenant_id": info.tenant.id, "band": info.band.value}
            log_line(logger, orjson.dumps(record).decode())
