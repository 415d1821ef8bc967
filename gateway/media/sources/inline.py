"""Inline media: RFC 2397 data URLs (base64 only) and bare base64, decoded strictly with pybase64.

An image is decoded whole (`decode_item`). A video or audio is read without a decoded copy of it: `Base64Input`
is a seekable file object over its base64 text (a view of the request body, or the `str` the parsed document
holds) that decodes only the ranges the container reads. The probe that sizes a request before its budget is
granted reads a video's or audio's header through it, and the load reads the container through it too: what is
decoded at a time is the range FFmpeg asks for (32 KiB), so the gateway holds the request body and never a
decoded copy of the item next to it. Before the load reads any of it, `checked_size` checks every character of
the item (a range the container never reads would otherwise pass unchecked), decoding `CHECK_CHARS` at a time and
dropping each piece.
Base64 maps each 4 characters to 3 bytes, so byte `i` lies in characters `i // 3 * 4` to `i // 3 * 4 + 4`.
"""

from __future__ import annotations

import binascii
import functools

import pybase64

from gateway.errors import BadRequest
from gateway.media.container import MemoryInput
from gateway.media.parts import MediaRef, Source
from gateway.media.threads import DecodeControl, Worker

__all__ = [
    "CHECK_CHARS",
    "Base64Input",
    "checked_size",
    "data_url_start",
    "decode_base64",
    "decode_item",
    "inline_input",
    "payload_chars",
    "payload_head",
    "split_data_url",
]

# The part of a data URL before the comma is short; anything longer is not a media type and parameters.
_MAX_HEADER_BYTES = 256
# Characters `Base64Input.check` decodes at a time (a multiple of 4): 768 KiB decoded, dropped before the next.
CHECK_CHARS = 1 << 20


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


def inline_payload(ref: MediaRef) -> str | memoryview:
    """The base64 text of an inline item (a data URL's payload, or the bare base64)."""
    if ref.source is Source.DATA_URL:
        return split_data_url(ref.value, ref.locator)[1]
    if ref.source is Source.BASE64:
        return ref.value
    raise ValueError(f"{ref.locator}: a {ref.source.value} item has no inline bytes")


def payload_head(ref: MediaRef, chars: int) -> str | memoryview:
    """The first `chars` characters of an inline item's base64, the rest neither copied nor read
    (`inline_payload` copies a `str` item's whole text)."""
    start = _payload_start(ref)
    return ref.value[start : start + chars]


def payload_chars(ref: MediaRef) -> int:
    """The number of base64 characters of an inline item, none of them copied or read."""
    return len(ref.value) - _payload_start(ref)


def _payload_start(ref: MediaRef) -> int:
    """Where an inline item's base64 starts in its value."""
    if ref.source is Source.DATA_URL:
        return data_url_start(ref.value, ref.locator)[1]
    if ref.source is Source.BASE64:
        return 0
    raise ValueError(f"{ref.locator}: a {ref.source.value} item has no inline bytes")


def decode_item(ref: MediaRef) -> bytes:
    """The whole encoded bytes of an inline item."""
    return decode_base64(inline_payload(ref), ref.locator)


class Base64Input(MemoryInput):
    """A read-only, seekable file object over the bytes that `text[start:]` (base64 without whitespace, as the
    data URL decoder accepts) encodes; each `read` decodes the characters of its range only and checks `control`
    first. `text` is a view of the request body, or a `str` the parsed document holds; neither is copied.
    Invalid characters in a range read are a 400, as `decode_base64` answers them; `check` checks them all."""

    def __init__(
        self, text: str | memoryview, locator: str, control: DecodeControl | None = None, *, start: int = 0
    ) -> None:
        super().__init__(b"", control)
        self._text = text.cast("B") if isinstance(text, memoryview) and text.format != "B" else text
        self._start = start
        self._locator = locator
        chars = len(self._text) - start
        if chars % 4:
            decode_base64(self._range(chars - chars % 4, chars), locator)  # raises naming the bad length
        tail = self._range(max(0, chars - 2), chars)
        tail_bytes = tail.encode("latin-1", "replace") if isinstance(tail, str) else bytes(tail)
        self._chars = chars
        self._size = chars // 4 * 3 - (len(tail_bytes) - len(tail_bytes.rstrip(b"=")))

    def _range(self, first: int, last: int) -> str | memoryview:
        """Characters `first` to `last` of the base64 (a slice of the text: a view, or a copy of a `str`'s)."""
        return self._text[self._start + first : self._start + last]

    def check(self) -> None:
        """Raise the 400 `decode_base64` raises for the whole base64, if it does, without holding more than
        `CHECK_CHARS` of it decoded. Each piece is decoded with the next 4 characters: padding is only valid at the
        very end, and a piece that ends in `=` is then refused as the whole text is."""
        for first in range(0, self._chars, CHECK_CHARS):
            if self._control is not None:
                self._control.check()
            decode_base64(self._range(first, min(self._chars, first + CHECK_CHARS + 4)), self._locator)

    def read(self, size: int = -1, /) -> bytes:
        if self._control is not None:
            self._control.check()
        self.reads += 1
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        if end <= start:
            return b""
        first, last = start // 3, -(-end // 3)
        decoded = decode_base64(self._range(first * 4, last * 4), self._locator)
        chunk = decoded[start - first * 3 : end - first * 3]  # the same object when the range is whole groups
        self._position = end
        self.bytes_read += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = 0, /) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def __len__(self) -> int:
        return self._size


def inline_input(ref: MediaRef, control: DecodeControl | None = None) -> Base64Input:
    """The encoded bytes of an inline item (a data URL or bare base64) as a `Base64Input`; nothing is decoded or
    copied."""
    return Base64Input(ref.value, ref.locator, control, start=_payload_start(ref))


def checked_size(ref: MediaRef, control: DecodeControl | None = None) -> int:
    """Check every character of an inline item's base64 (`Base64Input.check`, a 400 naming the item; `control` is
    checked before each piece); the number of bytes it encodes. Runs on a media thread."""
    source = inline_input(ref, control)
    source.check()
    return len(source)


async def checked_inline_size(ref: MediaRef, worker: Worker) -> int:
    """`checked_size` on a media thread; a client that leaves stops the check at its next piece."""
    control = DecodeControl(None)
    return await worker.run(ref.locator, functools.partial(checked_size, ref, control), control=control)
