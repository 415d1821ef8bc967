"""configs/grafana/mmgate.json: parses, every query names only exported series, every panel is wired to the
datasource variable and the instance variable, and the layout has no overlapping panels."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.common import (
    CONFIGS,
    CONTRACT_METRICS,
    CONTRACT_SERIES,
    UPSTREAM_SERIES,
    metric_of,
    promtool,
    referenced_series,
    run_promtool,
)

DASHBOARD = CONFIGS / "grafana" / "mmgate.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return panels


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in all_panels(dashboard) if panel["type"] != "row"]


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in query_panels(dashboard) for target in panel["targets"]]


def variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    found = [item for item in dashboard["templating"]["list"] if item["name"] == name]
    assert len(found) == 1, f"dashboard variable {name!r}: {len(found)} found"
    return found[0]


def test_dashboard_is_a_provisionable_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "mmgate"
    assert dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_panel_has_a_title_and_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in all_panels(dashboard):
        assert panel.get("title"), panel
    for panel in query_panels(dashboard):
        assert panel.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no queries"
        for target in panel["targets"]:
            assert target.get("datasource") == panel["datasource"], panel["title"]
            assert target.get("expr", "").strip(), panel["title"]
    assert len(query_panels(dashboard)) >= 16


def test_every_query_names_only_exported_series(dashboard: dict[str, Any]) -> None:
    unknown = {name for expr in exprs(dashboard) for name in referenced_series(expr)} - CONTRACT_SERIES
    assert not unknown, f"not exported by the gateway or the engine: {sorted(unknown)}"


def test_every_metric_of_the_contract_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    shown = {metric_of(name) for expr in exprs(dashboard) for name in referenced_series(expr)}
    assert CONTRACT_METRICS - shown == set()


def test_every_selector_is_filtered_by_the_instance_variable(dashboard: dict[str, Any]) -> None:
    for expr in exprs(dashboard):
        for selector in re.finditer(r"mmgate_[a-z_]+(\{[^}]*\})?", expr):
            assert '{instance=~"$instance"' in (selector.group(0) or ""), f"unfiltered {selector.group(0)} in {expr}"


def test_histograms_are_read_through_their_buckets_or_sum_and_count(dashboard: dict[str, Any]) -> None:
    for expr in exprs(dashboard):
        for quantile in re.finditer(r"histogram_quantile\(([^,]+),(.*)", expr):
            assert "_bucket{" in quantile.group(2), expr
            assert "by (le" in quantile.group(2), f"histogram_quantile needs `le` kept: {expr}"


def test_variables_instance_and_datasource(dashboard: dict[str, Any]) -> None:
    datasource = variable(dashboard, "datasource")
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"
    instance = variable(dashboard, "instance")
    assert instance["type"] == "query"
    assert instance["datasource"]["uid"] == "${datasource}"
    assert instance["multi"] is True
    assert instance["includeAll"] is True
    # The variable lists gateways and engines alike.
    assert {"mmgate_requests_total", "mmgate_engine_iterations_total"} <= referenced_series(instance["definition"])
    assert referenced_series(instance["definition"]) <= CONTRACT_SERIES


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    boxes = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["w"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for other_title, (x, y, w, h) in boxes:
            separate = (
                grid["x"] + grid["w"] <= x or x + w <= grid["x"] or grid["y"] + grid["h"] <= y or y + h <= grid["y"]
            )
            assert separate, f"{panel['title']!r} overlaps {other_title!r}"
        boxes.append((panel["title"], (grid["x"], grid["y"], grid["w"], grid["h"])))


@pytest.mark.skipif(promtool() is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_every_query_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    # promtool parses expressions inside rule files: one recording rule per query, Grafana's macros substituted.
    macros = {"$__rate_interval": "1m", "$instance": ".+", "$upstream": ".+"}
    rules = []
    for index, expr in enumerate(exprs(dashboard)):
        for macro, value in macros.items():
            expr = expr.replace(macro, value)
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard_rules.json"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


_TITLE_CODES = re.compile(r"\(((?:\s*(?:\d{3}|\dxx)\s*,?)+)\)")
_EXPR_CODES = re.compile(r'code\s*(=~?)\s*"([^"]+)"')


def expr_codes(expr: str) -> set[str]:
    """The status codes a query selects, written as a title would: `code="429"` -> 429, `code=~"5.."` -> 5xx."""
    codes = set()
    for op, value in _EXPR_CODES.findall(expr):
        for code in value.split("|") if op == "=~" else [value]:
            codes.add(code.replace(".", "x"))
    return codes


def test_a_title_that_lists_status_codes_lists_exactly_the_codes_its_queries_plot(dashboard: dict[str, Any]) -> None:
    listed = 0
    for panel in query_panels(dashboard):
        match = _TITLE_CODES.search(panel["title"])
        plotted = set().union(*(expr_codes(target["expr"]) for target in panel["targets"]))
        if match is None:
            continue
        listed += 1
        titled = {code.strip() for code in match.group(1).split(",") if code.strip()}
        assert titled == plotted, f"{panel['title']!r} plots {sorted(plotted)}"
    assert listed, "the error ratio panel lists its codes"


def test_budget_panel_title_names_every_series_it_plots(dashboard: dict[str, Any]) -> None:
    capacity = "mmgate_budget_capacity_bytes"
    (found,) = [
        p
        for p in query_panels(dashboard)
        if capacity in referenced_series(p["targets"][0]["expr"]) and "utilization" not in p["title"]
    ]
    metrics = {metric_of(name) for target in found["targets"] for name in referenced_series(target["expr"])}
    assert {"mmgate_body_buffer_bytes", "mmgate_budget_cluster_in_use_bytes"} <= metrics
    title = found["title"].lower()
    for word in ("capacity", "in use", "bodies"):
        assert word in title, f"{found['title']!r} does not say it plots {word}"


def panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    (found,) = [p for p in query_panels(dashboard) if p["title"] == title]
    return found


def evaluated(expr: str) -> str:
    """A panel's query with Grafana's variables as a test evaluates it: every instance, 5-minute rates."""
    for macro, value in {"$__rate_interval": "5m", "$instance": ".+", "$upstream": ".+"}.items():
        expr = expr.replace(macro, value)
    return expr


def promql_test(tmp_path: Path, series: dict[str, str], checks: list[tuple[str, list[tuple[str, float]]]]) -> None:
    """promtool's unit test of `checks` (query, expected samples at 10m) on `series` (one value a minute)."""
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series.items()],
                "promql_expr_test": [
                    {
                        "expr": evaluated(expr),
                        "eval_time": "10m",
                        "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
                    }
                    for expr, samples in checks
                ],
            }
        ],
    }
    path = tmp_path / "panels_test.json"
    path.write_text(json.dumps(tests), encoding="utf-8")
    result = run_promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


