"""Proxy mode in front of a real vLLM: what a client gets through the gateway is what vLLM answers directly."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.support import (
    IMAGE_LIMIT,
    MODEL,
    VLLMServer,
    image_chat,
    pattern_jpeg,
    sse_events,
    streamed_text_and_usage,
)

pytestmark = pytest.mark.timeout(600)

# Greedy and seeded: the same request gets the same tokens, so direct and proxied answers can be compared.
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "seed": 1234}
SIDE = 224  # 224 x 224 is 8 x 8 merged patches: 64 image tokens for Qwen2-VL
IMAGE_TOKENS = (SIDE // 28) ** 2


def post(base_url: str, body: bytes) -> httpx.Response:
    return httpx.post(
        base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=120
    )


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_image_chats_through_the_gateway_answer_as_vllm_does_directly(vllm: VLLMServer, gateway_url: str) -> None:
    texts = []
    for seed in range(3):
        body = encoded(image_chat(pattern_jpeg(SIDE, SIDE, seed), **GREEDY))
        direct, proxied = post(vllm.url, body), post(gateway_url, body)
        assert direct.status_code == 200, direct.text
        assert proxied.status_code == 200, proxied.text
        want, got = direct.json(), proxied.json()
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
        assert got["usage"] == want["usage"]
        assert want["usage"]["completion_tokens"] == GREEDY["max_tokens"]
        # The image reached the model: its 64 placeholder tokens are in the prompt.
        assert want["usage"]["prompt_tokens"] > IMAGE_TOKENS
        texts.append(want["choices"][0]["message"]["content"])
    print(f"\ngreedy answers for three images: {texts}")
    assert len(set(texts)) == 3, f"three different images gave the same text, so the comparison shows nothing: {texts}"


def test_a_streamed_image_chat_through_the_gateway_is_vllms_stream(vllm: VLLMServer, gateway_url: str) -> None:
    request = image_chat(pattern_jpeg(SIDE, SIDE, 7), **GREEDY)
    body = encoded({**request, "stream": True, "stream_options": {"include_usage": True}})
    direct, proxied = post(vllm.url, body), post(gateway_url, body)
    assert direct.status_code == proxied.status_code == 200
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert proxied.headers["content-type"].startswith("text/event-stream")
    for response in (direct, proxied):
        assert sse_events(response.content)[-1] == "[DONE]"
        assert response.content.rstrip(b"\n").endswith(b"data: [DONE]")
    text, usage = streamed_text_and_usage(proxied.content)
    assert (text, usage) == streamed_text_and_usage(direct.content)
    assert usage is not None
    assert usage["completion_tokens"] == GREEDY["max_tokens"]
    # The same request unstreamed: the same tokens.
    whole = post(vllm.url, encoded(request)).json()
    assert usage == {key: value for key, value in whole["usage"].items() if value is not None}
    assert text == whole["choices"][0]["message"]["content"]
    # How many events carry the tokens is vLLM's timing (tokens of one engine step share an event), so the two
    # streams are compared by what each event is: one completion's chunks, then [DONE].
    for response in (direct, proxied):
        chunks = [json.loads(event) for event in sse_events(response.content)[:-1]]
        assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
        assert len({chunk["id"] for chunk in chunks}) == 1
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == usage


ERRORS: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {
    # vLLM's 404 for a model it does not serve.
    "unknown model": (lambda: image_chat(pattern_jpeg(SIDE, SIDE, 0), **{**GREEDY, "model": "no-such-model"}), 404),
    # vLLM's 400 for a prompt past its context (--max-model-len): a 2048 x 2048 image is 73 x 73 = 5329 tokens.
    # (vLLM 0.32 answers a max_tokens past the context by generating up to the context's end.)
    "a prompt past the context": (lambda: image_chat(pattern_jpeg(2048, 2048, 0), **GREEDY), 400),
    # vLLM's 400 for a max_tokens it does not take.
    "max_tokens 0": (lambda: image_chat(pattern_jpeg(SIDE, SIDE, 0), **{**GREEDY, "max_tokens": 0}), 400),
    # vLLM's 400 for one image more than --limit-mm-per-prompt; the gateway's own caps let them through.
    "images past --limit-mm-per-prompt": (
        lambda: image_chat(*(pattern_jpeg(32, 32, i) for i in range(IMAGE_LIMIT + 1)), **GREEDY),
        400,
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_vllms_own_errors_come_back_byte_for_byte(vllm: VLLMServer, gateway_url: str, case: str) -> None:
    build, status = ERRORS[case]
    body = encoded(build())
    direct, proxied = post(vllm.url, body), post(gateway_url, body)
    print(f"\n{case}: vLLM answers {direct.status_code} {direct.text}")
    assert direct.status_code == status, direct.text
    assert proxied.status_code == direct.status_code, f"status differs: gateway {proxied.text}, vLLM {direct.text}"
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert proxied.content == direct.content, (
        f"body differs:\n gateway {proxied.content!r}\n vLLM    {direct.content!r}"
    )


def test_the_openai_sdk_through_the_gateway(vllm: VLLMServer, gateway_url: str) -> None:
    request = image_chat(pattern_jpeg(SIDE, SIDE, 11), **GREEDY)
    direct = post(vllm.url, encoded(request)).json()
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    began = time.monotonic()
    completion = client.chat.completions.create(
        model=MODEL, messages=request["messages"], temperature=0, max_tokens=GREEDY["max_tokens"], seed=GREEDY["seed"]
    )
    print(f"\nan image chat through the gateway with the OpenAI SDK: {time.monotonic() - began:.2f} s")
    assert completion.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert completion.usage is not None
    assert completion.usage.model_dump(exclude_none=True) == {k: v for k, v in direct["usage"].items() if v is not None}

    stream = client.chat.completions.create(
        model=MODEL,
        messages=request["messages"],
        temperature=0,
        max_tokens=GREEDY["max_tokens"],
        seed=GREEDY["seed"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion.choices[0].message.content
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]

    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=request["messages"], max_tokens=4)
    refused = post(vllm.url, encoded({**request, "model": "no-such-model", "max_tokens": 4}))
    assert refused.status_code == 404
    assert raised.value.body == refused.json()["error"]
