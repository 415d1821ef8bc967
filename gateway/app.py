"""The gateway's ASGI application: its own endpoints, the admission routes, and everything else proxied."""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from engine_adapter.client import EngineClient
from gateway.access_log import AccessLog
from gateway.admission import Admission
from gateway.body_limit import ADMISSION_KNOB, RawBodyLimit
from gateway.budget.base import MediaBudget
from gateway.budget.factory import budget_name, build_budget, describe
from gateway.budget.reporter import BudgetReporter
from gateway.config import BudgetBackend, BudgetMode, GatewaySettings
from gateway.engine_mode import EngineMode
from gateway.errors import BadRequest, NotFound
from gateway.exception_middleware import ExceptionMiddleware
from gateway.health import Check, Health, Probe
from gateway.media.loader import MediaLoader
from gateway.media.sources.fetch import MediaFetcher
from gateway.metrics import PROMETHEUS_CONTENT_TYPE, GatewayMetrics
from gateway.processors import Processors
from gateway.proxy import UpstreamProxy
from gateway.request_info import request_info
from gateway.tenants import Tenants
from gateway.upstream_routes import UpstreamRoutes
from serving.app import ServedApp
from serving.asgi import ASGIApp, Receive, Scope, Send, send_response
from serving.drain import Drain
from serving.forwarded import TrustedProxies
from serving.settings_types import format_bytes

logger = logging.getLogger("mmgate.gateway")

BUFFERED_KNOB = "limits.max_buffered_body_bytes"

