"""What a hand-off backend receives (a ready request's embeddings and its chat document) and what it answers.

A backend's `start` returns once the LLM server's first response byte arrived (its status and headers); the
engine releases the request's embedding buffer right then, so a backend must not keep the tensor past `start`.
The body is then streamed chunk by chunk to whoever claims the response.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine_adapter.config import BackendKind, EmbedsFormat, HandoffSettings
from engine_adapter.intake import ItemInfo
from serving.settings_loader import ConfigError

# The processor geometries whose trtllm-serve input processor the `trtllm` form is checked against.
TRTLLM_GEOMETRIES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True, slots=True, eq=False)
class Handoff:
    job_id: str
    """The engine's id for the admitted request."""
    request_id: str
    """The submitter's request id (`X-Request-ID`)."""
    document: dict[str, Any]
    """The chat completion request, each media part an `mmgate_item` part."""
    items: tuple[ItemInfo, ...]
    embeddings: torch.Tensor
    """The request's contiguous buffer `[rows, width]`, by reference: read only."""
    offsets: tuple[int, ...]
    """Item `i` owns rows `offsets[i]:offsets[i + 1]`."""
    images: tuple[str, ...] | None = None
    """When set, the backend sends these (one PNG data URL per item) instead of the embeddings."""

    def rows(self, index: int) -> torch.Tensor:
        return self.embeddings[self.offsets[index] : self.offsets[index + 1]]


class BackendResponse(ABC):
    """The LLM server's answer: status and headers now, the body as it arrives."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers

    @abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk, exactly as the backend sent it."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop reading and let go of the connection (idempotent)."""


class BufferedResponse(BackendResponse):
    """An answer that is complete when it is created (the reference responder's)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: Iterable[bytes]) -> None:
        super().__init__(status, headers)
        self._body = list(body)

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._body:
            yield chunk

    async def aclose(self) -> None:
        self._body = []


class HandoffBackend(Protocol):
    name: str

    def sends_pixels(self, items: Sequence[ItemInfo], merge_size: int) -> bool:
        """True when this request's items must reach the LLM server as pixels (its PNG images), not embeddings."""
        ...

    async def start(self, handoff: Handoff) -> BackendResponse:
        """Send the request with its embeddings; return at the first response byte. Raises EngineError."""
        ...

    async def aclose(self) -> None: ...


def check_handoff(settings: HandoffSettings, width: int, dtype: torch.dtype, geometry: str, preset: str) -> None:
    """Refuse at start-up what every hand-off would get wrong: ConfigError naming the key."""
    sent = dtype_name(dtype)
    if settings.expected_hidden_size is not None and settings.expected_hidden_size != width:
        raise ConfigError(
            f"handoff.expected_hidden_size = {settings.expected_hidden_size}: the LLM server takes embedding rows of "
            f"that width, but model.preset = {preset!r} produces rows of {width} (pick the tower of the LLM's model, "
            "e.g. qwen2.5-vl-7b for Qwen2.5-VL-7B with hidden size 3584)"
        )
    if settings.expected_dtype is not None and settings.expected_dtype != sent:
        raise ConfigError(
            f"handoff.expected_dtype = {settings.expected_dtype!r}: the engine encodes in {sent} (model.dtype), so "
            f"it would send {sent} embeddings; set model.dtype to {settings.expected_dtype}"
        )
    trtllm = settings.backend is BackendKind.OPENAI and settings.format is EmbedsFormat.TRTLLM
    if trtllm and geometry not in TRTLLM_GEOMETRIES:
        raise ConfigError(
            f"handoff.format = 'trtllm' with processor geometry {geometry!r}: trtllm-serve receives no grid with "
            "image embeddings and mmgate knows how it places rows only for Qwen2-VL / Qwen2.5-VL "
            f"({', '.join(TRTLLM_GEOMETRIES)}); use handoff.format: vllm (vLLM with --enable-mm-embeds), or a "
            "Qwen2-VL / Qwen2.5-VL model"
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
