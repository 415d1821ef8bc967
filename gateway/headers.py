"""Header rules for a transparent proxy (RFC 9110 §7.6.1): hop-by-hop headers stop here."""

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


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(token.strip().lower() for token in value.split(b","))
    return tokens


def end_to_end(headers: Iterable[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()) -> RawHeaders:
    """The headers that travel on: names lowercased, hop-by-hop ones and those named in Connection removed."""
    headers = list(headers)
    removed = HOP_BY_HOP | drop | _connection_tokens(headers)
    return [(name.lower(), value) for name, value in headers if name.lower() not in removed]


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
