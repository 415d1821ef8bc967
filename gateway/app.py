"""The gateway's ASGI application: its own endpoints, the admission routes, and everything else proxied."""

from __future__ import annotations

import logging

from gateway.access_log import AccessLog
from gateway.admission import Admission
from gateway.asgi import Receive, Scope, Send, send_response
from gateway.body_limit import RawBodyLimit
from gateway.config import GatewaySettings
from gateway.exception_middleware import ExceptionMiddleware
from gateway.health import Health
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.proxy import UpstreamProxy

logger = logging.getLogger("mmgate.gateway")


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.proxy = UpstreamProxy(settings.upstream, self.metrics)
        self.health = Health(lambda: self.proxy.session, settings.upstream)
        self.admission = Admission(self.proxy)
        self.metrics_path = settings.server.metrics_path
        self.admission_routes = frozenset(settings.limits.admission_routes)
        limited = RawBodyLimit(
            self._route,
            max_bytes=settings.limits.max_request_body_bytes,
            routes=settings.limits.admission_routes,
        )
        self._http = AccessLog(
            ExceptionMiddleware(limited),
            metrics=self.metrics,
            openai_envelope=settings.errors.openai_envelope,
            metrics_path=self.metrics_path,
            enabled=settings.server.access_log,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:  # websocket: nothing the gateway fronts speaks it
            await receive()
            await send({"type": "websocket.close", "code": 1003})

    def start_draining(self) -> None:
        """From now on `/readyz` says 503 so that load balancers stop sending new work."""
        self.health.draining = True

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        if method == "POST" and path in self.admission_routes:
            await self.admission(scope, receive, send)
        elif method in ("GET", "HEAD") and path == "/healthz":
            await self.health.healthz(scope, receive, send)
        elif method in ("GET", "HEAD") and path == "/readyz":
            await self.health.readyz(scope, receive, send)
        elif method in ("GET", "HEAD") and path == self.metrics_path:
            await send_response(send, 200, self.metrics.render(), content_type=CONTENT_TYPE.encode())
        else:
            await self.proxy.forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    logger.exception("gateway start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        limits = self.settings.limits
        logger.info(
            "gateway forwarding to %s; body cap %s on %s",
            self.proxy.base_url,
            "off" if limits.max_request_body_bytes is None else f"{limits.max_request_body_bytes:,} bytes",
            ", ".join(limits.admission_routes),
        )

    async def shutdown(self) -> None:
        await self.proxy.aclose()
