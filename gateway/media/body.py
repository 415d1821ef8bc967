"""Parsing a request body without copying its inline media.

A request with a hundred inline images is mostly base64 text. Parsing it the usual way materializes every base64
string a second time, next to the raw body the gateway keeps for forwarding byte for byte. Here, long string
literals without escapes are first swapped for short placeholders; orjson parses the small skeleton that is
left, and a media value resolves to a zero-copy view of the raw body. Only the raw body is ever resident, and it
is charged to the request.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from gateway.errors import BadRequest

# Strings shorter than this stay in the skeleton: copying them costs less than tracking them.
LONG_STRING_BYTES = 4096
# Bodies smaller than this are parsed directly: their long literals are few and short enough that the copies
# parsing makes of them cost less than finding them.
SKELETON_MIN_BODY_BYTES = 64 << 10
# A body with more string literals than this is text-heavy, not media-heavy: it is parsed directly, its long
# literals copied (and charged for, see parse_bound), so that finding them costs no more than about 5 ms of Python
# (0.6 µs a literal), which holds the interpreter for every other thread, the event loop's included.
MAX_LITERALS_TO_WALK = 8192

# A control character can only be written escaped, and escaped literals are never swapped; a body that holds the
# token anyway (a client that learned it) is parsed directly, so no client value resolves to a span.
_PLACEHOLDER_TOKEN = secrets.token_hex(8)
_PLACEHOLDER_TOKEN_BYTES = _PLACEHOLDER_TOKEN.encode()
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


@dataclass(slots=True)
class PreparedBody:
    """A body ready to parse: what the parser reads (the body, or its skeleton without the long literals), its
    JSON tokens, and a bound on what parsing it allocates, known before anything is parsed."""

    raw: bytes | bytearray
    source: bytes | bytearray
    spans: list[tuple[int, int]]
    tokens: int
    parse_bytes: int

    def parse(self) -> ParsedBody:
        """The parsed body; malformed JSON is a 400."""
        try:
            document = orjson.loads(self.source)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed_json") from None
        return ParsedBody(document=document, raw=self.raw, spans=self.spans)


def prepare_body(raw: bytes | bytearray) -> PreparedBody:
    """Swap a large body's long literals out (see the module docstring) and count what is left to parse."""
    spans = _long_literal_spans(raw) if len(raw) >= SKELETON_MIN_BODY_BYTES else []
    if spans and _token_outside(raw, spans):
        spans = []
    source: bytes | bytearray = _skeleton(raw, spans) if spans else raw
    tokens = json_tokens(source)
    return PreparedBody(raw=raw, source=source, spans=spans, tokens=tokens, parse_bytes=parse_bound(source, tokens))


def parse_request_body(raw: bytes | bytearray) -> ParsedBody:
    """Parse a JSON request body; malformed JSON is a 400."""
    return prepare_body(raw).parse()


# What one JSON token (an opening brace or bracket, a quote, a comma or a colon) can make the parser allocate, at
# most: the Python object it opens or separates (a dict or list with its garbage-collector header, an entry's slot,
# a number, a string's header) and the parser's own 16-byte value for it. Measured with tracemalloc on orjson 3.x
# (tests/gateway/media/test_body.py): an empty dict per `{},` is 72 bytes, a dict entry per `"k":1,` about 63
# bytes a token, a list of one-byte numbers 32 bytes a comma.
PARSE_BYTES_PER_TOKEN = 96
_TOKENS = b'{["[,:'
_TOKEN_BLOCK_BYTES = 256 << 10


def json_tokens(source: bytes | bytearray) -> int:
    """The opening braces and brackets, quotes, commas and colons of `source` (those inside strings too), counted a
    block at a time so that the count copies at most a block."""
    view = memoryview(source)
    return sum(
        len(block) - len(block.translate(None, _TOKENS))
        for block in (
            bytes(view[start : start + _TOKEN_BLOCK_BYTES]) for start in range(0, len(view), _TOKEN_BLOCK_BYTES)
        )
    )


def parse_bound(source: bytes | bytearray, tokens: int) -> int:
    """Bytes parsing `source` (with `tokens` JSON tokens) can allocate, at most: each token's objects; the parser's
    copy of its input; its strings' characters, one byte each when the body is ASCII without `\\u` escapes,
    otherwise up to four (a string holding one character past U+FFFF takes four bytes for each)."""
    per_byte = 2 if source.isascii() and b"\\u" not in source else 5
    text = per_byte * len(source)
    return PARSE_BYTES_PER_TOKEN * tokens + text


