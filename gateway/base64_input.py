"""Reading an inline item's container header without decoding the item: a seekable file object over its base64
text that decodes only the ranges the container reads.

The probe that sizes a request before its budget is granted reads a video's or audio's header through this, so
the whole base64 is decoded once (by the load) and nothing decoded is held while the request waits for the budget.
Base64 maps each 4 characters to 3 bytes, so byte `i` lies in characters `i // 3 * 4` to `i // 3 * 4 + 4`.
"""

from __future__ import annotations

from gateway.data_url import decode_base64, split_data_url
from gateway.image_loader import DecodeControl
from gateway.media_container import MemoryInput
from gateway.media_parts import MediaRef, Source

__all__ = ["Base64Input", "inline_input"]


class Base64Input(MemoryInput):
    """A read-only, seekable file object over the bytes `payload` (base64 without whitespace, as the data URL
    decoder accepts) encodes; each `read` decodes the characters of its range only and checks `control` first.
    Invalid characters in a range read are a 400, as `decode_base64` answers them."""

    def __init__(self, payload: memoryview, locator: str, control: DecodeControl | None = None) -> None:
        super().__init__(b"", control)
        self._payload = payload.cast("B") if payload.format != "B" else payload
        self._locator = locator
        chars = len(self._payload)
        if chars % 4:
            decode_base64(self._payload[chars - chars % 4 :], locator)  # raises naming the bad length
        padding = len(bytes(self._payload[-2:])) - len(bytes(self._payload[-2:]).rstrip(b"="))
        self._size = chars // 4 * 3 - padding

    def read(self, size: int = -1, /) -> bytes:
        if self._control is not None:
            self._control.check()
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        if end <= start:
            return b""
        first, last = start // 3, -(-end // 3)
        decoded = decode_base64(self._payload[first * 4 : last * 4], self._locator)
        chunk = decoded[start - first * 3 : end - first * 3]
        self._position = end
        self.reads += 1
        self.bytes_read += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = 0, /) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def __len__(self) -> int:
        return self._size


def inline_input(ref: MediaRef, control: DecodeControl | None = None) -> Base64Input:
    """The encoded bytes of an inline item (a data URL or bare base64) as a `Base64Input`; nothing is decoded."""
    if ref.source is Source.DATA_URL:
        payload = split_data_url(ref.value, ref.locator)[1]
    elif ref.source is Source.BASE64:
        value = ref.value
        payload = memoryview(value.encode("latin-1", "replace")) if isinstance(value, str) else value
    else:
        raise ValueError(f"{ref.locator}: a {ref.source.value} item has no inline bytes")
    return Base64Input(payload, ref.locator, control)
