"""The metric names the dashboard and the alerts are checked against are the ones the code registers."""

from __future__ import annotations

from engine_adapter.metrics import EngineMetrics
from gateway.metrics import GatewayMetrics
from tests.deploy.common import (
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    ENGINE_HISTOGRAMS,
    GATEWAY_COUNTERS,
    GATEWAY_GAUGES,
    GATEWAY_HISTOGRAMS,
    PROCESS_COUNTERS,
    PROCESS_GAUGES,
    metric_of,
    referenced_series,
    registry_series,
    series_names,
)


def test_gateway_registers_exactly_the_contract_names() -> None:
    assert registry_series(GatewayMetrics().registry) == series_names(
        GATEWAY_COUNTERS | PROCESS_COUNTERS, GATEWAY_HISTOGRAMS, GATEWAY_GAUGES | PROCESS_GAUGES
    )


def test_engine_registers_exactly_the_contract_names() -> None:
    assert registry_series(EngineMetrics().registry) == series_names(
        ENGINE_COUNTERS | PROCESS_COUNTERS, ENGINE_HISTOGRAMS, ENGINE_GAUGES | PROCESS_GAUGES
    )


def test_name_extraction_keeps_what_an_expression_selects() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(mmgate_request_duration_seconds_bucket{job="mmgate-gateway"}[5m])))'
        " / on() mmgate_budget_in_use_bytes + rate(mmgate_requests_total[1m])"
    )
    assert referenced_series(expr) == {
        "mmgate_request_duration_seconds_bucket",
        "mmgate_budget_in_use_bytes",
        "mmgate_requests_total",
    }
    assert metric_of("mmgate_request_duration_seconds_bucket") == "mmgate_request_duration_seconds"
    assert metric_of("mmgate_requests_total") == "mmgate_requests_total"
    # A gauge that happens to end like a histogram series is not a histogram.
    assert metric_of("mmgate_made_up_count") == "mmgate_made_up_count"
