"""Media shapes the upstreams load, through the real gateway: found, fetched through the SSRF guard, counted.

The shapes are the ones vLLM (main at 001eadcf, vllm/entrypoints/chat_utils.py `_parse_chat_message_content_mm_part`)
and trtllm-serve (main at 0c351902, tensorrt_llm/serve/chat_utils.py `parse_chat_message_content_part`) load; see
tests/gateway/media/test_parts.py for the rule each comes from.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.media.body import LONG_STRING_BYTES, SKELETON_MIN_BODY_BYTES
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media.audio.test_decode import make_audio
from tests.gateway.media_factory import image_bytes
from tests.gateway.media_stub import PUBLIC
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric
from tests.servers import ServerThread
from tests.stub_asgi import lifespan

METADATA = "http://169.254.169.254/latest/meta-data/"
CAP = 128 << 10


class Files:
    """A media server for the gateway's fetcher: fixed bytes per path; records each path and query it is asked."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.hits: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.hits.append((scope["path"], scope["query_string"].decode()))
        body = self.files.get(scope["path"])
        status = 200 if body is not None else 404
        body = body if body is not None else b""
        headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def files() -> Iterator[tuple[Files, str]]:
    # Real WAVs: 0.2 s (35 KB, decoded 12.8 KB at 16 kHz, forwarded as 47 KB of base64) fits the cap; 2 s (353 KB)
    # passes it while downloading.
    wavs = {"/small.wav": make_audio(seconds=0.2), "/big.wav": make_audio(seconds=2.0)}
    app = Files({**wavs, "/i.png": image_bytes(32, 32, "PNG")})
    with ServerThread(app, bind=(PUBLIC, 0)) as server:
        yield app, server.url


def gateway_options(forward: str = "inline") -> dict[str, Any]:
    fetch = {"allowed_networks": [f"{PUBLIC}/32"], "connect_timeout_s": 2.0, "read_timeout_s": 2.0, "forward": forward}
    limits = {"max_multimodal_cpu_bytes_per_request": CAP, "max_multimodal_cpu_bytes": 4 * CAP}
    return {"media": {"fetch": fetch}, "limits": {**limits, "charge_raw_body": False}}


