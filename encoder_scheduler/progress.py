"""Per-request encoding progress."""

from __future__ import annotations

import enum


class RequestProgress(enum.StrEnum):
    """Where a live request stands.

    PENDING: admitted, waiting to start; holds no bytes.
    PARTIAL: started; its whole buffer is allocated and charged; some items are not recorded yet.
    READY: every item recorded; `EncoderScheduler.take` may hand the buffer out.
    TAKEN: handed out; still charged until `EncoderScheduler.release`.
    """

    PENDING = "pending"
    PARTIAL = "partial"
    READY = "ready"
    TAKEN = "taken"
