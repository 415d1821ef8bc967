from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from gateway.tenants import api_key_id
from serving.asgi import Exchange
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import assert_freed_with_each_request


def test_one_json_line_per_request(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    with make_gateway(upstream, server={"access_log": True}, limits={"max_request_body_bytes": 100}) as (
        _,
        url,
    ):
        httpx.post(url + "/v1/chat/completions", content=b'{"a": 1}', headers={"x-request-id": "req-1"})
        httpx.post(url + "/v1/chat/completions", content=b"x" * 500, headers={"x-request-id": "req-2"})
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    assert len(lines) == 2
    ok, refused = lines
    assert ok["request_id"] == "req-1"
    assert ok["route"] == "/v1/chat/completions"
    assert ok["status"] == 200
    assert ok["body_bytes"] == 8
    assert ok["rejection"] is None
    assert ok["upstream_ttfb_s"] > 0
    assert ok["duration_s"] >= ok["upstream_ttfb_s"]
    assert refused["request_id"] == "req-2"
    assert refused["status"] == 413
    assert refused["rejection"] == "body_too_large"
    assert refused["upstream_ttfb_s"] is None


def test_access_log_can_be_turned_off(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    with make_gateway(upstream, server={"access_log": False}) as (_, url):
        httpx.get(url + "/v1/models")
    assert not [r for r in caplog.records if r.name == "mmgate.access"]


KEY = "sk-test-raw-key-7f3Qz"
OTHER_KEY = "sk-test-other-key-9Lw"
CAPPED_KEY = "sk-test-capped-key-2Vb"


def test_the_log_names_the_tenant_by_its_key_digest_and_the_band(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, upstream = stub
    caplog.set_level(logging.DEBUG)  # every logger of the servers: the raw key must be in none of them
    key_id, other_id, capped_id = (api_key_id(key.encode()) for key in (KEY, OTHER_KEY, CAPPED_KEY))
    limits = {
        "max_multimodal_cpu_bytes": 1 << 20,
        # tenant_from: api_key, the default; the configured tenants are named by their keys' digests.
        "fairness": {"tenants": {key_id: {}, capped_id: {"max_bytes_in_use": 1024}}},
    }
    body = chat_body(data_url(image_bytes(64, 64)))
    sent = [
        ("interactive", {"authorization": f"Bearer {KEY}"}),
        ("batch", {"x-api-key": KEY, "x-mmgate-priority": "batch"}),
        ("unconfigured", {"authorization": f"Bearer {OTHER_KEY}"}),
        ("capped", {"authorization": f"Bearer {CAPPED_KEY}"}),
        ("anonymous", {}),
    ]
    with make_gateway(upstream, server={"access_log": True}, limits=limits) as (_, url):
        statuses = {
            name: httpx.post(
                url + "/v1/chat/completions", content=body, headers={"x-request-id": name, **headers}
            ).status_code
            for name, headers in sent
        }
        exposition = httpx.get(url + "/metrics").text
    lines = {
        line["request_id"]: line
        for line in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access")
        if line["request_id"] in statuses
    }
    # What the gateway (and the stub upstream, and uvicorn) logged, not this test's own HTTP client.
    logged = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))
    fields = {name: (line["tenant"], line["tenant_id"], line["band"]) for name, line in lines.items()}
    assert statuses == {"interactive": 200, "batch": 200, "unconfigured": 200, "capped": 429, "anonymous": 200}
    assert fields == {
        "interactive": (key_id, key_id, "interactive"),
        # The same key sent as Anthropic clients send it is the same tenant; the header puts it in the batch band.
        "batch": (key_id, key_id, "batch"),
        "unconfigured": ("other", other_id, "interactive"),
        # Refused for its tenant's cap before it waited: the line still says whose it was.
        "capped": (capped_id, capped_id, "interactive"),
        "anonymous": ("other", "default", "interactive"),
    }
    assert lines["capped"]["rejection"] == "tenant_cap"
    assert all(line["budget_wait_s"] is not None for name, line in lines.items() if name != "capped")
    # The configured tenants are their own label; the keys themselves are nowhere.
    assert f'mmgate_tenant_budget_granted_bytes_total{{tenant="{key_id}"}}' in exposition
    for key in (KEY, OTHER_KEY, CAPPED_KEY):
        assert key not in logged
        assert key not in exposition


def test_without_fair_queueing_the_log_names_no_tenant(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    limits = {"max_multimodal_cpu_bytes": 1 << 20, "fairness": {"enabled": False}}
    with make_gateway(upstream, server={"access_log": True}, limits=limits) as (_, url):
        response = httpx.post(
            url + "/v1/chat/completions",
            content=chat_body(data_url(image_bytes(64, 64))),
            headers={"authorization": f"Bearer {KEY}", "x-mmgate-priority": "batch"},
        )
    (line,) = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    assert response.status_code == 200
    assert line["media_items"] == 1
    assert not {"tenant", "tenant_id", "band"} & set(line)
    assert KEY not in caplog.text


def test_a_finished_request_is_freed_without_the_garbage_collector(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    # The server's receive and send belong to the object that holds the scope; the exchange in the scope holds
    # them. Were it left there, every request would be cyclic garbage that only a collection frees.
    _, upstream = stub
    with make_gateway(upstream, server={"access_log": True}) as (_, url), httpx.Client() as client:
        client.post(url + "/v1/chat/completions", content=b'{"a": 1}')

        def chat() -> None:
            assert client.post(url + "/v1/chat/completions", content=b'{"a": 1}').status_code == 200

        assert_freed_with_each_request(chat, Exchange)
