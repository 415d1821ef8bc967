"""A stub OpenAI-compatible LLM server for the engine's `openai` hand-off tests (raw ASGI, on loopback).

It decodes every `image_embeds` part the way vLLM and trtllm-serve do (base64 -> `torch.load`), records what it
got, and answers. With `hold` set it keeps its first response byte back until the test calls `release()` (or the
engine goes away), so a test can look at the engine's buffer while the backend has the request.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from tests.stub_asgi import lifespan, request_body


@dataclass
class Received:
    request_id: str
    headers: dict[str, str]
    document: dict[str, Any]
    formats: list[str]
    embeds: list[torch.Tensor]
    grids: list[torch.Tensor | None]


@dataclass
class StubState:
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    hold: bool = False
    gate: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)

    def by_request_id(self, request_id: str) -> Received:
        with self.lock:
            matches = [seen for seen in self.received if seen.request_id == request_id]
        assert len(matches) == 1, f"{len(matches)} requests with id {request_id} reached the stub"
        return matches[0]


def _load(data: str) -> torch.Tensor:
    tensor = torch.load(io.BytesIO(base64.b64decode(data)), map_location="cpu", weights_only=True)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def decode_parts(document: dict[str, Any]) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor | None]]:
    formats: list[str] = []
    embeds: list[torch.Tensor] = []
    grids: list[torch.Tensor | None] = []
    for message in document.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") != "image_embeds":
                continue
            payload = part["image_embeds"]
            if "data" in payload:  # trtllm-serve
                formats.append("trtllm")
                embeds.append(_load(payload["data"]))
                grids.append(None)
            else:  # vLLM
                formats.append("vllm")
                embeds.append(_load(payload["image_embeds"]))
                grids.append(_load(payload["image_grid_thw"]))
    return formats, embeds, grids


class StubLLM:
    """`POST /v1/chat/completions` (JSON, or SSE when the body says `"stream": true`); a request whose `model` is
    `status-<code>` is answered with that status. `GET /health`."""

    def __init__(self) -> None:
        self.state = StubState()

    def release(self) -> None:
        self.state.gate.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        body = await request_body(receive)
        if body is None:
            return
        if scope["path"] == "/health":
            await _send(send, 200, b"{}")
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        document = orjson.loads(body)
        formats, embeds, grids = decode_parts(document)
        state = self.state
        with state.lock:
            state.received.append(Received(headers.get("x-request-id", ""), headers, document, formats, embeds, grids))
        state.arrived.set()
        if state.hold and not await self._wait_gate_or_disconnect(receive):
            return
        model = str(document.get("model", ""))
        if model.startswith("status-"):
            await _send(send, int(model.removeprefix("status-")), b'{"detail":"the stub refuses"}')
            return
        reply = f"stub saw {len(embeds)} image embed(s)"
        if document.get("stream") is True:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for piece in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await _send(send, 200, orjson.dumps({"choices": [{"message": {"content": reply}}]}), [(b"x-stub", b"yes")])

    async def _wait_gate_or_disconnect(self, receive: Any) -> bool:
        """True when the test released the gate; False when the engine disconnected first."""

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                if watcher.done():
                    self.state.disconnected.set()
                    return False
                if self.state.gate.is_set():
                    return True
                await asyncio.sleep(0.01)
            return False
        finally:
            watcher.cancel()


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
