"""The built-in reference responder: a deterministic stand-in for the LLM that reports what it received.

It answers in the OpenAI chat completion shape (SSE chunks ending in `data: [DONE]` when the request says
`"stream": true`), and its message names, for every item, the modality, rows, width (with a Qwen3-VL tower, the
visual width and the DeepStack layers it holds; a video's patch grid too) and sha256 of the embeddings it got,
so a caller can check the encoder's output end to end. Token counts are whitespace-separated words:
`usage.prompt_tokens` = words of the messages' text + embedding rows; `usage.completion_tokens` = words of
the reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import orjson
import torch

from engine_adapter.chat import text_tokens
from engine_adapter.handoff import BackendResponse, BufferedResponse, Handoff
from engine_adapter.intake import ItemInfo

DEFAULT_MODEL = "mmgate-reference"


def embedding_sha256(rows: torch.Tensor) -> str:
    """sha256 of the rows' bytes in row-major order, in their own dtype (little-endian, as torch stores them)."""
    data = rows.detach().to("cpu").contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def describe_items(handoff: Handoff, deepstack_layers: int = 0) -> list[str]:
    """One line per item: modality, rows, width and checksum; a video's line also names its `t x h x w` patch
    grid (its frames padded to whole temporal patches), which its row count alone does not fix.

    With `deepstack_layers` (a Qwen3-VL tower), each row is the visual features then that many DeepStack layers'
    of the same width, and the line says so: `rows x 384 (128 + 2 DeepStack layers x 128)`."""
    width = int(handoff.embeddings.shape[1])
    if deepstack_layers and width % (1 + deepstack_layers):
        raise ValueError(f"rows of {width} do not split into 1 + {deepstack_layers} DeepStack parts")
    part = width // (1 + deepstack_layers)
    layout = f" ({part} + {deepstack_layers} DeepStack layers x {part})" if deepstack_layers else ""
    lines = []
    for index, item in enumerate(handoff.items):
        grid = " (grid {}x{}x{})".format(*item.grid_thw) if item.modality == "video" else ""
        digest = embedding_sha256(handoff.rows(index))
        lines.append(f"{item.modality} {index}: {item.rows} rows x {width}{layout}{grid}, sha256 {digest}")
    return lines


class ReferenceBackend:
    name = "reference"

    def __init__(self, deepstack_layers: int = 0) -> None:
        self.deepstack_layers = deepstack_layers

    def sends_pixels(self, items: Sequence[ItemInfo], merge_size: int) -> bool:
        return False

    async def start(self, handoff: Handoff) -> BackendResponse:
        # Hashing copies the rows to the host: not on the event loop.
        lines = await asyncio.to_thread(describe_items, handoff, self.deepstack_layers)
        return reference_response(handoff, lines)

    async def aclose(self) -> None:
        return None


def reference_response(handoff: Handoff, lines: list[str]) -> BackendResponse:
    document = handoff.document
    text = text_tokens(document)
    rows = handoff.offsets[-1]
    lines = [
        *lines,
        f"reference reply: {len(handoff.items)} item(s), {rows} embedding row(s), {text} text token(s).",
    ]
    content = "\n".join(lines)
    usage = {
        "prompt_tokens": text + rows,
        "completion_tokens": len(content.split()),
        "total_tokens": text + rows + len(content.split()),
    }
    model = document.get("model") if isinstance(document.get("model"), str) else DEFAULT_MODEL
    common = {"id": f"chatcmpl-{handoff.job_id}", "created": int(time.time()), "model": model}
    if document.get("stream") is not True:
        body = orjson.dumps(
            {
                **common,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        return BufferedResponse(200, headers, [body])
    chunk = {**common, "object": "chat.completion.chunk"}
    events: list[dict[str, Any]] = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    ]
    for index, line in enumerate(lines):
        piece = line if index == len(lines) - 1 else line + "\n"
        events.append({**chunk, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    options = document.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        events.append({**chunk, "choices": [], "usage": usage})
    body_chunks = [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]
    body_chunks.append(b"data: [DONE]\n\n")
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    return BufferedResponse(200, headers, body_chunks)


def text_only_response(document: dict[str, Any], request_id: str) -> BackendResponse:
    """The reference responder as a plain OpenAI chat endpoint, for requests without media (the embedded
    stack's upstream, so `make run` answers text-only requests too)."""
    handoff = Handoff(
        job_id=request_id,
        request_id=request_id,
        document=document,
        items=(),
        embeddings=torch.empty((0, 0)),
        offsets=(0,),
    )
    return reference_response(handoff, [])


def reference_models() -> dict[str, Any]:
    """`GET /v1/models` in the OpenAI shape: the reference responder's one model."""
    return {"object": "list", "data": [{"id": DEFAULT_MODEL, "object": "model", "created": 0, "owned_by": "mmgate"}]}
