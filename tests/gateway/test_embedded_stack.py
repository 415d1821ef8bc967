"""What an SDK user tries first against `make run`'s stack (engine with the reference responder, gateway in engine
mode in front of it, both from configs/engine.yaml and configs/demo.yaml), served in-process; and the access log
lines of both processes, parsed as JSON with every field checked."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import yaml

from engine_adapter.__main__ import ENGINE
from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings
from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import GatewaySettings
from tests.conftest import merge
from tests.gateway.media_factory import data_url, image_bytes
from tests.observe import metric
from tests.servers import ROOT, ServerThread

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
CLIENT = re.compile(r"^127\.0\.0\.1:\d+$")


def _yaml(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "configs" / name).read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Gateway, str]]:
    engine_settings = EngineSettings(**merge(_yaml("engine.yaml"), {"model": {"device": "cpu", "dtype": "float32"}}))
    engine = EngineApp(engine_settings)
    # The engine's server config serves it inside its access log (`ENGINE.wrap`), as `make run` does.
    with ServerThread(engine, config=ENGINE.server_config(engine, engine_settings)) as e:
        demo = merge(_yaml("demo.yaml"), {"upstream": {"url": e.url}, "engine": {"url": e.url}})
        settings = GatewaySettings(**demo)
        gateway = Gateway(settings)
        with ServerThread(gateway, config=GATEWAY.server_config(gateway, settings)) as g:
            yield gateway, g.url


def test_models_list_answers_through_the_gateway(stack: tuple[Gateway, str]) -> None:
    _, url = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == ["mmgate-reference"]


def test_chat_with_an_image_answers_through_the_openai_sdk(stack: tuple[Gateway, str]) -> None:
    _, url = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="demo",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 64))}},
                ],
            }
        ],
    )
    assert answer.choices[0].message.content is not None
    assert answer.choices[0].message.content.startswith("image 0: 4 rows x 128")


def test_responses_with_an_image_is_refused_before_decoding(stack: tuple[Gateway, str]) -> None:
    gateway, url = stack
    decoded_before = metric(url, "mmgate_media_items_total", modality="image")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="demo",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in this picture?"},
                        {"type": "input_image", "image_url": data_url(image_bytes(64, 64)), "detail": "auto"},
                    ],
                }
            ],
        )
    assert caught.value.status_code == 400
    message = str(caught.value)
    assert "engine mode covers /v1/chat/completions only" in message
    assert "/v1/responses" in message
    assert metric(url, "mmgate_media_items_total", modality="image") == decoded_before
    assert metric(url, "mmgate_rejections_total", route="/v1/responses", reason="unsupported_route") == 1
    assert gateway.budget.capacity is not None


def test_anthropic_messages_with_an_image_is_refused_before_decoding(stack: tuple[Gateway, str]) -> None:
    _, url = stack
    decoded_before = metric(url, "mmgate_media_items_total", modality="image")
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    image = base64.b64encode(image_bytes(64, 64)).decode()
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="demo",
            max_tokens=16,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": image}},
                    ],
                }
            ],
        )
    assert caught.value.status_code == 400
    assert "engine mode covers /v1/chat/completions only" in str(caught.value)
    assert metric(url, "mmgate_media_items_total", modality="image") == decoded_before


def test_access_log_lines_of_both_processes(stack: tuple[Gateway, str], caplog: pytest.LogCaptureFixture) -> None:
    _, url = stack
    caplog.set_level(logging.INFO, logger="mmgate.access")
    body = {
        "model": "demo",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 64))}}],
            }
        ],
    }
    ttfb_before = metric(url, "mmgate_upstream_ttfb_seconds_count", route="/v1/chat/completions")
    response = httpx.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": "log-1", "user-agent": "sdk-test/1.0"},
        timeout=60,
    )
    assert response.status_code == 200
    assert metric(url, "mmgate_upstream_ttfb_seconds_count", route="/v1/chat/completions") == ttfb_before + 1
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    gateway_line = next(line for line in lines if "route" in line and line["request_id"] == "log-1")
    engine_lines = [line for line in lines if "route" not in line]
    assert set(gateway_line) == {
        "ts",
        "request_id",
        "client",
        "method",
        "path",
        "user_agent",
        "route",
        "model",
        "status",
        "body_bytes",
        "response_bytes",
        "duration_s",
        "upstream_ttfb_s",
        "rejection",
        "error",
        "media_items",
        "media_counted_bytes",
        "budget_wait_s",
        "body_wait_s",
        "tenant",
        "tenant_id",
        "band",
    }
    assert ISO_UTC.match(gateway_line["ts"])
    assert CLIENT.match(gateway_line["client"])
    assert gateway_line["method"] == "POST"
    assert gateway_line["path"] == gateway_line["route"] == "/v1/chat/completions"
    assert gateway_line["user_agent"] == "sdk-test/1.0"
    assert gateway_line["model"] == "demo"
    assert gateway_line["status"] == 200
    assert gateway_line["body_bytes"] == len(response.request.content)
    assert gateway_line["response_bytes"] == len(response.content)
    assert 0 < gateway_line["upstream_ttfb_s"] <= gateway_line["duration_s"]
    assert gateway_line["rejection"] is None
    assert gateway_line["error"] is None
    assert gateway_line["media_items"] == 1
    assert gateway_line["media_counted_bytes"] > 64 * 64 * 3
    assert gateway_line["budget_wait_s"] >= 0
    # The engine logs the submit (under the gateway's request id) and the response it streamed.
    submit = next(line for line in engine_lines if line["request_id"] == "log-1")
    assert submit["path"] == "/internal/v1/requests"
    answer = next(line for line in engine_lines if line["path"].endswith("/response"))
    assert re.fullmatch(r"/internal/v1/requests/[0-9a-f]+/response", answer["path"])
    assert answer["method"] == "GET"
    assert answer["status"] == 200
    assert answer["response_bytes"] == len(response.content)
    assert set(submit) == {
        "ts",
        "request_id",
        "client",
        "method",
        "path",
        "user_agent",
        "status",
        "body_bytes",
        "response_bytes",
        "duration_s",
    }
    assert ISO_UTC.match(submit["ts"])
    assert CLIENT.match(submit["client"])
    assert submit["method"] == "POST"
    assert submit["status"] == 202
    assert submit["body_bytes"] > 0
    assert submit["response_bytes"] > 0
    assert submit["duration_s"] > 0
    assert submit["user_agent"].startswith("Python/")  # aiohttp's
