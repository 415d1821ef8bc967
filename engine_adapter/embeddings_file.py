"""A request's embedding buffer as the safetensors file `GET /internal/v1/requests/{id}/embeddings` answers."""

from __future__ import annotations

import orjson
import safetensors.torch
import torch

from engine_adapter.client.wire import read_metadata

OFFSETS_KEY = "mmgate.offsets"


def embeddings_file(tensor: torch.Tensor, offsets: tuple[int, ...]) -> bytes:
    """One tensor `embeddings` `[rows, width]` in the engine's dtype; `__metadata__["mmgate.offsets"]` is the JSON
    list of each item's first row plus the end. Copies device memory to the host: call it off the event loop."""
    host = tensor.detach().to("cpu").contiguous()
    metadata = {OFFSETS_KEY: orjson.dumps(list(offsets)).decode()}
    return bytes(safetensors.torch.save({"embeddings": host}, metadata=metadata))


def read_embeddings_file(data: bytes) -> tuple[torch.Tensor, list[int]]:
    """The inverse, for consumers and tests."""
    tensor = safetensors.torch.load(data)["embeddings"]
    offsets = orjson.loads(read_metadata(data)[OFFSETS_KEY])
    return tensor, [int(offset) for offset in offsets]
