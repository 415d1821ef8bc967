"""Images on every route vLLM 0.32 reads them from, through the gateway in proxy mode: http URLs the gateway
downloads once and forwards as the verified bytes, the Anthropic `/v1/messages` route (base64 and URL sources), the
Responses route (`input_image`), `/tokenize` and `/v1/embeddings`. Each answer is vLLM's own for the same bytes sent
inline; a pixel bomb is refused 413 in the route's envelope and never reaches vLLM.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.e2e.support import (
    MODEL,
    Answer,
    MediaServer,
    VLLMServer,
    data_url,
    image_chat,
    pattern_jpeg,
    post,
    url_chat,
)
from tests.gateway.media_factory import jpeg_header_claiming
from tests.observe import metric

pytestmark = pytest.mark.timeout(600)

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "seed": 1234}
# A JPEG whose header claims 20000 x 20000 = 400,000,000 pixels, over limits.max_image_pixels (Pillow's threshold).
BOMB_SIDE = 20000
BOMB_MESSAGE = "over limits.max_image_pixels=178,956,970"


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [pattern_jpeg(300, 500, 21), pattern_jpeg(500, 300, 22), pattern_jpeg(224, 224, 23)]


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return jpeg_header_claiming(BOMB_SIDE, BOMB_SIDE)


def refused_before_vllm(gateway_url: str, vllm: VLLMServer, path: str, body: dict[str, Any]) -> Any:
    """`body` sent to the gateway's `path`: a 413, and no request for `path` in vLLM's access log; its JSON."""
    before = vllm.requests_to(path)
    refused = post(gateway_url, body, path)
    print(f"\n{path} with a bomb: {refused.status_code} {refused.text}")
    assert refused.status_code == 413, refused.text
    assert vllm.requests_to(path) == before, f"vLLM got a request on {path} that the gateway refused"
    return refused.json()


def counted_bytes(gateway_url: str) -> float:
    """What the gateway has charged so far (`mmgate_media_counted_bytes_sum`)."""
    return metric(gateway_url, "mmgate_media_counted_bytes_sum")


# --- image URLs -----------------------------------------------------------------------------------------------


def test_an_image_url_is_fetched_once_and_answered_as_its_bytes_inline(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes]
) -> None:
    """Served on loopback (allowed by `media.fetch.allowed_networks`), the file changes after its first download:
    the gateway's answer is vLLM's for the first bytes sent inline, which only the gateway's download got; vLLM
    sent the URL itself downloads the changed file."""
    first, changed = jpegs[0], jpegs[1]
    with MediaServer() as media:
        url = media.serve("/photo", first, changed)
        got = Answer.of(post(gateway_url, url_chat(url, **GREEDY)))
        downloads = media.gets["/photo"]
        refetched = Answer.of(post(vllm.url, url_chat(url, **GREEDY)))
    want = Answer.of(post(vllm.url, image_chat(first, **GREEDY)))
    print(f"\nan image URL through the gateway: {downloads} download(s), {got.text!r}; vLLM's own: {refetched.text!r}")
    assert downloads == 1
    assert got == want
    assert refetched == Answer.of(post(vllm.url, image_chat(changed, **GREEDY)))
    assert refetched.text != want.text, "the changed file gives the same answer: the check shows nothing"


def test_several_image_urls_and_inline_images_in_one_request(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes]
) -> None:
    with MediaServer() as media:
        urls = [media.serve(f"/{n}", jpeg) for n, jpeg in enumerate(jpegs[:2])]
        got = Answer.of(post(gateway_url, url_chat(urls[0], data_url(jpegs[2]), urls[1], **GREEDY)))
        downloads = dict(media.gets)
    want = Answer.of(post(vllm.url, image_chat(jpegs[0], jpegs[2], jpegs[1], **GREEDY)))
    assert downloads == {"/0": 1, "/1": 1}
    assert got == want


# --- /v1/messages (Anthropic) -----------------------------------------------------------------------------------


def messages(*sources: dict[str, Any], text: str = "Describe the image.") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image", "source": source} for source in sources]
    content.append({"type": "text", "text": text})
    return {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": content}]}


def base64_source(jpeg: bytes) -> dict[str, Any]:
    return {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(jpeg).decode()}


def anthropic_answer(response: Any) -> tuple[Any, ...]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["type"], body["role"], body["content"], body["stop_reason"], body["usage"]


def test_messages_with_base64_and_url_sources_answer_as_vllm_directly(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes]
) -> None:
    direct = post(vllm.url, messages(*map(base64_source, jpegs[:2])), "/v1/messages")
    want = anthropic_answer(direct)
    through = anthropic_answer(post(gateway_url, messages(*map(base64_source, jpegs[:2])), "/v1/messages"))
    with MediaServer() as media:
        url_source = {"type": "url", "url": media.serve("/second", jpegs[1])}
        fetched = anthropic_answer(post(gateway_url, messages(base64_source(jpegs[0]), url_source), "/v1/messages"))
        downloads = media.gets["/second"]
    print(f"\n/v1/messages: {want}")
    assert want[3] == "max_tokens"
    assert through == want
    assert fetched == want
    assert downloads == 1
    # The images reached the model: another pair answers otherwise.
    other = anthropic_answer(post(vllm.url, messages(*map(base64_source, jpegs[1:3])), "/v1/messages"))
    assert other[2] != want[2]


def test_a_pixel_bomb_on_messages_is_413_in_anthropics_envelope(
    vllm: VLLMServer, gateway_url: str, bomb: bytes, jpegs: list[bytes]
) -> None:
    body = refused_before_vllm(
        gateway_url, vllm, "/v1/messages", messages(base64_source(jpegs[0]), base64_source(bomb))
    )
    assert body["type"] == "error"
    assert body["error"]["type"] == "request_too_large"
    assert BOMB_MESSAGE in body["error"]["message"]


# --- /v1/responses ----------------------------------------------------------------------------------------------


def responses(*urls: str, text: str = "Describe the image.") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "input_image", "image_url": url} for url in urls]
    content.append({"type": "input_text", "text": text})
    return {
        "model": MODEL,
        "max_output_tokens": 16,
        "temperature": 0,
        "input": [{"role": "user", "content": content}],
    }


def responses_answer(response: Any) -> tuple[Any, ...]:
    assert response.status_code == 200, response.text
    body = response.json()
    texts = [part["text"] for item in body["output"] for part in item.get("content") or [] if "text" in part]
    # Without the cached-token details: how much of the prompt vLLM's prefix cache held depends on what came before.
    usage = {key: body["usage"][key] for key in ("input_tokens", "output_tokens", "total_tokens")}
    return body["status"], body["incomplete_details"], texts, usage


def test_responses_with_input_images_answer_as_vllm_directly(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes]
) -> None:
    inline = responses(data_url(jpegs[0]), data_url(jpegs[2]))
    want = responses_answer(post(vllm.url, inline, "/v1/responses"))
    got = responses_answer(post(gateway_url, inline, "/v1/responses"))
    with MediaServer() as media:
        fetched = responses_answer(
            post(gateway_url, responses(media.serve("/a", jpegs[0]), data_url(jpegs[2])), "/v1/responses")
        )
    print(f"\n/v1/responses: {want}")
    assert got == want
    assert fetched == want
    other = responses_answer(post(vllm.url, responses(data_url(jpegs[1]), data_url(jpegs[2])), "/v1/responses"))
    assert other[2] != want[2]


def test_a_pixel_bomb_on_responses_is_413_in_the_openai_envelope(
    vllm: VLLMServer, gateway_url: str, bomb: bytes
) -> None:
    body = refused_before_vllm(gateway_url, vllm, "/v1/responses", responses(data_url(bomb)))
    assert (body["object"], body["type"], body["code"]) == ("error", "RequestTooLargeError", 413)
    assert BOMB_MESSAGE in body["message"]


# --- /tokenize and /v1/embeddings (docs/admission.md, "Routes that read media") ----------------------------------


def test_tokenize_with_an_image_is_charged_and_answered_as_vllm_directly(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes], bomb: bytes
) -> None:
    request = {key: value for key, value in image_chat(jpegs[0]).items() if key in ("model", "messages")}
    direct = post(vllm.url, request, "/tokenize")
    charged = counted_bytes(gateway_url)
    through = post(gateway_url, request, "/tokenize")
    charged = counted_bytes(gateway_url) - charged
    print(f"\n/tokenize: {direct.json()['count']} tokens; the gateway charged {charged:,.0f} bytes")
    assert direct.status_code == through.status_code == 200
    assert through.json() == direct.json()
    # 300 x 500 is resized to 308 x 504: 198 merged patches, each a placeholder token.
    assert direct.json()["count"] > 198
    assert charged > 0

    bombed = {**request, "messages": image_chat(bomb)["messages"]}
    assert BOMB_MESSAGE in refused_before_vllm(gateway_url, vllm, "/tokenize", bombed)["message"]


def test_embeddings_with_an_image_are_charged_and_get_vllms_own_answer(
    vllm: VLLMServer, gateway_url: str, jpegs: list[bytes], bomb: bytes
) -> None:
    """vLLM serves /v1/embeddings only for a pooling model: for this generative one it answers 404 itself. The
    gateway still finds and charges the image (the route is admitted), forwards the request and relays the 404."""
    request = {"model": MODEL, "messages": image_chat(jpegs[1])["messages"]}
    direct = post(vllm.url, request, "/v1/embeddings")
    charged = counted_bytes(gateway_url)
    through = post(gateway_url, request, "/v1/embeddings")
    charged = counted_bytes(gateway_url) - charged
    print(f"\n/v1/embeddings: vLLM {direct.status_code} {direct.text}; the gateway charged {charged:,.0f} bytes")
    assert direct.status_code == 404
    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    assert charged > 0

    bombed = {**request, "messages": image_chat(bomb)["messages"]}
    assert BOMB_MESSAGE in refused_before_vllm(gateway_url, vllm, "/v1/embeddings", bombed)["message"]