# The answer to `OPTIONS *`: the gateway forwards every method unchanged; these are the common ones.
_ALLOW = (b"allow", b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
GET_HEAD = ("GET", "HEAD")
Routes = dict[tuple[str, str], ASGIApp]


class Gateway(ServedApp):
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        limits = settings.limits
        self.tenants = Tenants(limits.fairness)
        self.metrics = GatewayMetrics(
            shared_budget=limits.budget_backend is BudgetBackend.REDIS,
            budget_name=budget_name(settings),
            admission_routes=tuple(limits.admission_routes),
            metrics_path=settings.server.metrics_path,
            tenant_labels=self.tenants.labels,
        )
        self.proxy = UpstreamProxy(settings.upstream, self.metrics)
        self.budget: MediaBudget = build_budget(settings, self.metrics)
        self.budget_reporter = BudgetReporter(self.budget, self.metrics)
        self.media_executor = ThreadPoolExecutor(settings.media.load_workers, thread_name_prefix="mmgate-media")
        self.fetcher = MediaFetcher(settings.media.fetch)
        self.processors = Processors(settings.media.processor)
        self.loader = MediaLoader(
            settings=settings,
            metrics=self.metrics,
            fetcher=self.fetcher,
            executor=self.media_executor,
            processors=self.processors,
        )
        self.engine: EngineMode | None = None
        if settings.engine.url is not None and settings.media.processor is not None:
            client = EngineClient(
                str(settings.engine.url),
                auth_token=settings.engine.auth_token,
                connect_timeout_s=settings.engine.connect_timeout_s,
                read_timeout_s=settings.engine.read_timeout_s,
            )
            self.engine = EngineMode(client, self.media_executor, metrics=self.metrics)
        # Engine mode: the engine reports its model's geometry; otherwise the upstream's model picks the processor.
        model: dict[str, Probe] = {}
        if self.engine is not None:
            model["engine"] = self.engine.readiness
        elif self.processors.setting is not None:
            model["processor"] = self._processor
        self.health = Health(
            lambda: self.proxy.session,
            settings.upstream,
            {**model, "budget": self._budget},
            expose_internal=settings.errors.expose_internal,
        )
        self.admission = Admission(
            limits=limits,
            proxy=self.proxy,
            budget=self.budget,
            loader=self.loader,
            metrics=self.metrics,
            body_buffer_bytes=settings.body_buffer_share,
            engine=self.engine,
            tenants=self.tenants,
        )
        self.drain = Drain(settings.server.drain_timeout_s)
        self.metrics_path = settings.server.metrics_path
        self.metrics_port = settings.server.metrics_port
        self.routes = UpstreamRoutes(
            allowed=settings.upstream.allowed_paths,
            blocked=settings.upstream.blocked_paths,
            admission_routes=limits.admission_routes,
        )
        # What the gateway answers itself, by method and path (the first row for a pair wins). On the main port,
        # any other request is the upstream's (`_upstream`), a POST to /healthz included. A metrics listener of its
        # own (`server.metrics_port`) answers its rows and nothing else, and the main port then has no metrics path.
        # (Starlette's `Router`, as the engine uses, would answer a path it knows with a 405 for another method, and
        # takes no `*`.)
        self.main_routes = _routes(
            (("OPTIONS",), "*", _server_options),
            (GET_HEAD, "/healthz", self.health.healthz),
            (GET_HEAD, "/readyz", self.health.readyz),
            *([(GET_HEAD, self.metrics_path, self._metrics)] if self.metrics_port is None else []),
        )
        self.metrics_listener_routes = _routes(
            (GET_HEAD, self.metrics_path, self._metrics),
            (GET_HEAD, "/healthz", self.health.healthz),
            (GET_HEAD, "/readyz", functools.partial(self.health.readyz, internal=True)),
        )
        # Outermost first. TrustedProxies says who the client is (or drops its claims); AccessLog makes the
        # request's RequestInfo (its route, and whether it is an admission request), which every layer inside
        # reads; ExceptionMiddleware answers what the layers inside it raise.
        admission_cap, admission_knob = admission_body_cap(settings)
        limited = RawBodyLimit(
            self._route,
            max_bytes=admission_cap,
            other_max_bytes=settings.limits.max_other_body_bytes,
            knob=admission_knob,
        )
        self.access_log = AccessLog(
            ExceptionMiddleware(limited, expose_internal=settings.errors.expose_internal, drain=self.drain),
            metrics=self.metrics,
            openai_envelope=settings.errors.openai_envelope,
            admission_routes=settings.limits.admission_routes,
            metrics_path=self.metrics_path,
            enabled=settings.server.access_log,
            log_probes=settings.server.access_log_probes,
            tenants=self.tenants,
        )
        # A fairness id a proxy sets is believed (and forwarded) from trusted proxies only.
        vouched = (name.encode() for name in limits.fairness.proxy_tenant_headers)
        self.http = TrustedProxies(self.access_log, settings.server.forwarded_allow_ips, vouched)

    def start_draining(self) -> None:
        """From now on `/readyz` says 503 so that load balancers stop sending new work, and what is in flight
        has `server.drain_timeout_s` to finish."""
        self.health.draining = True
        self.drain.start()

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not request_info(scope).normal_path:
            raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
            raise BadRequest(
                f"request path {raw!r} holds a percent-encoded slash or a backslash: servers disagree on what it "
                "names, so the gateway forwards no such path"
            )
        key = (scope["method"], scope["path"])
        if self.metrics_port is not None and _local_port(scope) == self.metrics_port:
            endpoint = self.metrics_listener_routes.get(key, self._no_metrics_route)
        else:
            endpoint = self.main_routes.get(key, self._upstream)
        await endpoint(scope, receive, send)

    async def _upstream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every request the gateway does not answer itself: admitted (an admission request) or proxied."""
        self.routes.check(scope["method"], scope["path"])
        if request_info(scope).admission:
            await self.admission(scope, receive, send)
        else:
            await self.proxy.forward(scope, receive, send)

    async def _no_metrics_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotFound(
            f"{scope['method']} {scope['path']}: the metrics listener serves only {self.metrics_path}, /healthz and "
            "/readyz"
        )

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.access_log.settle()
        self.budget_reporter.sync()
        await send_response(send, 200, self.metrics.render(), content_type=PROMETHEUS_CONTENT_TYPE.encode())

    async def startup(self) -> None:
        limits = self.settings.limits
        logger.info(
            "gateway forwarding to %s; body cap %s on %s, %s on every other request",
            self.proxy.base_url,
            _bytes_or_off(limits.max_request_body_bytes),
            ", ".join(limits.admission_routes),
            _bytes_or_off(limits.max_other_body_bytes),
        )
        total, per_request = limits.max_multimodal_cpu_bytes, limits.max_multimodal_cpu_bytes_per_request
        if total is None:
            logger.info("media budget off (limits.max_multimodal_cpu_bytes=null)")
        elif limits.budget_mode is BudgetMode.SLOTS:
            logger.info(
                "media budget %s (budget_mode=slots): %d slots of %s, so at most %d requests with media at once, "
                "each holding a full slot however little it needs",
                format_bytes(total),
                limits.budget_slots,
                _bytes_or_off(per_request),
                limits.budget_slots,
            )
        else:
            logger.info(
                "media budget %s (budget_mode=bytes): requests with media run at once while the bytes their headers "
                "predict fit (the full %s per-request cap when they cannot be predicted, e.g. downloads)",
                format_bytes(total),
                _bytes_or_off(per_request),
            )
        logger.info("%s", describe(self.settings))
        logger.info(
            "request bodies held at once: %s in this process (limits.max_buffered_body_bytes); a body past it is not "
            "read until room frees up",
            _bytes_or_off(self.settings.body_buffer_share),
        )
        # A shared budget whose backend does not answer stops the start with an error that names its URL.
        await self.budget_reporter.start()
        if self.engine is not None:
            await self.engine.start()
        elif self.processors.setting is not None:
            await self._processor()
            if self.processors.deciding:
                logger.info(
                    "media.processor auto: the upstream names no known model yet (%s/v1/models); charging the "
                    "largest of the known processors until it does",
                    self.proxy.base_url,
                )

    async def _processor(self) -> Check:
        """The `/readyz` line of `media.processor`; with `auto`, asks the upstream's served model until it knows
        (never not-ready: a charge is made either way)."""
        await self.processors.detect(self.proxy.session, self.proxy.base_url + "/v1/models")
        return Check(True, self.processors.label)

    async def _budget(self) -> Check:
        return Check(*await self.budget_reporter.readiness())

    async def shutdown(self) -> None:
        self.access_log.settle()
        if self.engine is not None:
            await self.engine.aclose()
        await self.budget_reporter.aclose()
        await self.proxy.aclose()
        await self.fetcher.aclose()
        self.media_executor.shutdown(wait=False, cancel_futures=True)


def admission_body_cap(settings: GatewaySettings) -> tuple[int | None, str]:
    """The cap on an admission request's body and the setting it comes from: `limits.max_request_body_bytes`, or
    this process's share of `limits.max_buffered_body_bytes` where that is lower (a body the bound cannot hold is
    refused before it is read)."""
    cap, share = settings.limits.max_request_body_bytes, settings.body_buffer_share
    if share is not None and (cap is None or share < cap):
        workers = settings.server.workers
        return share, BUFFERED_KNOB if workers == 1 else f"{BUFFERED_KNOB} / server.workers={workers}"
    return cap, ADMISSION_KNOB


def _routes(*rows: tuple[tuple[str, ...], str, ASGIApp]) -> Routes:
    """(methods, path, endpoint) rows as one lookup by (method, path); the first row for a pair wins."""
    table: Routes = {}
    for methods, path, endpoint in rows:
        for method in methods:
            table.setdefault((method, path), endpoint)
    return table


async def _server_options(scope: Scope, receive: Receive, send: Send) -> None:
    """Server-wide OPTIONS (asterisk-form target). aiohttp sends only a path as the request target, so it cannot be
    forwarded as it came; the gateway answers with the methods it passes on."""
    await send({"type": "http.response.start", "status": 200, "headers": [_ALLOW, (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _local_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return None if not server else int(server[1])


def _bytes_or_off(value: int | None) -> str:
    # A form a config file takes back as the same value (serving.settings_types).
    return "off" if value is None else format_bytes(value)