def _long_literal_spans(raw: bytes | bytearray) -> list[tuple[int, int]]:
    """Content spans of string literals of at least LONG_STRING_BYTES, printable ASCII without escapes."""
    codes = np.frombuffer(raw, dtype=np.uint8)
    if _count_quotes(codes) > 2 * MAX_LITERALS_TO_WALK:
        return []
    find = raw.find
    spans: list[tuple[int, int]] = []
    position = 0
    while (start := find(b'"', position)) >= 0:
        end = _closing_quote(raw, start)
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


def _token_outside(raw: bytes | bytearray, spans: list[tuple[int, int]]) -> bool:
    """Whether the placeholder token is in the body outside the long literals: only there is it parsed, into a
    value that could resolve to a span; inside one it is never parsed."""
    previous = 0
    for start, end in spans:
        if raw.find(_PLACEHOLDER_TOKEN_BYTES, previous, start) >= 0:
            return True
        previous = end
    return raw.find(_PLACEHOLDER_TOKEN_BYTES, previous) >= 0


def _count_quotes(codes: npt.NDArray[np.uint8]) -> int:
    """The body's quote characters, counted a block at a time: numpy's vector compare is several times faster
    than `bytes.count` for one byte, and the blocks bound the comparison's temporary array."""
    return sum(
        int(np.count_nonzero(codes[start : start + _COUNT_BLOCK_BYTES] == 0x22))
        for start in range(0, len(codes), _COUNT_BLOCK_BYTES)
    )


_COUNT_BLOCK_BYTES = 256 << 10


def _closing_quote(raw: bytes | bytearray, start: int) -> int:
    """Where the string literal opened at `start` ends (its closing quote), or -1 if it does not."""
    find = raw.find
    end = find(b'"', start + 1)
    # A quote preceded by an odd run of backslashes is escaped and does not end the literal.
    while end >= 0:
        before = end - 1
        while raw[before] == 0x5C:
            before -= 1
        if (end - 1 - before) % 2 == 0:
            return end
        end = find(b'"', end + 1)
    return -1


Path = tuple[str | int, ...]
_SCALAR = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SPACE = re.compile(rb"[ \t\r\n]*")


def string_spans(raw: bytes | bytearray, paths: Collection[Path]) -> dict[Path, tuple[int, int]]:
    """Where the string values at `paths` lie in a JSON document that parses: each path's (start, end) in `raw`,
    its quotes included. A key that repeats in an object is read as its last value, as the parser reads it. Every
    byte is walked once; string literals are skipped by their closing quote, so a body of large base64 literals
    costs little."""
    wanted = set(paths)
    prefixes = {path[:depth] for path in wanted for depth in range(len(path) + 1)}
    found: dict[Path, tuple[int, int]] = {}
    # Each open container: its path, whether it is an object, the key or index of the value being read.
    stack: list[tuple[Path, bool, str | int | None]] = []
    position = 0
    expect_key = False
    while True:
        position = _SPACE.match(raw, position).end()  # type: ignore[union-attr]
        if position >= len(raw):
            return found
        char = raw[position]
        if char in (0x2C, 0x3A):  # , :
            if char == 0x2C and stack:
                path, is_object, at = stack[-1]
                if is_object:
                    expect_key = True
                else:
                    stack[-1] = (path, False, int(at or 0) + 1)
            position += 1
            continue
        if char in (0x7D, 0x5D):  # } ]
            stack.pop()
            expect_key = False
            position += 1
            continue
        here: Path = () if not stack else (*stack[-1][0], stack[-1][2])  # type: ignore[arg-type]
        if char == 0x22:  # "
            end = _closing_quote(raw, position)
            if expect_key:
                path, _, _ = stack[-1]
                stack[-1] = (path, True, orjson.loads(raw[position : end + 1]))
                expect_key = False
            elif here in wanted:
                found[here] = (position, end + 1)
            position = end + 1
        elif char in (0x7B, 0x5B):  # { [
            found.pop(here, None)  # a repeated key whose last value is not a string
            is_object = char == 0x7B
            stack.append((here, is_object, None if is_object else 0))
            expect_key = is_object
            position += 1
            if here not in prefixes:
                position = _skip_container(raw, position - 1)
                stack.pop()
                expect_key = False
        else:
            match = _SCALAR.match(raw, position)
            if match is None:
                raise ValueError(f"not JSON at byte {position}")
            found.pop(here, None)
            position = match.end()


def _skip_container(raw: bytes | bytearray, start: int) -> int:
    """The position after the object or array that opens at `start`."""
    depth = 0
    position = start
    while True:
        match = _STRUCTURE.search(raw, position)
        if match is None:
            raise ValueError("an object or array does not end")
        char = raw[match.start()]
        if char == 0x22:
            position = _closing_quote(raw, match.start()) + 1
            continue
        depth += 1 if char in (0x7B, 0x5B) else -1
        position = match.end()
        if depth == 0:
            return position


_STRUCTURE = re.compile(rb'["{}\[\]]')


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
