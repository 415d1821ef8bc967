"""What a hand-off backend receives (a ready request's embeddings and its chat document) and what it answers.

A backend's `start` returns once the LLM server's first response byte arrived (its status and headers); the
engine releases the request's embedding buffer right then, so a backend must not keep the tensor past `start`.
The body is then streamed chunk by chunk to whoever claims the response.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine_adapter.intake import ItemInfo


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

    async def start(self, handoff: Handoff) -> BackendResponse:
        """Send the request with its embeddings; return at the first response byte. Raises EngineError."""
        ...

    async def aclose(self) -> None: ...
