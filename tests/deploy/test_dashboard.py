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
    macros = {"$__rate_interval": "1m", "$instance": ".+"}
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
    capacity = {"mmgate_budget_capacity_bytes"}
    (panel,) = [p for p in query_panels(dashboard) if referenced_series(p["targets"][0]["expr"]) == capacity]
    metrics = {metric_of(name) for target in panel["targets"] for name in referenced_series(target["expr"])}
    assert "mmgate_body_buffer_bytes" in metrics
    title = panel["title"].lower()
    for word in ("capacity", "in use", "bodies"):
        assert word in title, f"{panel['title']!r} does not say it plots {word}"
