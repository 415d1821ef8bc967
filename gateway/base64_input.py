"""Reading an inline item without a decoded copy of it: a seekable file object over its base64 text (a view of
the request body, or the `str` the parsed document holds) that decodes only the ranges the container reads.

The probe that sizes a request before its budget is granted reads a video's or audio's header through this, and
the load reads the container through it too: what is decoded at a time is the range FFmpeg asks for (32 KiB), so
the gateway holds the request body and never a decoded copy of the item next to it. Before the load reads any
of it, `checked_size` checks every character of the item (a range the container never reads would otherwise
pass unchecked), decoding `CHECK_CHARS` at a time and dropping each piece.
Base64 maps each 4 characters to 3 bytes, so byte `i` lies in characters `i // 3 * 4` to `i // 3 * 4 + 4`.
"""

from __future__ import annotations

from gateway.data_url import data_url_start, decode_base64
from gateway.image_loader import DecodeControl
from gateway.media_container import MemoryInput
from gateway.media_parts import MediaRef, Source

__all__ = ["CHECK_CHARS", "Base64Input", "checked_size", "inline_input"]

# Characters `Base64Input.check` decodes at a time (a multiple of 4): 768 KiB decoded, dropped before the next.
CHECK_CHARS = 1 << 20


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
    if ref.source is Source.DATA_URL:
        start = data_url_start(ref.value, ref.locator)[1]
    elif ref.source is Source.BASE64:
        start = 0
    else:
        raise ValueError(f"{ref.locator}: a {ref.source.value} item has no inline bytes")
    return Base64Input(ref.value, ref.locator, control, start=start)


def checked_size(ref: MediaRef, control: DecodeControl | None = None) -> int:
    """Check every character of an inline item's base64 (`Base64Input.check`, a 400 naming the item; `control` is
    checked before each piece); the number of bytes it encodes. Runs on a media thread."""
    source = inline_input(ref, control)
    source.check()
    return len(source)