needs_promtool = pytest.mark.skipif(
    promtool() is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)

CAP = 2_500_000_000
SHARED = "mmgate:budget:trtllm:8001"


@needs_promtool
def test_the_utilization_panel_shows_each_budget_as_it_is(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """Two gateways sharing one Redis budget at 92% (each holding 46% of the cap), beside a gateway on its local
    budget at 50%: the panel shows the shared budget once at 0.92 and the local one at 0.5, never a gateway of the
    shared budget at 0.46 (what it showed before)."""
    utilization = panel(dashboard, "Budget utilization")
    series = {}
    for instance in ("gw-a:8000", "gw-b:8000"):
        series |= {
            f'mmgate_budget_capacity_bytes{{instance="{instance}"}}': f"{CAP}x10",
            f'mmgate_budget_in_use_bytes{{instance="{instance}"}}': "1150000000x10",
            f'mmgate_budget_cluster_capacity_bytes{{instance="{instance}", budget="{SHARED}"}}': f"{CAP}x10",
            f'mmgate_budget_cluster_in_use_bytes{{instance="{instance}", budget="{SHARED}"}}': "2300000000x10",
        }
    series |= {
        'mmgate_budget_capacity_bytes{instance="gw-local:8000"}': f"{CAP}x10",
        'mmgate_budget_in_use_bytes{instance="gw-local:8000"}': "1250000000x10",
        'mmgate_budget_cluster_capacity_bytes{instance="gw-local:8000", budget=""}': f"{CAP}x10",
        'mmgate_budget_cluster_in_use_bytes{instance="gw-local:8000", budget=""}': "1250000000x10",
    }
    local, shared = (target["expr"] for target in utilization["targets"])
    promql_test(
        tmp_path, series, [(local, [('{instance="gw-local:8000"}', 0.5)]), (shared, [(f'{{budget="{SHARED}"}}', 0.92)])]
    )


@needs_promtool
def test_the_request_panels_count_requests_not_probes_and_scrapes(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """1 API request a second, with /metrics scraped and /healthz, /readyz probed: the request rate is the API's
    alone, and the in-flight count leaves out the scrape that reads it (which is always in flight when it does)."""
    series = {
        'mmgate_requests_total{instance="gw:8000", route="/v1/chat/completions", code="200"}': "0+60x10",
        'mmgate_requests_total{instance="gw:8000", route="/metrics", code="200"}': "0+4x10",
        'mmgate_requests_total{instance="gw:8000", route="/healthz", code="200"}': "0+6x10",
        'mmgate_requests_total{instance="gw:8000", route="/readyz", code="503"}': "0+6x10",
        'mmgate_inflight_requests{instance="gw:8000"}': "1x10",
        'mmgate_inflight_requests{instance="busy:8000"}': "4x10",
    }
    rate = panel(dashboard, "Request rate by route and code")["targets"][0]["expr"]
    inflight = panel(dashboard, "In-flight requests and upstream errors")["targets"][0]["expr"]
    promql_test(
        tmp_path,
        series,
        [
            (rate, [('{route="/v1/chat/completions", code="200"}', 1.0)]),
            (inflight, [('{instance="gw:8000"}', 0.0), ('{instance="busy:8000"}', 3.0)]),
        ],
    )


TIME_UNITS = {"s", "ms", "µs", "ns"}


def test_a_rate_is_never_drawn_in_seconds(dashboard: dict[str, Any]) -> None:
    """A panel drawn in seconds may plot a counter's rate (errors a second) only with an override that gives those
    series a unit of their own."""
    checked = 0
    for item in query_panels(dashboard):
        if item["fieldConfig"]["defaults"].get("unit") not in TIME_UNITS:
            continue
        overridden = [
            override["matcher"]["options"]
            for override in item["fieldConfig"].get("overrides", [])
            if any(prop["id"] == "unit" and prop["value"] not in TIME_UNITS for prop in override["properties"])
        ]
        for target in item["targets"]:
            expr = target["expr"]
            if "histogram_quantile" in expr or "_seconds" in expr:
                continue
            checked += 1
            assert any(re.search(pattern, target["legendFormat"]) for pattern in overridden), (
                f"{item['title']!r}: {target['legendFormat']!r} is drawn in {item['fieldConfig']['defaults']['unit']}"
            )
    assert checked, "the Redis panel's errors a second are checked"


def test_the_model_servers_own_metrics_are_beside_the_gateways(dashboard: dict[str, Any]) -> None:
    """A row of vLLM's and trtllm-serve's own series, by the names they export (tests/deploy/common.py says where
    each comes from), each selector filtered by the model-server variable."""
    upstream = variable(dashboard, "upstream")
    assert upstream["datasource"]["uid"] == "${datasource}"
    names: set[str] = set()
    for expr in exprs(dashboard):
        for selector in re.finditer(r"\b((?:vllm:|trtllm_)[a-z0-9_:]+)(\{[^}]*\})?", expr):
            names.add(selector.group(1))
            assert '{instance=~"$upstream"' in (selector.group(2) or ""), f"unfiltered {selector.group(0)} in {expr}"
    assert names <= UPSTREAM_SERIES, sorted(names - UPSTREAM_SERIES)
    assert any(name.startswith("vllm:") for name in names)
    assert any(name.startswith("trtllm_") for name in names)
    for name in ("vllm:num_requests_waiting", "trtllm_num_requests_waiting", "trtllm_kv_cache_utilization"):
        assert name in names, name


def test_the_upstream_header_time_is_not_called_the_first_token(dashboard: dict[str, Any]) -> None:
    """mmgate_upstream_ttfb_seconds ends at the upstream's response headers, which a streamed answer sends before
    its first token: the panel says so, and the model server's own time to first token is beside it."""
    (found,) = [p for p in query_panels(dashboard) if "mmgate_upstream_ttfb_seconds_bucket" in str(p["targets"])]
    assert "response headers" in found["title"]
    assert "first byte" not in found["title"].lower()
    assert "first token" in found["description"]
