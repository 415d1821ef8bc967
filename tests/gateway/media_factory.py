"""Building test images and request bodies that carry them."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import orjson
from PIL import Image


def image_bytes(width: int, height: int, fmt: str = "JPEG", mode: str = "RGB", seed: int = 0, **save: Any) -> bytes:
    """Random pixels, so that JPEGs are as large as real photographs get."""
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, size=(height, width, bands), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if bands == 1 else pixels, mode=mode if bands > 1 else "L")
    if mode not in ("RGB", "RGBA", "L"):
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_body(*urls: str, text: str = "Describe the images.", **extra: Any) -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


def messages_body(*images: bytes, media_type: str = "image/jpeg") -> bytes:
    content: list[dict[str, Any]] = [
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": base64.b64encode(i).decode()}}
        for i in images
    ]
    content.append({"type": "text", "text": "What is this?"})
    return orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


def responses_body(*urls: str) -> bytes:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": "Describe."}]
    content += [{"type": "input_image", "image_url": url} for url in urls]
    return orjson.dumps({"model": "m", "input": [{"role": "user", "content": content}]})


def jpeg_header_claiming(width: int, height: int) -> bytes:
    """A JPEG whose SOF marker claims `width` x `height`, followed by too little data to decode anything."""
    real = image_bytes(16, 16)
    sof = real.find(b"\xff\xc0")
    patched = bytearray(real)
    patched[sof + 5 : sof + 7] = height.to_bytes(2, "big")
    patched[sof + 7 : sof + 9] = width.to_bytes(2, "big")
    return bytes(patched)


def _scan_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan of a JPEG: its SOS segment and the entropy-coded data up to the next marker."""
    spans: list[tuple[int, int]] = []
    position = 2
    while True:
        marker = data[position + 1]
        if marker == 0xD9:
            return spans
        end = position + 2 + int.from_bytes(data[position + 2 : position + 4], "big")
        if marker == 0xDA:
            start = position
            while not (data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
            spans.append((start, end))
        position = end


def scan_bomb(side: int, copies: int) -> bytes:
    """A valid progressive JPEG whose smallest luma scan (about 16 bytes: a band of all-zero coefficients) is
    repeated `copies` times. libjpeg decodes each repeat as a pass over every luma block."""
    y, x = np.mgrid[0:side, 0:side]
    smooth = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(smooth).save(out, "JPEG", progressive=True, quality=90)
    data = out.getvalue()
    luma = [(start, end) for start, end in _scan_spans(data) if data[start + 4 : start + 6] == b"\x01\x01"]
    start, end = min(luma, key=lambda span: span[1] - span[0])
    return data[:end] + data[start:end] * copies + data[end:]
