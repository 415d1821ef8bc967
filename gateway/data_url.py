"""RFC 2397 data URLs (base64 only) and bare base64, decoded strictly with pybase64."""

from __future__ import annotations

import binascii

import pybase64

from gateway.errors import BadRequest

# The part of a data URL before the comma is short; anything longer is not a media type and parameters.
_MAX_HEADER_BYTES = 256


def split_data_url(value: str | memoryview, locator: str) -> tuple[str, memoryview]:
    """`data:<media type>[;params];base64,<payload>` → (media type, payload view). Only base64 is accepted."""
    media_type, start = data_url_start(value, locator)
    view = memoryview(value.encode("latin-1", "replace")) if isinstance(value, str) else value
    return media_type, view[start:]


def data_url_start(value: str | memoryview, locator: str) -> tuple[str, int]:
    """`data:<media type>[;params];base64,<payload>` → (media type, index of the payload's first character), read
    from the value's first characters only. Only base64 is accepted."""
    head = value[:_MAX_HEADER_BYTES]
    prefix = head.encode("latin-1", "replace") if isinstance(head, str) else bytes(head)
    comma = prefix.find(b",")
    if prefix[:5] != b"data:" or comma < 0:
        raise BadRequest(f"{locator}: not a data URL (expected data:<media type>;base64,<data>)", reason="bad_media")
    header = prefix[5:comma].decode("ascii", "replace")
    parameters = header.split(";")
    if parameters[-1].strip().lower() != "base64":
        raise BadRequest(f"{locator}: only base64 data URLs are accepted, got data:{header}", reason="bad_media")
    return parameters[0].strip().lower(), comma + 1


def decode_base64(payload: str | memoryview | bytes, locator: str) -> bytes:
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{locator}: invalid base64 data ({exc})", reason="bad_media") from None
