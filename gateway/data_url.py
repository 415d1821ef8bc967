"""RFC 2397 data URLs (base64 only) and bare base64, decoded strictly with pybase64."""

from __future__ import annotations

import binascii

import pybase64

from gateway.errors import BadRequest

# The part of a data URL before the comma is short; anything longer is not a media type and parameters.
_MAX_HEADER_BYTES = 256


def split_data_url(value: str | memoryview, locator: str) -> tuple[str, memoryview]:
    """`data:<media type>[;params];base64,<payload>` → (media type, payload view). Only base64 is accepted."""
    view = memoryview(value.encode("latin-1", "replace")) if isinstance(value, str) else value
    comma = bytes(view[:_MAX_HEADER_BYTES]).find(b",")
    if bytes(view[:5]) != b"data:" or comma < 0:
        raise BadRequest(f"{locator}: not a data URL (expected data:<media type>;base64,<data>)", reason="bad_media")
    header = bytes(view[5:comma]).decode("ascii", "replace")
    parameters = header.split(";")
    if parameters[-1].strip().lower() != "base64":
        raise BadRequest(f"{locator}: only base64 data URLs are accepted, got data:{header}", reason="bad_media")
    return parameters[0].strip().lower(), view[comma + 1 :]


def decode_base64(payload: str | memoryview | bytes, locator: str) -> bytes:
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{locator}: invalid base64 data ({exc})", reason="bad_media") from None
