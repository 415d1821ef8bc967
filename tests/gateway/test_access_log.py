from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.stub_upstream import StubUpstream


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
