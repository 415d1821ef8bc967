"""The gateway's Prometheus metrics, on a registry of their own per app. Their names are a contract: the dashboard,
the alert rules and tests/deploy/common.py name them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.metric_buffer import MetricBuffer
from serving.process_metrics import ProcessTreeCollector

_BYTE_BUCKETS = tuple(float(1 << shift) for shift in range(10, 34, 2))  # 1 KiB .. 8 GiB
_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

# Redis round trips: sub-millisecond on loopback, up to the socket timeout.
_BACKEND_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# With several worker processes (`server.workers`), prometheus-client's multiprocess mode: every process writes its
# values to files in this directory and `/metrics`, whichever worker answers it, adds them up. How a gauge adds up
# is its multiprocess mode: `livesum` for what each live process holds, `livemax` / `livemostrecent` for a value
# every process reads from one shared source. Counters and histograms are summed.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

GaugeMode = Literal["livesum", "livemax", "livemostrecent"]

# Label values created at start-up, so that their series exist (at 0) before the first request or error.
KNOWN_ROUTES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/healthz",
    "/readyz",
)
ADMISSION_CODES = ("200", "400", "413", "429", "499", "500", "502", "503", "504")
# Every reason a refusal on an admission route is counted under.
REJECTION_REASONS = (
    "audio_too_long",
    "bad_media",
    "bad_media_geometry",
    "bad_request",
    "body_timeout",
    "body_too_large",
    "budget_timeout",
    "budget_unavailable",
    "decode_timeout",
    "image_metadata_too_large",
    "image_too_large",
    "malformed_json",
    "media_too_large",
    "queue_full",
    "tenant_cap",
    "too_many_items",
    "too_many_scans",
    "unsupported_media",
    "unsupported_route",
    "upstream_timeout",
    "upstream_unreachable",
    "video_too_large",
    "video_too_long",
)
UPSTREAM_ERROR_KINDS = ("connect", "connect_timeout", "read_timeout", "protocol")

ChildT = TypeVar("ChildT")


class Children(Generic[ChildT]):
    """`labels(*values)`, remembered. prometheus-client's `labels()` checks and converts its values and takes a lock
    on every call, a real part of a small request's cost; the label sets seen here are few (routes, status codes,
    reasons)."""

    __slots__ = ("_children", "_labels")

    def __init__(self, labels: Callable[..., ChildT]) -> None:
        self._labels = labels
        self._children: dict[tuple[str, ...], ChildT] = {}

    def __call__(self, *values: str) -> ChildT:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._labels(*values)
        return child


class GatewayMetrics:
    """`shared_budget`: the media budget is one cap shared by every process (`limits.budget_backend: redis`), so its
    capacity and cluster view are the same number in every worker (`livemax` / `livemostrecent`); otherwise each
    worker holds its own share of the process budget and the shares add up (`livesum`). `budget_name`: the shared
    budget's name (its Redis key base), the `budget` label of the cluster series, by which every gateway sharing
    it is counted once; "" (no label) for a budget of this process's own. `tenant_labels`: the tenant classes of
    the per-tenant budget series (the configured tenants and `other`)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        shared_budget: bool = False,
        budget_name: str = "",
        admission_routes: tuple[str, ...] = ("/v1/chat/completions", "/v1/messages", "/v1/responses"),
        metrics_path: str = "/metrics",
        tenant_labels: tuple[str, ...] = ("other",),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics_path = metrics_path
        r = self.registry
        capacity_mode: GaugeMode = "livemax" if shared_budget else "livesum"
        cluster_mode: GaugeMode = "livemostrecent" if shared_budget else "livesum"
        self.requests = Counter(
            "mmgate_requests", "Requests answered, by route and status code.", ["route", "code"], registry=r
        )
        self.rejections = Counter(
            "mmgate_rejections",
            "Requests the gateway refused, by route and reason.",
            ["route", "reason"],
            registry=r,
        )
        self.request_body_bytes = Histogram(
            "mmgate_request_body_bytes",
            "Raw request body size.",
            ["route"],
            buckets=_BYTE_BUCKETS,
            registry=r,
        )
        self.media_items = Counter(
            "mmgate_media_items",
            "Media items loaded, by modality and source.",
            ["modality", "source"],
            registry=r,
        )
        self.media_counted_bytes = Histogram(
            "mmgate_media_counted_bytes",
            "Bytes counted against the per-request cap.",
            buckets=_BYTE_BUCKETS,
            registry=r,
        )
        self.media_decode_seconds = Histogram(
            "mmgate_media_decode_seconds",
            "Time to decode one media item, or with media.decode: check to check its structure.",
            ["modality"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.media_frames_decoded = Counter(
            "mmgate_media_frames_decoded",
            "Frames the gateway's video and audio decoders produced (sampled or skipped), by modality.",
            ["modality"],
            registry=r,
        )
        self.media_predicted_bytes = Histogram(
            "mmgate_media_predicted_bytes",
            "Bytes one item's header predicts its decode (and processed tensors) will count, by modality.",
            ["modality"],
            buckets=_BYTE_BUCKETS,
            registry=r,
        )
        self.budget_capacity_bytes = Gauge(
            "mmgate_budget_capacity_bytes", "Process media budget.", registry=r, multiprocess_mode=capacity_mode
        )
        self.budget_in_use_bytes = Gauge(
            "mmgate_budget_in_use_bytes", "Process media budget reserved now.", registry=r, multiprocess_mode="livesum"
        )
        self.budget_waiting_requests = Gauge(
            "mmgate_budget_waiting_requests",
            "Requests waiting for the process media budget.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.body_buffer_capacity_bytes = Gauge(
            "mmgate_body_buffer_capacity_bytes",
            "The bound on raw request bodies this process holds (limits.max_buffered_body_bytes, its share).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.body_buffer_bytes = Gauge(
            "mmgate_body_buffer_bytes",
            "Raw request bodies held now: being read, parsed, waiting for the media budget or forwarded.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.body_buffer_waiting_requests = Gauge(
            "mmgate_body_buffer_waiting_requests",
            "Requests whose body is not read until the bound on request bodies has room for it.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.body_buffer_wait_seconds = Histogram(
            "mmgate_body_buffer_wait_seconds",
            "Time a request waited for room in the bound on request bodies.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        # Labelled by the shared budget's name: the series of every gateway sharing one budget are one budget.
        self.budget_cluster_capacity_bytes = Gauge(
            "mmgate_budget_cluster_capacity_bytes",
            "The media budget's cap as the whole cluster shares it (local backend: this gateway's), by shared budget.",
            ["budget"],
            registry=r,
            multiprocess_mode=capacity_mode,
        ).labels(budget_name)
        self.budget_cluster_in_use_bytes = Gauge(
            "mmgate_budget_cluster_in_use_bytes",
            "Media budget reserved now by every process sharing it, as of this process's last backend round trip.",
            ["budget"],
            registry=r,
            multiprocess_mode=cluster_mode,
        ).labels(budget_name)
        self.budget_cluster_waiting_requests = Gauge(
            "mmgate_budget_cluster_waiting_requests",
            "Requests of every process sharing the media budget waiting for it.",
            ["budget"],
            registry=r,
            multiprocess_mode=cluster_mode,
        ).labels(budget_name)
        self.budget_tenant_states = Gauge(
            "mmgate_budget_tenant_states",
            "Tenant states the media budget keeps (limits.fairness.max_tenants bounds them): this process's with the "
            "local backend, the cluster's in Redis as of this process's last round trip with redis.",
            registry=r,
            multiprocess_mode=cluster_mode,
        )
        self.budget_tenant_evictions = Counter(
            "mmgate_budget_tenant_evictions",
            "Idle tenant states forgotten at limits.fairness.max_tenants, the least recently active first "
            "(with redis: by this process's calls).",
            registry=r,
        )
        self.budget_backend_seconds = Histogram(
            "mmgate_budget_backend_seconds",
            "Round trips to the shared media budget's backend (Redis), by operation.",
            ["op"],
            buckets=_BACKEND_SECONDS_BUCKETS,
            registry=r,
        )
        self.budget_backend_errors = Counter(
            "mmgate_budget_backend_errors", "Calls to the shared media budget's backend that failed.", registry=r
        )
        self.budget_lease_renewals = Counter(
            "mmgate_budget_lease_renewals", "Leases of the shared media budget this process renewed.", registry=r
        )
        self.budget_lease_expiries = Counter(
            "mmgate_budget_lease_expiries",
            "Leases and queue tickets of the shared budget that expired unrenewed (a dead process's), by kind.",
            ["kind"],
            registry=r,
        )
        self.budget_leases_lost = Counter(
            "mmgate_budget_leases_lost",
            "Leases of this process that had expired when it came to renew them (it stalled past redis.lease_ttl_s).",
            registry=r,
        )
        self.budget_leases_reasserted = Counter(
            "mmgate_budget_leases_reasserted",
            "Leases this process re-asserted after the shared budget's Redis lost its state (a restart, a flush).",
            registry=r,
        )
        self.budget_state_losses = Counter(
            "mmgate_budget_state_losses",
            "Times this process found the shared budget's Redis had lost its state; grants pause for one lease TTL.",
            registry=r,
        )
        self.budget_backend_fallbacks = Counter(
            "mmgate_budget_backend_fallbacks",
            "Times the shared media budget fell back to the local share because its backend did not answer.",
            registry=r,
        )
        self.budget_backend_degraded = Gauge(
            "mmgate_budget_backend_degraded",
            "1 while this process admits from the local fallback share instead of the shared budget.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.budget_wait_seconds = Histogram(
            "mmgate_budget_wait_seconds",
            "Time spent waiting for the media budget.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.tenant_budget_in_use_bytes = Gauge(
            "mmgate_tenant_budget_in_use_bytes",
            "Process media budget reserved now, by tenant class (a configured tenant, or other).",
            ["tenant"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tenant_budget_waiting_requests = Gauge(
            "mmgate_tenant_budget_waiting_requests",
            "Requests waiting for the process media budget, by tenant class.",
            ["tenant"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tenant_budget_granted_bytes = Counter(
            "mmgate_tenant_budget_granted_bytes",
            "Bytes of the process media budget granted, by tenant class.",
            ["tenant"],
            registry=r,
        )
        self.tenant_budget_byte_seconds = Counter(
            "mmgate_tenant_budget_byte_seconds",
            "Process media budget held, in bytes times seconds, by tenant class (counted when a grant returns).",
            ["tenant"],
            registry=r,
        )
        self.tenant_budget_wait_seconds = Histogram(
            "mmgate_tenant_budget_wait_seconds",
            "Time spent waiting for the process media budget, by tenant class.",
            ["tenant"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.upstream_ttfb_seconds = Histogram(
            "mmgate_upstream_ttfb_seconds",
            "Upstream time to response headers.",
            ["route"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "mmgate_upstream_errors", "Failed upstream exchanges, by kind.", ["kind"], registry=r
        )
        self.request_duration_seconds = Histogram(
            "mmgate_request_duration_seconds",
            "Whole request duration.",
            ["route"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.inflight_requests = Gauge(
            "mmgate_inflight_requests", "Requests being served now.", registry=r, multiprocess_mode="livesum"
        )
        # The per-request series, by their label values; those updated on the event loop for every request go
        # through the buffer (gateway/metric_buffer.py).
        buffer = self.buffer = MetricBuffer(each_turn=bool(os.environ.get(MULTIPROC_DIR_ENV)))
        self.requests_by = Children(lambda *values: buffer.counter(self.requests.labels(*values)))
        self.rejections_by = Children(lambda *values: buffer.counter(self.rejections.labels(*values)))
        self.request_body_bytes_by = Children(lambda *values: buffer.histogram(self.request_body_bytes.labels(*values)))
        self.request_duration_by = Children(
            lambda *values: buffer.histogram(self.request_duration_seconds.labels(*values))
        )
        self.upstream_ttfb_by = Children(lambda *values: buffer.histogram(self.upstream_ttfb_seconds.labels(*values)))
        self.upstream_errors_by = Children(self.upstream_errors.labels)
        self.budget_backend_seconds_by = Children(
            lambda *values: buffer.histogram(self.budget_backend_seconds.labels(*values))
        )
        self.inflight = buffer.gauge(self.inflight_requests)
        # One process: its own RSS, CPU and fds. Several workers: see `render`.
        ProcessCollector(registry=r)
        self._precreate(admission_routes, tenant_labels)

    def _precreate(self, admission_routes: tuple[str, ...], tenant_labels: tuple[str, ...]) -> None:
        for route in (*KNOWN_ROUTES, self.metrics_path):
            self.request_duration_seconds.labels(route)
        # The other admission routes' series appear with their first request: precreated, two dozen routes' would
        # quadruple what each scrape renders (about 11 ms more on the event loop).
        for route in (route for route in admission_routes if route in KNOWN_ROUTES):
            self.request_body_bytes.labels(route)
            self.upstream_ttfb_seconds.labels(route)
            for code in ADMISSION_CODES:
                self.requests.labels(route, code)
            for reason in REJECTION_REASONS:
                self.rejections.labels(route, reason)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        for tenant in tenant_labels:
            self.tenant_budget_in_use_bytes.labels(tenant)
            self.tenant_budget_waiting_requests.labels(tenant)
            self.tenant_budget_granted_bytes.labels(tenant)
            self.tenant_budget_byte_seconds.labels(tenant)
            self.tenant_budget_wait_seconds.labels(tenant)

    def render(self) -> bytes:
        self.buffer.flush()
        directory = os.environ.get(MULTIPROC_DIR_ENV)
        if directory:
            # Every worker's values, added up per metric; this process's own registry is one of them.
            merged = CollectorRegistry()
            MultiProcessCollector(merged, path=directory)  # type: ignore[no-untyped-call]
            # The multiprocess collector has no process_* series: the supervisor's own, and the whole tree summed.
            ProcessCollector(pid=lambda: os.getppid(), registry=merged)
            merged.register(ProcessTreeCollector(os.getppid))
            return generate_latest(merged)
        return generate_latest(self.registry)
