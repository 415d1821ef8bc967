"""Header rules for relaying HTTP (RFC 9110 §7.6.1): hop-by-hop headers stop at each hop."""

from __future__ import annotations

import functools
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
    removed = _removed.get(drop)
    if removed is None:
        removed = _removed[drop] = HOP_BY_HOP | drop
    kept: RawHeaders = []
    named: frozenset[bytes] = frozenset()
    for name, value in headers:
        name = name.lower()
        if name not in removed:
            kept.append((name, value))
        elif name == b"connection":
            named |= _connection_names(value)
    return [pair for pair in kept if pair[0] not in named] if named else kept


@functools.lru_cache(maxsize=64)
def _connection_names(value: bytes) -> frozenset[bytes]:
    """The headers a Connection value names that are not hop-by-hop anyway (most name none: `keep-alive`, `close`).
    Remembered: a connection sends the same value with every request."""
    return frozenset(token.strip().lower() for token in value.split(b",")) - HOP_BY_HOP


# HOP_BY_HOP with each `drop` set end_to_end is called with (a few constant sets).
_removed: dict[frozenset[bytes], frozenset[bytes]] = {}


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lowercase), whatever case the headers use."""
    size = len(name)
    for key, value in headers:
        # Only a name of the same length can match: most are passed over without lowercasing them.
        if len(key) == size and key.lower() == name:
            return value
    return None
