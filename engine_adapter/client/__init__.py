"""The engine contract, without torch: the submit format (`wire`) and the client the gateway calls the engine with
(`engine_client`). The gateway imports nothing else of `engine_adapter`; the geometry both processes resize and
count by is `processor_geometry`, and the HTTP plumbing both run on is the `serving` package.
"""

from __future__ import annotations

from engine_adapter.client.engine_client import EngineClient, EngineRefusal
from engine_adapter.client.wire import (
    EMBEDDINGS_CONTENT_TYPE,
    ITEM_PART_TYPE,
    SUBMIT_CONTENT_TYPE,
    SubmitRequest,
    WireFormatError,
    WireItem,
    content_hash,
    decode_submit,
    encode_submit,
    item_part,
    read_metadata,
)

__all__ = [
    "EMBEDDINGS_CONTENT_TYPE",
    "ITEM_PART_TYPE",
    "SUBMIT_CONTENT_TYPE",
    "EngineClient",
    "EngineRefusal",
    "SubmitRequest",
    "WireFormatError",
    "WireItem",
    "content_hash",
    "decode_submit",
    "encode_submit",
    "item_part",
    "read_metadata",
]
