"""The engine's Prometheus metrics, on a registry of their own per app (names: see tests/deploy/common.py).

Gauges read the scheduler when scraped, so they are never stale. No request ids in labels.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = tuple(float(1 << shift) for shift in range(4, 21))  # 16 .. 1M encoder tokens

# The reasons `admission_rejections_total` can carry (a closed set: every refusal of a submit).
REJECTION_REASONS = (
    "max_resident_bytes",
    "max_pending_input_bytes",
    "body_too_large",
    "malformed",
    "geometry",
    "unsupported",
    "draining",
)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.iterations = Counter(
            "mmgate_engine_iterations", "Encoder iterations that encoded at least one item.", registry=r
        )
        self.items_encoded = Counter("mmgate_engine_items_encoded", "Items (images, videos) encoded.", registry=r)
        self.iteration_seconds = Histogram(
            "mmgate_engine_iteration_seconds",
            "Wall time of one iteration's pack and forward pass.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "mmgate_engine_iteration_tokens", "Encoder tokens per iteration.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.resident_bytes = Gauge(
            "mmgate_engine_resident_bytes", "Bytes of the embedding buffers of live requests.", registry=r
        )
        self.resident_budget_bytes = Gauge(
            "mmgate_engine_resident_budget_bytes",
            "encoder.max_resident_bytes (+Inf when off or under the DISABLED policy).",
            registry=r,
        )
        self.queued_requests = Gauge(
            "mmgate_engine_queued_requests", "Requests admitted and not started yet.", registry=r
        )
        self.pending_input_bytes = Gauge(
            "mmgate_engine_pending_input_bytes",
            "Encoder inputs held for admitted requests not fully encoded yet (encoder.max_pending_input_bytes).",
            registry=r,
        )
        self.admission_rejections = Counter(
            "mmgate_engine_admission_rejections", "Submits refused, by reason.", ["reason"], registry=r
        )
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(reason)
        self.cache_hits = Counter("mmgate_engine_cache_hits", "Items served from the encoder cache.", registry=r)
        self.cache_misses = Counter(
            "mmgate_engine_cache_misses", "Cacheable items looked up and not found.", registry=r
        )
        self.handoff_pixel_fallbacks = Counter(
            "mmgate_engine_handoff_pixel_fallbacks",
            "Requests handed off as pixels (PNG image_url parts) instead of embeddings: trtllm form, and an item "
            "whose grid trtllm-serve would infer wrongly from its row count.",
            registry=r,
        )
        ProcessCollector(registry=r)  # process_*: RSS, CPU, open fds

    def bind(
        self,
        resident: Callable[[], float],
        budget: Callable[[], float],
        queued: Callable[[], float],
        pending_inputs: Callable[[], float],
    ) -> None:
        """Read the gauges from these callables at scrape time."""
        self.resident_bytes.set_function(resident)
        self.resident_budget_bytes.set_function(budget)
        self.queued_requests.set_function(queued)
        self.pending_input_bytes.set_function(pending_inputs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
