"""configs/alerts.yml and configs/prometheus.yml: structure, metric names, and, when promtool is installed,
`promtool check rules` / `check config` plus the rule unit tests in alerts_test.yml (alerts that must fire, and
must not, on synthetic series)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.common import CONFIGS, CONTRACT_SERIES, REPO, load_yaml, promtool, referenced_series, run_promtool

ALERTS = CONFIGS / "alerts.yml"
PROMETHEUS = CONFIGS / "prometheus.yml"
TESTS = REPO / "tests" / "deploy" / "alerts_test.yml"
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
needs_promtool = pytest.mark.skipif(
    promtool() is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)


def rules() -> list[dict[str, Any]]:
    data = load_yaml(ALERTS)
    assert isinstance(data, dict)
    assert data.get("groups"), "alerts.yml: no groups"
    found = []
    for group in data["groups"]:
        assert group.get("name"), group
        assert group.get("rules"), f"group {group['name']} has no rules"
        found.extend(group["rules"])
    return found


def rule(name: str) -> dict[str, Any]:
    matches = [item for item in rules() if item.get("alert") == name]
    assert len(matches) == 1, f"alert {name}: {len(matches)} rules"
    return matches[0]


def test_every_rule_is_a_complete_alert() -> None:
    names = []
    for item in rules():
        assert set(item) == {"alert", "expr", "for", "labels", "annotations"}, item
        names.append(item["alert"])
        assert re.fullmatch(r"Mmgate[A-Za-z0-9]+", item["alert"]), item["alert"]
        assert item["expr"].strip()
        assert _DURATION.match(str(item["for"])), f"{item['alert']}: for={item['for']!r}"
        assert item["labels"].get("severity") in {"info", "warning", "critical"}, item["alert"]
        assert item["annotations"].get("summary"), item["alert"]
        assert item["annotations"].get("description"), item["alert"]
    assert len(names) == len(set(names)), "alert names must be unique"


def up_jobs(expr: str) -> set[str]:
    """The jobs whose `up` series an expression selects, as `up{job="..."}`."""
    return set(re.findall(r'\bup\{job="([^"]+)"\}', expr))


def scrape_jobs() -> set[str]:
    return {job["job_name"] for job in load_yaml(PROMETHEUS)["scrape_configs"]}


def test_every_expression_names_only_exported_series() -> None:
    for item in rules():
        names = referenced_series(item["expr"])
        assert names or up_jobs(item["expr"]), f"{item['alert']} uses no mmgate metric and no scrape job's up"
        assert names <= CONTRACT_SERIES, f"{item['alert']}: {sorted(names - CONTRACT_SERIES)}"
        assert up_jobs(item["expr"]) <= scrape_jobs(), f"{item['alert']}: a job configs/prometheus.yml lacks"


@pytest.mark.parametrize(
    ("name", "job"), [("MmgateGatewayDown", "mmgate-gateway"), ("MmgateEngineDown", "mmgate-engine")]
)
def test_a_gateway_or_engine_that_cannot_be_scraped_pages(name: str, job: str) -> None:
    down = rule(name)
    assert up_jobs(down["expr"]) == {job}
    assert re.fullmatch(rf'up\{{job="{job}"\}} == 0', down["expr"].strip()), down["expr"]
    assert down["labels"]["severity"] == "critical"
    assert _DURATION.match(str(down["for"]))


def test_the_budget_error_rate_and_engine_alerts_exist() -> None:
    saturation = rule("MmgateMediaBudgetSaturated")["expr"]
    # The local budget per process, a shared budget once from the cluster's view.
    assert {"mmgate_budget_in_use_bytes", "mmgate_budget_capacity_bytes"} <= referenced_series(saturation)
    assert {"mmgate_budget_cluster_in_use_bytes", "mmgate_budget_cluster_capacity_bytes"} <= referenced_series(
        saturation
    )
    assert "max by (budget)" in saturation
    assert re.search(r'code=~"5\.\."', rule("MmgateHigh5xxRate")["expr"])
    assert 'code="429"' in rule("MmgateHigh429Rate")["expr"]
    engine = rule("MmgateEngineResidentNearBudget")["expr"]
    assert {"mmgate_engine_resident_bytes", "mmgate_engine_resident_budget_bytes"} <= referenced_series(engine)


def test_the_shared_budget_backend_alert_watches_degradation_and_errors() -> None:
    degraded = rule("MmgateBudgetBackendDegraded")
    assert {"mmgate_budget_backend_degraded", "mmgate_budget_backend_errors_total"} <= referenced_series(
        degraded["expr"]
    )
    assert degraded["labels"]["severity"] == "critical"


def test_error_ratios_count_api_routes_only() -> None:
    # /readyz answers 503 by design while the upstream loads or the gateway drains: it must not page anyone.
    for name in ("MmgateHigh5xxRate", "MmgateHigh429Rate"):
        selectors = re.findall(r"mmgate_requests_total\{([^}]*)\}", rule(name)["expr"])
        assert selectors, name
        for selector in selectors:
            assert 'route=~"/v1/.*"' in selector, f"{name}: {selector}"


def test_prometheus_scrapes_the_gateway_the_engine_and_trtllm() -> None:
    config = load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"mmgate-gateway", "mmgate-engine", "trtllm", "vllm"}
    assert jobs["mmgate-gateway"]["metrics_path"] == "/metrics"
    assert jobs["mmgate-engine"]["metrics_path"] == "/metrics"
    # trtllm-serve's /metrics is JSON iteration stats; Prometheus text is at /prometheus/metrics.
    assert jobs["trtllm"]["metrics_path"] == "/prometheus/metrics"
    assert jobs["vllm"]["metrics_path"] == "/metrics"
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).resolve() == ALERTS.resolve()


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = run_promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_the_scrape_config() -> None:
    result = run_promtool("check", "config", PROMETHEUS.name, cwd=PROMETHEUS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alerts_fire_on_the_cases_they_are_for_and_only_those() -> None:
    result = run_promtool("test", "rules", str(TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


_SHARED = re.compile(r'mmgate_budget_cluster_capacity_bytes\{[^}]*budget="([^"]*)"')


def backends_tested() -> dict[str, set[str]]:
    """alert name -> the budget backends of the rule unit tests that check it: `local` when a gateway's cluster
    capacity carries no budget name, `redis` when it names a shared budget."""
    found: dict[str, set[str]] = {}
    for case in load_yaml(TESTS)["tests"]:
        names = [_SHARED.search(item["series"]) for item in case["input_series"]]
        backends = {"redis" if match.group(1) else "local" for match in names if match is not None}
        for check in case.get("alert_rule_test", []):
            found.setdefault(check["alertname"], set()).update(backends)
    return found


def test_every_gateway_alert_is_unit_tested_on_both_budget_backends() -> None:
    """A gateway on the local budget and gateways sharing a Redis budget export different budget series: each alert
    of the gateway group has rule unit tests (alerts_test.yml, run by promtool below) on the series of both."""
    groups = {group["name"]: group["rules"] for group in load_yaml(ALERTS)["groups"]}
    tested = backends_tested()
    for item in groups["mmgate-gateway"]:
        assert tested.get(item["alert"], set()) == {"local", "redis"}, item["alert"]
    for item in groups["mmgate-engine"]:
        assert item["alert"] in tested, item["alert"]  # the engine has no budget backend
