"""The media budget a gateway process runs with, chosen by `limits.budget_backend`.

- `local`: a `LocalBudget` in this process. With `server.workers` N > 1 each worker holds
  `limits.max_multimodal_cpu_bytes // N`, so the workers of one gateway together never pass the cap.
- `redis`: a `RedisBudget` shared by every worker and replica with the same `redis.url`, `redis.key_prefix` and
  `redis.scope`, what the budget protects: by default the model server the gateway forwards to, so that gateways in
  front of different servers never share one cap (a server on loopback is this host's own).

Both queue fairly between tenants (`limits.fairness`): the local backend within the process, the Redis backend
across every gateway sharing the prefix.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from gateway.budget.base import MediaBudget
from gateway.budget.local import LocalBudget, UnlimitedBudget
from gateway.budget.redis import RedisBudget
from gateway.config import BudgetBackend, GatewaySettings
from gateway.metrics import GatewayMetrics
from serving.settings_types import format_bytes


def local_share(settings: GatewaySettings) -> int | None:
    """What one worker's local budget holds: the whole cap, or its `1 / server.workers` share."""
    total = settings.limits.max_multimodal_cpu_bytes
    return None if total is None else max(1, total // settings.server.workers)


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def budget_scope(settings: GatewaySettings) -> tuple[str, str]:
    """What the shared budget protects, and where that name comes from: `redis.scope`, or the server this gateway
    forwards media to (`fronted_server`)."""
    if settings.redis.scope is not None:
        return settings.redis.scope, "redis.scope"
    return fronted_server(settings)


def fronted_server(settings: GatewaySettings) -> tuple[str, str]:
    """The server this gateway forwards media to (`engine.url` in engine mode, else `upstream.url`) as host:port, a
    loopback one named by this host's name instead (every pod's sidecar reaches its own server at 127.0.0.1); and
    the key it comes from."""
    if settings.engine.url is not None:
        key, url = "engine.url", settings.engine.url
    else:
        key, url = "upstream.url", settings.upstream.url
    host, port = url.host or "", url.port
    if _is_loopback(host):
        return f"{socket.gethostname()}:{port}", f"{key} on loopback: this host's server"
    return f"{host}:{port}", key


def budget_name(settings: GatewaySettings) -> str:
    """The shared budget's name (where its keys live): `<redis.key_prefix>:<scope>`; "" for the local backend."""
    if settings.limits.budget_backend is not BudgetBackend.REDIS:
        return ""
    return f"{settings.redis.key_prefix}:{budget_scope(settings)[0]}"


def build_budget(settings: GatewaySettings, metrics: GatewayMetrics) -> MediaBudget:
    limits = settings.limits
    total = limits.max_multimodal_cpu_bytes
    if total is None:
        return UnlimitedBudget()
    fairness = limits.fairness
    batch_timeout_s = fairness.batch_admission_timeout_s if fairness.enabled else limits.admission_timeout_s
    if limits.budget_backend is BudgetBackend.REDIS:
        redis = settings.redis
        return RedisBudget(
            url=redis.url,
            capacity=total,
            timeout_s=limits.admission_timeout_s,
            max_queued=limits.max_queued_requests,
            key_prefix=budget_name(settings),
            lease_ttl_s=redis.lease_ttl_s,
            on_unavailable=redis.on_unavailable,
            # Each worker process of each replica falls back to its own share.
            expected_replicas=settings.budget_processes,
            socket_timeout_s=redis.socket_timeout_s,
            metrics=metrics,
            on_round_trip=lambda op, seconds: metrics.budget_backend_seconds_by(op).observe(seconds),
            batch_timeout_s=batch_timeout_s,
            window_s=fairness.window_s,
            max_tenants=fairness.max_tenants,
            member=f"{socket.gethostname()} pid {os.getpid()}",
            fronts=fronted_server(settings)[0],
        )
    share = local_share(settings)
    assert share is not None
    return LocalBudget(
        share,
        timeout_s=limits.admission_timeout_s,
        max_queued=limits.max_queued_requests,
        metrics=metrics,
        batch_timeout_s=batch_timeout_s,
        window_s=fairness.window_s,
        max_tenants=fairness.max_tenants,
    )


def describe(settings: GatewaySettings) -> str:
    """One log line: which backend, and what this process may hold."""
    limits, workers = settings.limits, settings.server.workers
    total = limits.max_multimodal_cpu_bytes
    if total is None:
        return "media budget off (limits.max_multimodal_cpu_bytes=null)"
    if limits.budget_backend is BudgetBackend.REDIS:
        redis = settings.redis
        scope, source = budget_scope(settings)
        origin = source if redis.scope is not None else f"redis.scope, from {source}"
        return (
            f"media budget backend redis: one cap of {format_bytes(total)} and one queue ({_queueing(settings)}) "
            f"shared by every gateway process of budget {budget_name(settings)!r}, which protects {scope} "
            f"({origin}); leases expire {redis.lease_ttl_s:g} s after their process stops renewing them; Redis "
            f"down: {redis.on_unavailable.value}"
        )
    if workers > 1:
        share = local_share(settings)
        assert share is not None
        return (
            f"media budget backend local with {workers} workers: each worker holds "
            f"limits.max_multimodal_cpu_bytes // server.workers = {format_bytes(share)} of {format_bytes(total)}, "
            f"with a queue of its own ({_queueing(settings)}; limits.budget_backend=redis shares one cap and one "
            "queue)"
        )
    return f"media budget backend local: {format_bytes(total)} in this process ({_queueing(settings)})"


def _queueing(settings: GatewaySettings) -> str:
    fairness = settings.limits.fairness
    if not fairness.enabled:
        return "FIFO"
    configured = f", {len(fairness.tenants)} configured" if fairness.tenants else ""
    return f"fair queueing between tenants by {fairness.tenant_from.value}{configured}"
