"""The engine's submit format, shared by the gateway (writer, no torch) and the engine (reader).

`POST /internal/v1/requests` takes one safetensors file (`Content-Type: application/vnd.mmgate.request+safetensors`):

- tensors `item.0`, `item.1`, ...: each media item's pixels, uint8 `[height, width, 3]` for an image and
  `[frames, height, width, 3]` for a video (its sampled frames, all at one size, not padded to whole temporal
  patches: the engine pads), already decoded, converted to RGB and smart-resized for the engine's model
  (`processor_geometry`);
- `__metadata__` (strings):
  - `mmgate.version`: `"1"`;
  - `mmgate.request_id`: the gateway's request id;
  - `mmgate.request`: the chat completion request as JSON, every media part replaced by
    `{"type": "mmgate_item", "index": i}` (the pixels are in `item.<i>`, not in the JSON);
  - `mmgate.items`: JSON list, in item order, of `{"modality": "image" | "video", "locator": "...",
    "content_hash": "..."}`
    (`content_hash`: sha256 of the pixels, the encoder cache key).

The reply to a submit is `202 {"id": ...}`; errors are `{"error": {"message": ..., "code": <status>, "reason": ...}}`.
`GET /internal/v1/requests/{id}/embeddings` answers a safetensors file with one tensor `embeddings`
`[rows, width]` and `__metadata__["mmgate.offsets"]`, the JSON list of each item's first row (plus the end).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import safetensors.numpy

SUBMIT_CONTENT_TYPE = "application/vnd.mmgate.request+safetensors"
EMBEDDINGS_CONTENT_TYPE = "application/vnd.mmgate.embeddings+safetensors"
ITEM_PART_TYPE = "mmgate_item"
WIRE_VERSION = "1"


class WireFormatError(ValueError):
    """A submit body that is not a valid mmgate request file."""


@dataclass(frozen=True, slots=True)
class WireItem:
    modality: str
    locator: str
    content_hash: str
    pixels: npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    document: dict[str, Any]
    items: list[WireItem]


def content_hash(pixels: npt.NDArray[np.uint8]) -> str:
    """An item's `content_hash`: sha256 of its shape (as Python prints the tuple) and its C-contiguous pixels."""
    digest = hashlib.sha256(f"{pixels.shape}".encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.hexdigest()


def item_part(index: int) -> dict[str, Any]:
    return {"type": ITEM_PART_TYPE, "index": index}


def encode_submit(request_id: str, document: dict[str, Any], items: list[WireItem]) -> bytes:
    tensors = {f"item.{i}": np.ascontiguousarray(item.pixels) for i, item in enumerate(items)}
    described = [{"modality": i.modality, "locator": i.locator, "content_hash": i.content_hash} for i in items]
    metadata = {
        "mmgate.version": WIRE_VERSION,
        "mmgate.request_id": request_id,
        "mmgate.request": orjson.dumps(document).decode(),
        "mmgate.items": orjson.dumps(described).decode(),
    }
    return bytes(safetensors.numpy.save(tensors, metadata=metadata))


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (the library's loaders return tensors only)."""
    if len(data) < 8:
        raise WireFormatError("body is too short for a safetensors file")
    (header_length,) = struct.unpack_from("<Q", data, 0)
    if header_length > len(data) - 8 or header_length > 100 << 20:
        raise WireFormatError("safetensors header length runs past the body")
    try:
        header = orjson.loads(bytes(data[8 : 8 + header_length]))
    except orjson.JSONDecodeError as exc:
        raise WireFormatError(f"safetensors header is not JSON: {exc}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(metadata) if isinstance(metadata, dict) else {}


def decode_submit(data: bytes) -> SubmitRequest:
    metadata = read_metadata(data)
    if metadata.get("mmgate.version") != WIRE_VERSION:
        raise WireFormatError(f"mmgate.version must be {WIRE_VERSION!r}, got {metadata.get('mmgate.version')!r}")
    try:
        document = orjson.loads(metadata["mmgate.request"])
        described = orjson.loads(metadata["mmgate.items"])
        request_id = metadata["mmgate.request_id"]
        tensors = safetensors.numpy.load(data)
        items = [
            WireItem(
                modality=str(entry["modality"]),
                locator=str(entry["locator"]),
                content_hash=str(entry["content_hash"]),
                pixels=tensors[f"item.{i}"],
            )
            for i, entry in enumerate(described)
        ]
    except (KeyError, TypeError, orjson.JSONDecodeError, safetensors.SafetensorError) as exc:
        raise WireFormatError(f"malformed mmgate request file: {exc!r}") from None
    if not isinstance(document, dict):
        raise WireFormatError("mmgate.request must be a JSON object")
    for i, item in enumerate(items):
        if item.pixels.dtype != np.uint8 or item.pixels.ndim not in (3, 4) or item.pixels.shape[-1] != 3:
            raise WireFormatError(
                f"item.{i} must be uint8 [h, w, 3] or [t, h, w, 3], got {item.pixels.dtype} {list(item.pixels.shape)}"
            )
    return SubmitRequest(request_id=request_id, document=document, items=items)
