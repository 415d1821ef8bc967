"""Parsing a request body without copying its inline media.

A request with a hundred inline images is mostly base64 text. Parsing it the usual way materializes every base64
string a second time, next to the raw body the gateway keeps for forwarding byte for byte. Here, long string
literals without escapes are first swapped for short placeholders; orjson parses the small skeleton that is
left, and a media value resolves to a zero-copy view of the raw body. Only the raw body is ever resident, and it
is charged to the request.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from gateway.errors import BadRequest

# Strings shorter than this stay in the skeleton: copying them costs less than tracking them.
LONG_STRING_BYTES = 4096
# Bodies smaller than this are parsed directly.
SKELETON_MIN_BODY_BYTES = 1 << 20
# A body with more string literals than this is text-heavy, not media-heavy: walking it would cost more
# (about 0.6 µs per literal) than the copy it saves.
MAX_LITERALS_TO_WALK = 200_000

# A control character can only be written escaped, and escaped literals are never swapped; a body that holds the
# token anyway (a client that learned it) is parsed directly, so no client value resolves to a span.
_PLACEHOLDER_TOKEN = secrets.token_hex(8)
_PLACEHOLDER_PREFIX = "\x00mmgate-" + _PLACEHOLDER_TOKEN + ":"
_PLACEHOLDER_JSON_PREFIX = orjson.dumps(_PLACEHOLDER_PREFIX)[:-1]  # opening quote and escaped prefix


@dataclass(slots=True)
class ParsedBody:
    document: Any
    raw: bytes | bytearray
    spans: list[tuple[int, int]]

    def resolve(self, value: str) -> str | memoryview:
        """The value itself, or for a swapped-out long literal the view of its bytes in the raw body."""
        if self.spans and value.startswith(_PLACEHOLDER_PREFIX):
            start, end = self.spans[int(value[len(_PLACEHOLDER_PREFIX) :])]
            return memoryview(self.raw)[start:end]
        return value

    def model(self) -> str | None:
        """The body's top-level `model` string, if it has one."""
        document = self.document
        model = document.get("model") if isinstance(document, dict) else None
        return model if isinstance(model, str) else None


def parse_request_body(raw: bytes | bytearray) -> ParsedBody:
    """Parse a JSON request body; malformed JSON is a 400."""
    spans = _long_literal_spans(raw) if len(raw) >= SKELETON_MIN_BODY_BYTES else []
    if spans and raw.find(_PLACEHOLDER_TOKEN.encode()) >= 0:
        spans = []
    source: bytes | bytearray = _skeleton(raw, spans) if spans else raw
    try:
        document = orjson.loads(source)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed_json") from None
    return ParsedBody(document=document, raw=raw, spans=spans)


def _long_literal_spans(raw: bytes | bytearray) -> list[tuple[int, int]]:
    """Content spans of string literals of at least LONG_STRING_BYTES, printable ASCII without escapes."""
    if raw.count(b'"') > 2 * MAX_LITERALS_TO_WALK:
        return []
    find = raw.find
    codes = np.frombuffer(raw, dtype=np.uint8)
    spans: list[tuple[int, int]] = []
    position = 0
    while (start := find(b'"', position)) >= 0:
        end = find(b'"', start + 1)
        # A quote preceded by an odd run of backslashes is escaped and does not end the literal.
        while end >= 0:
            before = end - 1
            while raw[before] == 0x5C:
                before -= 1
            if (end - 1 - before) % 2 == 0:
                break
            end = find(b'"', end + 1)
        if end < 0:
            return []  # unterminated: let orjson report the malformed JSON
        if (
            end - start - 1 >= LONG_STRING_BYTES
            and find(b"\\", start + 1, end) < 0
            and _printable(codes[start + 1 : end])
        ):
            spans.append((start + 1, end))
        position = end + 1
    return spans


def _printable(codes: npt.NDArray[np.uint8]) -> bool:
    """Printable ASCII only (base64 always is): such a literal is valid JSON as it stands. Control characters
    and bytes that may be invalid UTF-8 stay in the skeleton, for orjson to judge."""
    return int(codes.min()) >= 0x20 and int(codes.max()) < 0x7F


def _skeleton(raw: bytes | bytearray, spans: list[tuple[int, int]]) -> bytes:
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    previous = 0
    for index, (start, end) in enumerate(spans):
        # Keep the opening quote out of the copied piece; the placeholder brings its own.
        pieces.append(view[previous : start - 1])
        pieces.append(_PLACEHOLDER_JSON_PREFIX + str(index).encode() + b'"')
        previous = end + 1
    pieces.append(view[previous:])
    return b"".join(pieces)
