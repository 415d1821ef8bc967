"""Engine mode pieces that need no engine: the request the engine gets, the pixels it gets, error mapping.
Gateway → engine → LLM through real servers is in tests/engine_adapter/test_gateway_engine_mode.py."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import orjson
import pytest
from PIL import Image

from engine_adapter.client.engine_client import EngineError
from engine_adapter.client.geometry import QWEN2_VL, smart_resize
from gateway.body_parse import parse_request_body
from gateway.engine_mode import engine_document, engine_error, pixel_preparer
from gateway.errors import BadGateway, BadRequest, RateLimited, RequestTooLarge, ServiceUnavailable
from gateway.media_parts import find_media


def test_media_parts_become_item_references_and_long_text_is_restored() -> None:
    image = "data:image/png;base64," + base64.b64encode(os.urandom(800_000)).decode()
    long_text = "A" * 300_000
    document = {
        "model": "m",
        "stream": True,
        "messages": [
            {"role": "system", "content": long_text},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            },
        ],
    }
    parsed = parse_request_body(orjson.dumps(document))
    refs = find_media("/v1/chat/completions", parsed)
    sent = engine_document(parsed, refs)
    assert sent["messages"][0]["content"] == long_text
    assert sent["messages"][1]["content"] == [
        {"type": "text", "text": "first"},
        {"type": "mmgate_item", "index": 0},
        {"type": "mmgate_item", "index": 1},
    ]
    assert sent["stream"] is True
    assert len(orjson.dumps(sent)) < 310_000  # no pixels or base64 travel in the JSON


def test_pixel_preparer_resizes_for_the_model_and_hashes_the_pixels() -> None:
    prepare = pixel_preparer(QWEN2_VL)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8))
    pixels, digest = prepare(image)
    assert pixels.dtype == np.uint8
    assert pixels.shape == (*smart_resize(300, 500, 28, QWEN2_VL.min_pixels, QWEN2_VL.max_pixels), 3)
    assert prepare(image)[1] == digest
    other = image.copy()
    other.putpixel((0, 0), (1, 2, 3))
    assert prepare(other)[1] != digest
    out = io.BytesIO()
    image.save(out, format="PNG")


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (413, RequestTooLarge),
        (400, BadRequest),
        (429, RateLimited),
        (503, ServiceUnavailable),
        (401, BadGateway),
        (500, BadGateway),
    ],
)
def test_engine_errors_map_to_the_gateway_tree(status: int, kind: type) -> None:
    error = engine_error(EngineError(status, "request needs 9 bytes, over encoder.max_resident_bytes=8", "r"))
    assert isinstance(error, kind)
    assert "encoder.max_resident_bytes=8" in error.message