def chat(*parts: dict[str, Any]) -> bytes:
    content = [{"type": "text", "text": "Listen."}, *parts]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def test_audio_url_is_downloaded_counted_and_forwarded(
    files: tuple[Files, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """An `audio_url` part (vLLM `parse_audio`, trtllm `audio_url`) is fetched with every byte counted, and goes
    upstream as a data URL of exactly those bytes."""
    server, files_url = files
    app, upstream = stub
    small = chat({"type": "audio_url", "audio_url": {"url": files_url + "/small.wav"}})
    big = chat({"audio_url": files_url + "/big.wav"})  # no `type`: vLLM infers it from the field
    with make_gateway(upstream, **gateway_options()) as (_, url):
        ok = httpx.post(url + "/v1/chat/completions", content=small)
        too_big = httpx.post(url + "/v1/chat/completions", content=big)
        items = metric(url, "mmgate_media_items_total", modality="audio", source="url")
    assert ok.status_code == 200
    assert too_big.status_code == 413
    assert f"limits.max_multimodal_cpu_bytes_per_request={CAP:,}" in too_big.json()["message"]
    assert [path for path, _ in server.hits] == ["/small.wav", "/big.wav"]
    assert items == 2
    data_url = "data:audio/wav;base64," + base64.b64encode(server.files["/small.wav"]).decode()
    assert [seen.body for seen in app.state.requests] == [chat({"type": "audio_url", "audio_url": {"url": data_url}})]


def test_every_shape_an_upstream_would_fetch_is_ssrf_checked(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """Each shape with the cloud metadata address is refused with 400 and never forwarded."""
    app, upstream = stub
    shapes: list[tuple[str, bytes]] = [
        ("/v1/chat/completions", chat({"type": "audio_url", "audio_url": {"url": METADATA}})),
        ("/v1/chat/completions", chat({"audio_url": METADATA})),
        ("/v1/chat/completions", chat({"image_url": METADATA})),
        ("/v1/chat/completions", chat({"image_url": {"url": METADATA}, "uuid": "u"})),
        ("/v1/chat/completions", chat({"type": "text", "text": "x", "uuid": "u", "video_url": METADATA})),
        ("/v1/chat/completions", chat({"type": "input_image", "image_url": METADATA, "detail": "auto"})),
        (
            "/v1/responses",
            orjson.dumps(
                {"input": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": METADATA}}]}]}
            ),
        ),
    ]
    with make_gateway(upstream, **gateway_options()) as (_, url):
        responses = [httpx.post(url + route, content=body) for route, body in shapes]
        blocked = sum(
            metric(url, "mmgate_rejections_total", route=route, reason="media_url_blocked")
            for route in ("/v1/chat/completions", "/v1/responses")
        )
        items = {source: metric(url, "mmgate_media_items_total", source=source) for source in ("url", "url_refused")}
    assert [r.status_code for r in responses] == [400] * len(shapes)
    # Counted as refused, not as URLs loaded: none of them was fetched.
    assert items == {"url": 0, "url_refused": len(shapes)}
    for response in responses:
        assert "169.254.169.254" in response.json()["message"]
    assert blocked == len(shapes)
    assert app.state.requests == []


def test_a_tensor_part_is_refused_naming_why(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    body = chat({"type": "image_embeds", "image_embeds": {"data": "AAAA"}})
    with make_gateway(upstream, **gateway_options()) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
    assert response.status_code == 400
    assert response.json()["message"] == (
        "messages[0].content[1]: image_embeds parts are not supported by this gateway: "
        "a serialized tensor, whose memory cannot be known before it is loaded"
    )
    assert app.state.requests == []


@pytest.mark.parametrize("forward", ["inline", "url"])
def test_a_long_anthropic_url_in_a_big_body_is_fetched_as_sent(
    files: tuple[Files, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, forward: str
) -> None:
    """A body of 1 MiB or more parses its literals of 4 KiB or more as placeholders; the URL fetched is the client's.
    The upstream gets the body as sent but for that URL, a data URL of the bytes downloaded (with `forward: url`, the
    body as sent)."""
    server, files_url = files
    app, upstream = stub
    pad = "x" * LONG_STRING_BYTES
    content = [
        {"type": "text", "text": "t" * SKELETON_MIN_BODY_BYTES},
        {"type": "image", "source": {"type": "url", "url": f"{files_url}/i.png?pad={pad}"}},
    ]
    body = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    options = gateway_options(forward)
    options["limits"]["max_multimodal_cpu_bytes_per_request"] = options["limits"]["max_multimodal_cpu_bytes"]
    with make_gateway(upstream, **options) as (_, url):
        response = httpx.post(url + "/v1/messages", content=body)
    assert response.status_code == 200, response.text
    assert server.hits == [("/i.png", f"pad={pad}")]
    inline = "data:image/png;base64," + base64.b64encode(server.files["/i.png"]).decode()
    forwarded = body.replace(orjson.dumps(f"{files_url}/i.png?pad={pad}"), orjson.dumps(inline))
    assert [seen.body for seen in app.state.requests] == [forwarded if forward == "inline" else body]


@pytest.mark.parametrize(
    ("route", "document"),
    [
        # The URL is the list's element itself (vLLM `CohereEmbedRequest.images`, `StructuredDecisionRequest.images`).
        ("/v2/embed", lambda url: {"model": "m", "input_type": "image", "images": [url]}),
        ("/v1/systemone", lambda url: {"state": "s", "questions": {}, "images": [url]}),
        # A flat `url` beside `type` (vLLM `GenerateRequest.content_parts`).
        (
            "/inference/v1/generate",
            lambda url: {"token_ids": [1], "content_parts": [{"type": "image_url", "url": url}]},
        ),
        # A score input's parts (vLLM `RerankRequest.documents`).
        ("/v1/rerank", lambda url: {"query": "q", "documents": ["d", {"content": [{"image_url": {"url": url}}]}]}),
    ],
)
def test_a_url_on_another_media_route_is_downloaded_and_forwarded_as_its_bytes(
    files: tuple[Files, str],
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    route: str,
    document: Any,
) -> None:
    server, files_url = files
    app, upstream = stub
    body = orjson.dumps(document(files_url + "/i.png"))
    with make_gateway(upstream, **gateway_options()) as (_, url):
        response = httpx.post(url + route, content=body)
    assert response.status_code == 200, response.text
    assert [path for path, _ in server.hits] == ["/i.png"]
    inline = "data:image/png;base64," + base64.b64encode(server.files["/i.png"]).decode()
    assert [seen.body for seen in app.state.requests] == [orjson.dumps(document(inline))]
