"""What the gateway learns about one request: kept in the ASGI scope for later steps and the log."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Band
from gateway.envelopes import Dialect
from gateway.tenants import DEFAULT_TENANT, Tenant

SCOPE_KEY = "mmgate.request"


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    route: str
    dialect: Dialect
    admission: bool = False
    """`POST` to an admission route: its body is capped at `limits.max_request_body_bytes` and its media admitted."""
    normal_path: bool = True
    """The path has a normal form (gateway/paths.py), which `path` and `raw_path` now hold."""
    started: float = field(default_factory=time.perf_counter)
    started_epoch_s: float = field(default_factory=time.time)
    # Seconds from `started` to the end of the response (set when the request ends).
    duration_s: float | None = None
    # The body's `model` when the admission path parsed it.
    model: str | None = None
    rejection: str | None = None
    # The full message of the error the request ended with (the client may have been told less).
    error: str | None = None
    client_disconnected: bool = False
    upstream_ttfb_s: float | None = None
    media_items: int = 0
    media_counted_bytes: int | None = None
    budget_wait_s: float | None = None
    # Time the body waited for room under limits.max_buffered_body_bytes before it was read.
    body_wait_s: float | None = None
    # Whom the media budget queues the request under (requests with media), and its band.
    tenant: Tenant = DEFAULT_TENANT
    band: Band = Band.INTERACTIVE


def request_info(scope: MutableMapping[str, Any]) -> RequestInfo:
    info: RequestInfo = scope[SCOPE_KEY]
    return info
