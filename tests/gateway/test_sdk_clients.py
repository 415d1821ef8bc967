"""The official SDKs as clients: a refusal must surface as their status error, with our status and message."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.stub_upstream import StubUpstream

CAP = 2048


def test_openai_sdk_sees_413_with_our_message(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (CAP * 2)}])
    error = raised.value
    assert error.status_code == 413
    assert isinstance(error.body, dict)
    assert error.body["type"] == "RequestTooLargeError"
    assert f"over limits.max_request_body_bytes={CAP:,}" in error.body["message"]
    assert f"limits.max_request_body_bytes={CAP:,}" in str(error)


def test_openai_sdk_nested_envelope(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}, errors={"openai_envelope": "openai"}) as (
        _,
        url,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (CAP * 2)}])
    assert raised.value.status_code == 413
    assert raised.value.code == "request_too_large"
    assert raised.value.type == "RequestTooLargeError"
    assert f"limits.max_request_body_bytes={CAP:,}" in raised.value.message


def test_anthropic_sdk_sees_413_with_our_message(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as raised:
            client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x" * (CAP * 2)}])
    error = raised.value
    assert error.status_code == 413
    assert isinstance(error.body, dict)
    assert error.body["error"]["type"] == "request_too_large"
    assert f"limits.max_request_body_bytes={CAP:,}" in error.message


def test_sdk_requests_under_the_cap_pass(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits={"max_request_body_bytes": CAP}) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert raw.http_response.status_code == 200
    assert app.state.paths() == ["/v1/chat/completions"]
