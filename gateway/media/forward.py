"""What the upstream gets of a downloaded item: a data URL of exactly the bytes the gateway downloaded, checked and
counted (`media.fetch.forward: inline`), in place of the URL.

Forwarding the URL would let the upstream fetch it again, from its own network and outside the gateway's SSRF
guard, and get other bytes than the ones the gateway checked (a server can answer the gateway's User-Agent with a
small image and anyone else with a bomb). The forwarded body is the raw body, byte for byte, but for each
downloaded item's URL literal: it is assembled from views of the raw body and the new literals, without a copy of
the body.
"""

from __future__ import annotations

import pybase64

from gateway.media.accounting import RequestAccount
from gateway.media.base import LoadedItem
from gateway.media.body import ParsedBody, string_spans

Pieces = list[bytes | memoryview]


def media_type(item: LoadedItem) -> str:
    """The media type of a loaded item's bytes, from what its header read found (not from what the URL's server
    said)."""
    return item.header.media_type if item.header is not None else "application/octet-stream"


def inline_downloads(parsed: ParsedBody, items: list[LoadedItem], account: RequestAccount) -> Pieces | None:
    """The request body with each downloaded item's URL replaced by a data URL of its bytes, as pieces to send in
    order; None when no item was downloaded. The data URLs are new memory: each is charged to `account` (a 413
    past the per-request cap)."""
    downloads = [item for item in items if item.downloaded is not None]
    if not downloads:
        return None
    spans = string_spans(parsed.raw, [item.ref.value_path for item in downloads])
    view = memoryview(parsed.raw)
    pieces: Pieces = []
    previous = 0
    for item in sorted(downloads, key=lambda item: spans[item.ref.value_path]):
        assert item.downloaded is not None
        start, end = spans[item.ref.value_path]
        head = f'"data:{media_type(item)};base64,'.encode()
        encoded = pybase64.b64encode(item.downloaded)
        account.charge(len(head) + len(encoded) + 1, "media forwarded as data URLs")
        pieces += [view[previous:start], head, encoded, b'"']
        previous = end
    pieces.append(view[previous:])
    return pieces
