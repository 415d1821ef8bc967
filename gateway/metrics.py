"""The gateway's Prometheus metrics, on a registry of their own per app. Their names are a contract: the dashboard,
the alert rules and tests/deploy/common.py name them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

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

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
            "Time to decode one media item.",
            ["modality"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.budget_capacity_bytes = Gauge("mmgate_budget_capacity_bytes", "Process media budget.", registry=r)
        self.budget_in_use_bytes = Gauge("mmgate_budget_in_use_bytes", "Process media budget reserved now.", registry=r)
        self.budget_waiting_requests = Gauge(
            "mmgate_budget_waiting_requests", "Requests waiting for the process media budget.", registry=r
        )
        self.budget_queued_body_bytes = Gauge(
            "mmgate_budget_queued_body_bytes",
            "Raw bodies held by requests waiting for the media budget.",
            registry=r,
        )
        self.budget_wait_seconds = Histogram(
            "mmgate_budget_wait_seconds",
            "Time spent waiting for the media budget.",
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
        self.inflight_requests = Gauge("mmgate_inflight_requests", "Requests being served now.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
