"""Shared builders and the fake encoder for the encoder_scheduler tests."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from encoder_scheduler import EncoderItem, EncoderRequest, EncoderScheduler

WIDTH = 4


def item(tokens: int, rows: int = 1, content_hash: str | None = None, modality: str = "image") -> EncoderItem:
    return EncoderItem(modality=modality, num_tokens=tokens, num_embeddings=rows, content_hash=content_hash)


def request(
    request_id: str,
    items: Sequence[EncoderItem],
    *,
    width: int = WIDTH,
    dtype: torch.dtype = torch.float32,
    processor_key: str = "",
) -> EncoderRequest:
    return EncoderRequest(
        request_id=request_id,
        embedding_width=width,
        dtype=dtype,
        items=list(items),
        processor_key=processor_key,
    )


def fake_output(req: EncoderRequest, index: int) -> torch.Tensor:
    """A deterministic stand-in for the vision encoder.

    Items with a content hash get an output determined by their cache key, as a real encoder's would be, so a
    cache hit must reproduce a miss bit for bit; other items get one determined by (request id, index).
    """
    it = req.items[index]
    if it.content_hash is not None:
        seed_text = f"{it.modality}|{it.content_hash}|{it.num_embeddings}|{req.processor_key}"
    else:
        seed_text = f"{req.request_id}|{index}"
    generator = torch.Generator().manual_seed(zlib.crc32(seed_text.encode()))
    values = torch.randn(it.num_embeddings, req.embedding_width, generator=generator, dtype=torch.float32)
    return values.to(req.dtype)


def encode_plan(sched: EncoderScheduler, plan: Sequence[tuple[str, int]]) -> list[str]:
    """Record the fake encoder's output for every item of `plan`; return the requests that became ready."""
    ready = []
    for request_id, index in plan:
        if sched.record(request_id, index, fake_output(sched.request(request_id), index)):
            ready.append(request_id)
    return ready


def expected_buffer(req: EncoderRequest) -> torch.Tensor:
    return torch.cat([fake_output(req, index) for index in range(req.num_items)])
