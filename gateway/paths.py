"""Request paths in normal form, so that what the gateway matches (admission routes, `upstream.blocked_paths`) is
what an upstream or a proxy in front of it resolves: `//release_memory`, `/v1/../release_memory`,
`/./release_memory` and `/%2e%2e/release_memory` all reach `/release_memory` at a server that normalizes paths.

As Envoy's `normalize_path` and `merge_slashes` do: percent-encoded unreserved characters that spell a dot are
decoded, dot segments removed (RFC 3986 5.2.4), runs of slashes merged. A percent-encoded slash or backslash is
refused: servers disagree on whether it separates segments, so no normal form says what it reaches.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from serving.asgi import Scope

_ENCODED_DOT = re.compile(rb"%2e", re.IGNORECASE)
_AMBIGUOUS = re.compile(rb"%2f|%5c|\\", re.IGNORECASE)


class UnnormalizablePath(ValueError):
    """A path with a percent-encoded slash or a backslash."""


def normal_path(raw_path: bytes) -> bytes:
    """`raw_path` (a request target's path, percent-encoding kept) in normal form."""
    # Searched as text: on Python 3.11 `bytes in bytes` raises and clears a TypeError inside each test.
    text = raw_path.decode("latin-1")
    if text.startswith("/") and "%" not in text and "\\" not in text and "/." not in text and "//" not in text:
        # No escape, no dot segment, no empty segment: the path is its own normal form (most paths).
        return raw_path
    return _normalized(raw_path)


def _normalized(raw_path: bytes) -> bytes:
    if _AMBIGUOUS.search(raw_path):
        raise UnnormalizablePath("a percent-encoded slash or backslash")
    segments: list[bytes] = []
    parts = _ENCODED_DOT.sub(b".", raw_path).split(b"/")[1:]
    for index, segment in enumerate(parts):
        last = index == len(parts) - 1
        if segment == b"..":
            if segments:
                segments.pop()
            if last:
                segments.append(b"")
        elif segment == b".":
            if last:
                segments.append(b"")
        elif segment or last:
            segments.append(segment)
    return b"/" + b"/".join(segments)


def normalize_scope(scope: Scope) -> bool:
    """Put the request's path in normal form, in place (`path` and `raw_path`, which the proxy forwards); False
    when it has none. A target that is not a path (`*`, an absolute URI) is left as it is."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    if not raw.startswith(b"/"):
        return True
    try:
        normal = normal_path(raw)
    except UnnormalizablePath:
        return False
    if normal != raw:
        scope["raw_path"] = normal
        scope["path"] = unquote(normal.decode("latin-1"))
    return True
