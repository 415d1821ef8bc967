"""The `openai` hand-off backend: POST the chat request to an OpenAI-compatible server with every media item
replaced by an `image_embeds` part carrying that item's embedding rows.

Part shapes (each tensor is `torch.save`d, then base64-encoded):

- `handoff.format: vllm` (vLLM >= 0.13.0, the first release that takes several `image_embeds` parts in one
  request; the stub in tests/engine_adapter/stub_llm.py mirrors the parser of 0.33.0) —
  `{"type": "image_embeds", "image_embeds": {"image_embeds": <rows [n, hidden]>, "image_grid_thw": <int64 [3]>}}`.
  vLLM loads each part's tensors on their own and stacks them per key across the request's parts, so a per-part
  grid of shape `[3]` becomes the `[items, 3]` grid its Qwen2-VL field config expects (a `[1, 3]` grid would stack
  to `[items, 1, 3]`, which it refuses with a 400). Serve with `--enable-mm-embeds`; with
  `--limit-mm-per-prompt '{"image": 0, "video": 0}'` vLLM skips its own vision encoder (embedding-only mode;
  `'{"image": 0}'` alone still profiles it for video).
- `handoff.format: trtllm` — `{"type": "image_embeds", "image_embeds": {"data": <rows [n, hidden]>}}`, what
  trtllm-serve's `ChatCompletionContentPartImageEmbedsParam` loads with `torch.load`. It carries no grid: for
  Qwen2-VL / Qwen2.5-VL trtllm-serve places the rows with the grid it infers from their count
  (`trtllm_inferred_grid`). A request in which any item's true grid differs from that guess is sent as pixels
  instead: every item an `image_url` part holding a lossless PNG data URL of the resized image the engine got, so
  the server encodes them itself (trtllm-serve refuses a request that mixes embeddings and media). Embeddings that
  would be placed with the wrong grid are never sent.

A request with a video never reaches this backend: the engine refuses it at submit, before encoding, since
neither server takes video embeddings in the chat API these forms target (trtllm-serve's `tensorrt_llm/serve/
chat_utils.py` parses `image_embeds` only; vLLM's chat parser gained a `video_embeds` part only after the releases
the `vllm` form is built for).

Each item's rows are copied into a tensor of their own before saving: `torch.save` of a view would write the
whole request buffer's storage.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson
import torch
from PIL import Image

from engine_adapter.chat import replace_item_parts
from engine_adapter.client.wire import decode_submit
from engine_adapter.config import EmbedsFormat, HandoffSettings
from engine_adapter.errors import BadGateway, EngineError, GatewayTimeout
from engine_adapter.handoff import BackendResponse, Handoff
from engine_adapter.intake import ItemInfo
from serving.headers import end_to_end

CHAT_PATH = "/v1/chat/completions"


def tensor_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def trtllm_inferred_grid(rows: int, merge_size: int = 2) -> tuple[int, int, int]:
    """The `(t, h, w)` patch grid trtllm-serve's Qwen2-VL input processor gives an image sent as `rows` embedding
    rows: merged height the largest divisor of `rows` not above its square root, merged width the rest, `t` 1."""
    if rows < 1:
        raise ValueError(f"an image has at least one embedding row, got {rows}")
    merged_h = next(d for d in range(math.isqrt(rows), 0, -1) if rows % d == 0)
    return 1, merged_h * merge_size, rows // merged_h * merge_size


def trtllm_misplaced(items: Sequence[ItemInfo], merge_size: int = 2) -> list[int]:
    """Indices of the items whose true grid differs from the one trtllm-serve would infer from their rows."""
    return [
        index
        for index, item in enumerate(items)
        if item.modality != "image" or trtllm_inferred_grid(item.rows, merge_size) != item.grid_thw
    ]


def png_data_url(pixels: npt.NDArray[np.uint8]) -> str:
    """A lossless PNG data URL of uint8 `[h, w, 3]` pixels."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getbuffer()).decode("ascii")


def pixel_parts(body: bytes) -> tuple[str, ...]:
    """The PNG data URL of every item of a submit file, in item order (runs on a worker thread)."""
    return tuple(png_data_url(item.pixels) for item in decode_submit(body).items)


