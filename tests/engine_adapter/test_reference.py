"""The reference responder: OpenAI chat shape (streaming and not), and a report of what it received that matches
the encoder's output computed independently."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import orjson
import torch

from engine_adapter.handoff import BufferedResponse, Handoff
from engine_adapter.intake import ItemInfo
from engine_adapter.models import build_vision_tower
from engine_adapter.processor import process_image
from engine_adapter.reference import describe_items, embedding_sha256, reference_response
from processor_geometry import QWEN2_VL
from tests.conftest import (
    EngineFactory,
)
from tests.engine_adapter.conftest import (
    REQUESTS,
    admitted,
    pixels,
    submit_body,
)

TEXT = "what is in this picture"  # 5 words


def direct_embeddings(image: Any) -> torch.Tensor:
    """The tiny tower's output for one image, computed without the engine."""
    model = build_vision_tower("tiny", seed=0).model
    visual = process_image(image, QWEN2_VL)
    with torch.inference_mode():
        return model(visual.pixel_values, visual.grid_thw)  # type: ignore[no-any-return]


def answer(url: str, body: bytes) -> httpx.Response:
    job_id = admitted(url, body)
    response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_reports_rows_width_and_the_sha256_of_the_real_embeddings(make_engine: EngineFactory) -> None:
    image = pixels(56, 84)
    expected = direct_embeddings(image)
    assert tuple(expected.shape) == (6, 128)
    digest = hashlib.sha256(expected.contiguous().numpy().tobytes()).hexdigest()
    with make_engine() as (_, url):
        response = answer(url, submit_body("ref-1", [image], text=TEXT, model="my-model"))
        assert response.headers["content-type"] == "application/json"
        data = response.json()
        again = answer(url, submit_body("ref-2", [image], text=TEXT, model="my-model")).json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "my-model"
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    content = choice["message"]["content"]
    assert content.splitlines() == [
        f"image 0: 6 rows x 128, sha256 {digest}",
        "reference reply: 1 item(s), 6 embedding row(s), 5 text token(s).",
    ]
    # Text words plus embedding rows; the reply's own words.
    assert data["usage"] == {
        "prompt_tokens": 5 + 6,
        "completion_tokens": len(content.split()),
        "total_tokens": 5 + 6 + len(content.split()),
    }
    assert again["choices"][0]["message"]["content"] == content  # deterministic


def sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


def test_streams_sse_chunks_that_add_up_to_the_same_answer(make_engine: EngineFactory) -> None:
    images = [pixels(56, 56), pixels(84, 56, seed=3)]
    with make_engine() as (_, url):
        whole = answer(url, submit_body("whole", images, text=TEXT)).json()["choices"][0]["message"]["content"]
        options = {"stream_options": {"include_usage": True}}
        streamed = answer(url, submit_body("streamed", images, text=TEXT, stream=True, extra=options))
    assert streamed.headers["content-type"] == "text/event-stream"
    events = sse_events(streamed.text)
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [event["choices"][0]["delta"].get("content", "") for event in events if event["choices"]]
    assert "".join(deltas) == whole
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["prompt_tokens"] == 5 + 4 + 6
    assert len({event["id"] for event in events}) == 1


def test_streams_without_a_usage_chunk_unless_asked(make_engine: EngineFactory) -> None:
    with make_engine() as (_, url):
        events = sse_events(answer(url, submit_body("plain", [pixels(56, 56)], stream=True)).text)
    assert all(event["choices"] for event in events)
    assert "usage" not in events[-1]


def handoff_of(embeddings: torch.Tensor, document: dict[str, Any]) -> Handoff:
    items = (ItemInfo("image", "a", (1, 4, 4), 4), ItemInfo("video", "b", (2, 4, 4), 8))
    return Handoff("engine-id", "wire-id", document, items, embeddings, (0, 4, 12))


def test_checksum_covers_each_items_rows_in_their_own_dtype() -> None:
    embeddings = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8).to(torch.bfloat16)
    lines = describe_items(handoff_of(embeddings, {}))
    expected = hashlib.sha256(embeddings[4:12].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    assert lines[1] == f"video 1: 8 rows x 8 (grid 2x4x4), sha256 {expected}"
    assert embedding_sha256(embeddings[:4]) != embedding_sha256(embeddings[:4].float())


def test_counts_text_in_string_and_part_contents() -> None:
    document = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "one two three"}, {"type": "mmgate_item", "index": 0}],
            },
        ]
    }
    response = reference_response(handoff_of(torch.zeros(12, 8), document), ["image 0: ...", "video 1: ..."])
    assert isinstance(response, BufferedResponse)

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.chunks()])

    data = orjson.loads(asyncio.run(read()))
    assert data["usage"]["prompt_tokens"] == 2 + 3 + 12
    assert data["model"] == "mmgate-reference"
