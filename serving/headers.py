"""Header rules for relaying HTTP (RFC 9110 §7.6.1): hop-by-hop headers stop at each hop."""

from __future__ import annotations

from collections.abc import Iterable

RawHeaders = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)


def end_to_end(headers: Iterable[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()) -> RawHeaders:
    """The headers that travel on: names lowercased, hop-by-hop ones and those named in Connection removed."""
    lowered = [(name.lower(), value) for name, value in headers]
    removed = HOP_BY_HOP | drop if drop else HOP_BY_HOP
    for name, value in lowered:
        if name == b"connection":
            removed = removed | {token.strip().lower() for token in value.split(b",")}
    return [pair for pair in lowered if pair[0] not in removed]


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lowercase), whatever case the headers use."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
