"""Engine mode pieces that need no engine: the request the engine gets, the pixels it gets, error mapping.
Gateway → engine → LLM through real servers is in tests/engine_adapter/test_gateway_engine_mode.py."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image

from engine_adapter.app import EngineApp
from engine_adapter.client import EngineRefusal
from gateway.engine_mode import engine_document, engine_error
from gateway.errors import BadGateway, BadRequest, RateLimited, RequestTooLarge, ServiceUnavailable
from gateway.media.body import parse_request_body
from gateway.media.parts import find_media
from gateway.media.resize import ModelResize
from processor_geometry import QWEN2_VL, smart_resize
from tests.conftest import (
    EngineFactory,
    GatewayFactory,
    engine_settings,
)
from tests.engine_adapter.conftest import (
    REQUESTS,
    wait_idle,
)
from tests.engine_adapter.stub_llm import StubLLM
from tests.gateway.media_factory import chat_body, data_url, image_bytes, messages_body, responses_body
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric, wait_until
from tests.servers import ServerThread
from tests.stub_asgi import request_body


def test_media_parts_become_item_references_and_long_text_is_restored() -> None:
    image = "data:image/png;base64," + base64.b64encode(os.urandom(800_000)).decode()
    long_text = "A" * 300_000
    document = {
        "model": "m",
        "stream": True,
        "messages": [
            {"role": "system", "content": long_text},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            },
        ],
    }
    parsed = parse_request_body(orjson.dumps(document))
    refs = find_media("/v1/chat/completions", parsed)
    sent = engine_document(parsed, refs)
    assert sent["messages"][0]["content"] == long_text
    assert sent["messages"][1]["content"] == [
        {"type": "text", "text": "first"},
        {"type": "mmgate_item", "index": 0},
        {"type": "mmgate_item", "index": 1},
    ]
    assert sent["stream"] is True
    assert len(orjson.dumps(sent)) < 310_000  # no pixels or base64 travel in the JSON


def test_model_resize_resizes_for_the_model_and_hashes_the_pixels() -> None:
    prepare = ModelResize(QWEN2_VL).image
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8))
    pixels, digest = prepare(image)
    assert pixels.dtype == np.uint8
    assert pixels.shape == (*smart_resize(300, 500, 28, QWEN2_VL.min_pixels, QWEN2_VL.max_pixels), 3)
    assert prepare(image)[1] == digest
    other = image.copy()
    other.putpixel((0, 0), (1, 2, 3))
    assert prepare(other)[1] != digest
    out = io.BytesIO()
    image.save(out, format="PNG")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (413, RequestTooLarge),
        (400, BadRequest),
        (429, RateLimited),
        (503, ServiceUnavailable),
        (401, BadGateway),
        (500, BadGateway),
    ],
)
def test_engine_errors_map_to_the_gateway_tree(status: int, kind: type) -> None:
    error = engine_error(EngineRefusal(status, "request needs 9 bytes, over encoder.max_resident_bytes=8", "r"))
    assert isinstance(error, kind)
    assert "encoder.max_resident_bytes=8" in error.message


# Gateway -> engine -> LLM, all real servers on loopback.


def engine_mode(engine_url: str, **extra: Any) -> dict[str, Any]:
    return {"engine": {"url": engine_url, **extra}, "media": {"processor": "qwen2_vl"}}


def test_media_chat_goes_through_the_engine_and_the_llm_gets_the_embeddings(
    make_engine: EngineFactory,
    stub_llm: tuple[StubLLM, str],
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
) -> None:
    llm, llm_url = stub_llm
    upstream, upstream_url = stub
    llm.state.hold = True
    # 300x500 resizes to 308x504 for Qwen2-VL: 11x18 merged patches = 198 rows; 64x64 to 56x56: 4 rows.
    body = chat_body(data_url(image_bytes(500, 300)), data_url(image_bytes(64, 64, seed=1)), text="compare them")
    handoff = {"backend": "openai", "url": llm_url, "format": "vllm"}
    with (
        make_engine(handoff=handoff) as (_, engine_url),
        make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url),
        ThreadPoolExecutor(1) as pool,
    ):
        answer = pool.submit(httpx.post, url + "/v1/chat/completions", content=body, timeout=60)
        assert llm.state.arrived.wait(20)
        # The engine admitted the request (202): the gateway's budget is already back.
        assert metric(url, "mmgate_budget_in_use_bytes") == 0
        llm.release()
        response = answer.result()
        wait_idle(engine_url)
    assert response.status_code == 200
    assert response.json() == {"choices": [{"message": {"content": "stub saw 2 image embed(s)"}}]}
    (seen,) = llm.state.received
    assert [tuple(e.shape) for e in seen.embeds] == [(198, 128), (4, 128)]
    assert [g.tolist() for g in seen.grids if g is not None] == [[1, 22, 36], [1, 4, 4]]
    content = seen.document["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "compare them"}
    assert [part["type"] for part in content[1:]] == ["image_embeds", "image_embeds"]
    assert seen.headers["x-request-id"] == response.headers["x-request-id"]
    assert upstream.state.requests == []  # media chat never reached the plain upstream


def test_reference_backend_streams_through_the_gateway(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    body = orjson.loads(chat_body(data_url(image_bytes(56, 56))))
    body["stream"] = True
    with (
        make_engine() as (_, engine_url),
        make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url),
        httpx.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body), timeout=60) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(
        orjson.loads(e.removeprefix("data: "))["choices"][0]["delta"].get("content", "") for e in events[:-1]
    )
    assert text.startswith("image 0: 4 rows x 128, sha256 ")


def test_text_and_other_routes_still_go_upstream(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    upstream, upstream_url = stub
    with make_engine() as (_, engine_url), make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url):
        text = httpx.post(url + "/v1/chat/completions", content=chat_body(), timeout=30)
        messages = httpx.post(url + "/v1/messages", content=messages_body(), timeout=30)
        ready = httpx.get(url + "/readyz", timeout=10)
    assert text.status_code == 200
    assert messages.status_code == 200
    assert upstream.state.paths() == ["/v1/chat/completions", "/v1/messages", "/health"]
    assert ready.json()["engine"] == "200, qwen2_vl geometry"  # no internal address on the public port


IMAGE_PART = {"type": "image_url", "image_url": {"url": data_url(image_bytes(32, 32))}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", messages_body(image_bytes(32, 32))),
        ("/v1/responses", responses_body(data_url(image_bytes(32, 32)))),
        # Routes vLLM reads media from whose requests the engine does not take (gateway/media_defaults.py MEDIA_ROUTES).
        ("/tokenize", chat_body(data_url(image_bytes(32, 32)))),
        ("/v1/embeddings", orjson.dumps({"input": [{"role": "user", "content": [IMAGE_PART]}]})),
        ("/invocations", orjson.dumps({"query": "q", "documents": [{"content": [IMAGE_PART]}]})),
    ],
)
def test_media_on_a_route_engine_mode_does_not_cover_is_a_400_before_any_decode(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, path: str, body: bytes
) -> None:
    upstream, upstream_url = stub
    with make_engine() as (_, engine_url), make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url):
        response = httpx.post(url + path, content=body, timeout=30)
        decodes = metric(url, "mmgate_media_items_total", modality="image")
        waited = metric(url, "mmgate_budget_wait_seconds_count")
    assert response.status_code == 400
    assert "engine mode covers /v1/chat/completions only" in response.text
    assert decodes == 0
    assert waited == 0  # refused before the budget was asked
    assert upstream.state.paths() == []


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
    ],
)
def test_audio_is_a_400_before_any_decode(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, part: dict[str, Any]
) -> None:
    upstream, upstream_url = stub
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(32, 32))}}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [image, part]}]})
    with make_engine() as (_, engine_url), make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
        decodes = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == 400, response.text
    assert response.json()["message"].startswith("messages[0].content[1]")
    assert "encodes images and videos, not audio: its vision towers have no audio encoder" in response.json()["message"]
    assert decodes == 0
    assert in_use == 0
    assert upstream.state.paths() == []


def test_engine_refusal_comes_back_in_the_route_envelope(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    body = chat_body(data_url(image_bytes(500, 300)))
    with (
        make_engine(encoder={"max_resident_bytes": 4096}) as (_, engine_url),
        make_gateway(upstream_url, errors={"openai_envelope": "openai"}, **engine_mode(engine_url)) as (_, url),
    ):
        response = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
        in_use = metric(url, "mmgate_budget_in_use_bytes")
        wait_idle(engine_url)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "RequestTooLargeError"
    assert (
        "encoder.max_resident_bytes=4,096" in error["message"] or "encoder.max_resident_bytes=4096" in error["message"]
    )
    assert in_use == 0


def test_client_that_leaves_frees_the_engine_buffer(
    make_engine: EngineFactory,
    stub_llm: tuple[StubLLM, str],
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
) -> None:
    llm, llm_url = stub_llm
    _, upstream_url = stub
    llm.state.hold = True
    handoff = {"backend": "openai", "url": llm_url, "format": "trtllm"}
    with (
        make_engine(handoff=handoff) as (_, engine_url),
        make_gateway(upstream_url, **engine_mode(engine_url)) as (_, url),
    ):

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                request = asyncio.ensure_future(
                    client.post(url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(64, 64))))
                )
                await asyncio.to_thread(llm.state.arrived.wait, 20)
                request.cancel()

        asyncio.run(leave())
        wait_until(llm.state.disconnected.is_set, 10, "the engine to drop its call to the LLM")
        idle = wait_idle(engine_url)
    assert idle["resident_bytes"] == 0


class HeldSubmits:
    """The real engine, except that a submit is read and then left unanswered until its caller goes (`left` is
    set then): an engine that has not admitted the request yet."""

    def __init__(self, engine: EngineApp) -> None:
        self.engine = engine
        self.arrived = threading.Event()
        self.left = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) != ("POST", REQUESTS):
            await self.engine(scope, receive, send)
            return
        await request_body(receive)
        self.arrived.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left.set()


def test_client_that_leaves_before_the_engine_admits_its_request_closes_the_submit(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    engine = HeldSubmits(EngineApp(engine_settings()))
    with (
        ServerThread(engine) as engine_server,
        make_gateway(upstream_url, **engine_mode(engine_server.url)) as (_, url),
    ):

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                request = asyncio.ensure_future(
                    client.post(url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(64, 64))))
                )
                await asyncio.to_thread(engine.arrived.wait, 20)
                request.cancel()

        asyncio.run(leave())
        assert engine.left.wait(10), "the gateway kept the submit open after its client left"
        wait_until(lambda: metric(url, "mmgate_budget_in_use_bytes") == 0, 10, "the reservation to come back")
