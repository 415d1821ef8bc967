"""The dashboard and the alert rules against live processes: every series they query is on the `/metrics` of a
real gateway and a real engine, after one request with an image and one without went through."""

from __future__ import annotations

import json

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import (
    EngineFactory,
    GatewayFactory,
)
from tests.deploy.common import CONFIGS, referenced_series, series_names
from tests.gateway.media_factory import chat_body, data_url, image_bytes


def live_series(text: str) -> set[str]:
    kinds: dict[str, set[str]] = {"counter": set(), "histogram": set(), "gauge": set()}
    for family in text_string_to_metric_families(text):
        kinds.setdefault(family.type, set()).add(family.name)
    return series_names(kinds["counter"], kinds["histogram"], kinds["gauge"])


def test_every_dashboard_and_alert_series_is_exported_by_live_processes(
    make_engine: EngineFactory, make_gateway: GatewayFactory
) -> None:
    with make_engine() as (_, engine_url):
        gateway_config = {
            "engine": {"url": engine_url},
            "media": {"processor": "qwen2_vl"},
            "upstream": {"ready_path": "/healthz"},
        }
        with make_gateway(engine_url, **gateway_config) as (_, url):
            assert httpx.post(url + "/v1/chat/completions", content=chat_body(), timeout=30).status_code == 200
            with_image = chat_body(data_url(image_bytes(64, 64)))
            assert httpx.post(url + "/v1/chat/completions", content=with_image, timeout=30).status_code == 200
            exported = live_series(httpx.get(url + "/metrics", timeout=10).text)
        exported |= live_series(httpx.get(engine_url + "/metrics", timeout=10).text)
    dashboard = json.loads((CONFIGS / "grafana" / "mmgate.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in referenced_series(target.get("expr", ""))
    }
    alerts = yaml.safe_load((CONFIGS / "alerts.yml").read_text())
    alerted = {
        name for group in alerts["groups"] for rule in group["rules"] for name in referenced_series(rule["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried - exported == set()
    assert alerted - exported == set()
