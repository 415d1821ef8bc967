"""`errors.expose_internal`: what a client is told of a 502 or 504, and what the log keeps."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from gateway.envelopes import client_message
from gateway.errors import BadGateway, BadRequest, GatewayTimeout
from tests.conftest import GatewayFactory
from tests.servers import free_port


def test_client_message_keeps_the_setting_and_drops_the_address() -> None:
    timeout = GatewayTimeout("upstream http://10.1.2.3:8001 timed out after upstream.read_timeout_s=600")
    assert client_message(timeout, "r1") == (
        "the upstream model server timed out (upstream.read_timeout_s=600); request id r1"
    )
    unreachable = BadGateway(
        "upstream http://upstream.internal:8001 unreachable: Cannot connect to host upstream.internal:8001 "
        "[Connect call failed ('10.1.2.3', 8001)]"
    )
    message = client_message(unreachable, "r2")
    assert message == "the upstream model server is unreachable or failed; request id r2"
    engine = BadGateway("the engine refused the gateway's credentials (engine.auth_token): wrong token")
    assert (
        client_message(engine, "r3")
        == "the upstream model server is unreachable or failed (engine.auth_token); request id r3"
    )
    refused = BadRequest("image 0: 9 bytes over limits.x")
    assert client_message(refused, "r4") == refused.message


@pytest.mark.parametrize("expose", [False, True])
def test_unreachable_upstream_body_and_log(
    make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture, expose: bool
) -> None:
    caplog.set_level(logging.INFO, logger="mmgate.access")
    dead = f"http://127.0.0.1:{free_port()}"
    with make_gateway(dead, server={"access_log": True}, errors={"expose_internal": expose}) as (_, url):
        response = httpx.post(
            url + "/v1/chat/completions", json={"model": "m", "messages": []}, headers={"x-request-id": "e1"}
        )
    assert response.status_code == 502
    message = response.json()["message"]
    line = next(orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access")
    # The log has the full detail whatever the client was told.
    assert dead in line["error"]
    assert line["rejection"] == "upstream_unreachable"
    if expose:
        assert dead in message
    else:
        assert message == "the upstream model server is unreachable or failed; request id e1"
        assert "127.0.0.1" not in response.text


@pytest.mark.parametrize("expose", [False, True])
def test_anthropic_route_hides_the_address_too(make_gateway: GatewayFactory, expose: bool) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with make_gateway(dead, errors={"expose_internal": expose}) as (_, url):
        response = httpx.post(url + "/v1/messages", json={"model": "m", "messages": [], "max_tokens": 1})
    assert response.status_code == 502
    assert response.json()["type"] == "error"
    assert (dead in response.text) is expose
