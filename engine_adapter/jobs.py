"""One admitted request on the engine, from its 202 until its response is relayed (or it is cancelled)."""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from typing import Any

import torch

from engine_adapter.errors import EngineError
from engine_adapter.handoff import BackendResponse
from engine_adapter.intake import ItemInfo


class JobState(enum.StrEnum):
    ENCODING = "encoding"
    """Queued or partly encoded; the scheduler holds it."""
    HANDING_OFF = "handing_off"
    """Encoded; the backend has the request and the buffer lives until its first response byte."""
    ANSWERED = "answered"
    """The backend answered (or the request failed); waiting for the response to be claimed."""
    RELAYING = "relaying"
    """A caller is streaming the answer."""


class Job:
    __slots__ = (
        "claim_timer",
        "claimed",
        "document",
        "embeddings",
        "finished",
        "handoff_task",
        "id",
        "items",
        "offsets",
        "outcome",
        "request_id",
        "settled",
        "state",
    )

    def __init__(self, job_id: str, request_id: str, document: dict[str, Any], items: tuple[ItemInfo, ...]) -> None:
        self.id = job_id
        self.request_id = request_id
        self.document = document
        self.items = items
        self.state = JobState.ENCODING
        self.embeddings: torch.Tensor | None = None
        """The buffer, from the moment it is ready until it is released (hand-off's first byte, or cancel)."""
        self.offsets: tuple[int, ...] = ()
        self.settled = asyncio.Event()
        """Set when the buffer is ready, or when it never will be (failed, cancelled)."""
        self.outcome: asyncio.Future[BackendResponse | EngineError] = asyncio.get_running_loop().create_future()
        self.claimed = False
        self.claim_timer: asyncio.TimerHandle | None = None
        self.handoff_task: asyncio.Task[None] | None = None
        self.finished = False


class Tombstones:
    """Why recently finished requests are gone (410 rather than 404), bounded."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._reasons: OrderedDict[str, str] = OrderedDict()

    def add(self, job_id: str, reason: str) -> None:
        self._reasons[job_id] = reason
        while len(self._reasons) > self._capacity:
            self._reasons.popitem(last=False)

    def get(self, job_id: str) -> str | None:
        return self._reasons.get(job_id)