def embeds_part(handoff: Handoff, index: int, fmt: EmbedsFormat) -> dict[str, Any]:
    if handoff.images is not None:
        return {"type": "image_url", "image_url": {"url": handoff.images[index]}}
    rows = handoff.rows(index).detach().to("cpu", copy=True)
    if fmt is EmbedsFormat.TRTLLM:
        return {"type": "image_embeds", "image_embeds": {"data": tensor_b64(rows)}}
    grid = torch.tensor(handoff.items[index].grid_thw, dtype=torch.int64)
    embeds = {"image_embeds": tensor_b64(rows), "image_grid_thw": tensor_b64(grid)}
    return {"type": "image_embeds", "image_embeds": embeds}


def build_payload(handoff: Handoff, fmt: EmbedsFormat, model: str | None) -> bytes:
    """The JSON body for the LLM server (runs on a worker thread: it copies and encodes every item's rows)."""
    document = replace_item_parts(handoff.document, lambda index: embeds_part(handoff, index, fmt))
    if model is not None:
        document["model"] = model
    return orjson.dumps(document)


class StreamedResponse(BackendResponse):
    def __init__(self, response: aiohttp.ClientResponse, url: str, read_timeout_s: float) -> None:
        super().__init__(response.status, end_to_end(response.raw_headers))
        self._response = response
        self._url = url
        self._read_timeout_s = read_timeout_s

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise GatewayTimeout(
                f"hand-off backend {self._url} sent nothing for handoff.read_timeout_s={self._read_timeout_s:g} "
                "in the middle of its response"
            ) from exc
        except aiohttp.ClientError as exc:
            raise BadGateway(f"hand-off backend {self._url} broke off its response: {exc}") from exc

    async def aclose(self) -> None:
        self._response.close()


class OpenAIBackend:
    name = "openai"

    def __init__(self, settings: HandoffSettings) -> None:
        self.settings = settings
        self.url = settings.base_url + CHAT_PATH
        self.format = settings.format
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use, inside the server's event loop.
        if self._session is None:
            settings = self.settings
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=settings.max_concurrency * 2, limit_per_host=0),
                # No total timeout: a generation streams as long as it keeps sending.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
                ),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return self._session

    def sends_pixels(self, items: Sequence[ItemInfo], merge_size: int) -> bool:
        """True when this request's items must go as pixels: trtllm form and an item trtllm-serve would misplace."""
        return self.format is EmbedsFormat.TRTLLM and bool(trtllm_misplaced(items, merge_size))

    async def start(self, handoff: Handoff) -> BackendResponse:
        payload = await asyncio.to_thread(build_payload, handoff, self.format, self.settings.model)
        headers = {"Content-Type": "application/json", "X-Request-ID": handoff.request_id}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        try:
            response = await self.session.post(self.url, data=payload, headers=headers, allow_redirects=False)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise self._timeout(exc) from exc
        except aiohttp.ClientConnectorError as exc:
            raise BadGateway(f"hand-off backend {self.url} unreachable: {exc.os_error or exc}") from exc
        except aiohttp.ClientError as exc:
            raise BadGateway(f"hand-off backend {self.url} failed: {exc or type(exc).__name__}") from exc
        if response.status in (401, 403):
            # The LLM server refused the engine's credentials: the engine's fault, not the client's, so never
            # relayed as the client's own 401.
            response.close()
            state = "the configured one" if self.settings.api_key else "none was configured"
            raise BadGateway(
                f"hand-off backend {self.url} refused the engine's credentials with {response.status} "
                f"(handoff.api_key: {state})",
                reason="handoff_credentials",
            )
        return StreamedResponse(response, self.url, self.settings.read_timeout_s)

    def _timeout(self, exc: BaseException) -> EngineError:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            knob, value = "handoff.connect_timeout_s", self.settings.connect_timeout_s
        else:
            knob, value = "handoff.read_timeout_s", self.settings.read_timeout_s
        return GatewayTimeout(f"hand-off backend {self.url} timed out after {knob}={value:g}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
