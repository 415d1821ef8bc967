"""Header rules for relaying a backend's answer (RFC 9110 §7.6.1): hop-by-hop headers stop here."""

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


def end_to_end(headers: Iterable[tuple[bytes, bytes]]) -> RawHeaders:
    """The headers that travel on: names lowercased, hop-by-hop ones and those named in Connection removed."""
    headers = list(headers)
    named = {
        token.strip().lower() for name, value in headers if name.lower() == b"connection" for token in value.split(b",")
    }
    removed = HOP_BY_HOP | named
    return [(name.lower(), value) for name, value in headers if name.lower() not in removed]


def get_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
