"""Metrics an operator expects: process_* series in both processes (and summed over `--workers`), series that exist
before the first error, the engine's pending input bytes, and `server.metrics_port`."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import ProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import REJECTION_REASONS, UPSTREAM_ERROR_KINDS
from tests.conftest import EngineFactory, GatewayFactory
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import free_port, served_process


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


def test_gateway_exports_process_series_and_precreated_labels(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        found = samples(httpx.get(url + "/metrics").text)
    assert value(found, "process_resident_memory_bytes") > 10 << 20
    assert value(found, "process_open_fds") > 0
    assert value(found, "process_cpu_seconds_total") > 0
    # Before any request with an error: every reason and kind at 0.
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        for reason in REJECTION_REASONS:
            assert value(found, "mmgate_rejections_total", route=route, reason=reason) == 0
        for code in ("400", "413", "429", "502", "504"):
            assert value(found, "mmgate_requests_total", route=route, code=code) == 0
    for kind in UPSTREAM_ERROR_KINDS:
        assert value(found, "mmgate_upstream_errors_total", kind=kind) == 0
    assert value(found, "mmgate_request_duration_seconds_count", route="/v1/models") == 0


def test_engine_exports_process_series_and_pending_input_bytes(make_engine: EngineFactory) -> None:
    with make_engine() as (_, url):
        found = samples(httpx.get(url + "/metrics").text)
    assert value(found, "process_resident_memory_bytes") > 10 << 20
    assert value(found, "process_open_fds") > 0
    assert value(found, "mmgate_engine_pending_input_bytes") == 0


def _config(tmp_path: Path, upstream: str, opened: tuple[str, ...] = (), **server: object) -> Path:
    config = tmp_path / "gateway.yaml"
    sections = {"upstream": {"url": upstream, "allowed_paths": list(opened)}, "server": {"access_log": False, **server}}
    config.write_text(yaml.safe_dump(sections))
    return config


@pytest.mark.slow
def test_metrics_port_serves_only_metrics_and_the_main_port_proxies_the_path(
    stub: tuple[StubUpstream, str], tmp_path: Path
) -> None:
    upstream_app, upstream = stub
    metrics_port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    # The upstream's own metrics reach clients through the main port where the operator opens them.
    config = _config(tmp_path, upstream, ("/metrics",), metrics_port=metrics_port)
    with served_process("gateway", config, env=env) as gateway:
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        scraped = httpx.get(metrics_url + "/metrics")
        assert scraped.status_code == 200
        assert "mmgate_requests_total" in scraped.text
        assert httpx.get(metrics_url + "/healthz").status_code == 200
        # Readiness with what each check reached: the metrics listener may name internal addresses.
        assert httpx.get(metrics_url + "/readyz").json()["upstream"] == f"{upstream}/health: 200"
        assert httpx.get(gateway.url + "/readyz").json()["upstream"] == "200"
        assert httpx.get(metrics_url + "/v1/models").status_code == 404
        assert httpx.post(metrics_url + "/v1/chat/completions", json={}).status_code == 404
        # The main port no longer serves the metrics: the path goes upstream like any other.
        proxied = httpx.get(gateway.url + "/metrics")
        assert "mmgate_requests_total" not in proxied.text
        assert "/metrics" in upstream_app.state.paths()


def test_metrics_port_must_differ_from_the_port() -> None:
    from gateway.config import GatewaySettings

    with pytest.raises(ValueError, match="metrics_port"):
        GatewaySettings(server={"port": 8000, "metrics_port": 8000})


@pytest.mark.slow
def test_workers_export_the_supervisors_process_series_and_the_sums(
    stub: tuple[StubUpstream, str], tmp_path: Path
) -> None:
    _, upstream = stub
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    config = _config(tmp_path, upstream, workers=2)
    with served_process("gateway", config, "--workers", "2", env=env) as gateway:
        found = samples(httpx.get(gateway.url + "/metrics").text)
        # process_* is the supervisor's (the parent that serves nothing): its start time, not a worker's.
        supervisor = ProcessCollector(pid=lambda: gateway.process.pid, registry=None)
        started = {s.name: s.value for family in supervisor.collect() for s in family.samples}
    assert value(found, "process_start_time_seconds") == started["process_start_time_seconds"]
    assert value(found, "mmgate_processes") == 3  # the supervisor and two workers
    assert value(found, "mmgate_processes_resident_memory_bytes") > 2 * value(found, "process_resident_memory_bytes")
    assert value(found, "mmgate_processes_open_fds") > value(found, "process_open_fds")
    assert value(found, "mmgate_processes_cpu_seconds_total") > 0
