from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from tests.conftest import (
    GatewayFactory,
)
from tests.deploy.common import PROCESS_COUNTERS, PROCESS_GAUGES
from tests.gateway.stub_upstream import StubUpstream

CONTRACT_NAMES = {
    "mmgate_requests",
    "mmgate_rejections",
    "mmgate_request_body_bytes",
    "mmgate_media_items",
    "mmgate_media_counted_bytes",
    "mmgate_media_decode_seconds",
    "mmgate_media_frames_decoded",
    "mmgate_media_predicted_bytes",
    "mmgate_budget_capacity_bytes",
    "mmgate_budget_in_use_bytes",
    "mmgate_budget_waiting_requests",
    "mmgate_body_buffer_bytes",
    "mmgate_body_buffer_capacity_bytes",
    "mmgate_body_buffer_waiting_requests",
    "mmgate_budget_wait_seconds",
    "mmgate_body_buffer_wait_seconds",
    "mmgate_upstream_ttfb_seconds",
    "mmgate_upstream_errors",
    "mmgate_request_duration_seconds",
    "mmgate_inflight_requests",
    "mmgate_budget_cluster_capacity_bytes",
    "mmgate_budget_cluster_in_use_bytes",
    "mmgate_budget_cluster_waiting_requests",
    "mmgate_budget_backend_seconds",
    "mmgate_budget_backend_errors",
    "mmgate_budget_lease_renewals",
    "mmgate_budget_lease_expiries",
    "mmgate_budget_leases_lost",
    "mmgate_budget_leases_reasserted",
    "mmgate_budget_state_losses",
    "mmgate_budget_backend_fallbacks",
    "mmgate_budget_backend_degraded",
    "mmgate_budget_tenant_states",
    "mmgate_budget_tenant_evictions",
    "mmgate_tenant_budget_in_use_bytes",
    "mmgate_tenant_budget_waiting_requests",
    "mmgate_tenant_budget_granted_bytes",
    "mmgate_tenant_budget_byte_seconds",
    "mmgate_tenant_budget_wait_seconds",
}


def test_every_architecture_metric_is_registered() -> None:
    names = {family.name for family in GatewayMetrics().registry.collect()}
    assert names == CONTRACT_NAMES | PROCESS_COUNTERS | PROCESS_GAUGES


def test_children_hand_out_one_child_per_label_set_and_count_into_its_series() -> None:
    metrics = GatewayMetrics()
    first = metrics.requests_by("/v1/chat/completions", "200")
    assert metrics.requests_by("/v1/chat/completions", "200") is first
    assert metrics.requests_by("/v1/chat/completions", "502") is not first
    first.inc()
    metrics.requests_by("/v1/chat/completions", "200").inc()
    route_code = {"route": "/v1/chat/completions", "code": "200"}
    # Buffered until the metrics are rendered (or flushed).
    assert metrics.registry.get_sample_value("mmgate_requests_total", route_code) == 0
    assert 'mmgate_requests_total{code="200",route="/v1/chat/completions"} 2.0' in metrics.render().decode()
    assert metrics.registry.get_sample_value("mmgate_requests_total", route_code) == 2


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_requests_rejections_and_body_sizes_are_counted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": 1000}) as (_, url):
        httpx.post(url + "/v1/chat/completions", content=b"{}")
        httpx.post(url + "/v1/chat/completions", content=b"x" * 2000)
        httpx.get(url + "/some/unbounded/path/123")
        samples = _samples(httpx.get(url + "/metrics").text)
    route = (("route", "/v1/chat/completions"),)
    assert samples[("mmgate_requests_total", (("code", "200"), *route))] == 1
    assert samples[("mmgate_requests_total", (("code", "413"), *route))] == 1
    assert samples[("mmgate_rejections_total", (("reason", "body_too_large"), *route))] == 1
    assert samples[("mmgate_request_body_bytes_count", route)] == 2
    # Unbounded paths share one label value (this one is no public API: refused, and counted).
    assert samples[("mmgate_requests_total", (("code", "403"), ("route", "other")))] == 1
    assert samples[("mmgate_upstream_ttfb_seconds_count", route)] == 1
