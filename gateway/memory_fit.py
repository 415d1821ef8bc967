"""Whether the gateway's configured bounds fit in the memory its container may use: checked before it serves.

What the gateway's processes can hold at once is bounded by settings: the media budget
(`limits.max_multimodal_cpu_bytes`, shared by the workers of one gateway whatever the backend), the request bodies
(`limits.max_buffered_body_bytes`, split between the workers) and each process's own baseline. A gateway whose
bounds add up to more than its cgroup's memory limit would be killed by the kernel under the load its settings
admit; it refuses to start instead, naming the keys and the limit (docs/sizing.md says how to size them).
"""

from __future__ import annotations

import logging

from gateway.config import GatewaySettings
from serving.cgroup import MemoryLimit, memory_limit
from serving.settings_loader import ConfigError
from serving.settings_types import format_bytes

logger = logging.getLogger(__name__)

# What one gateway process holds besides what its bounds count: 98 MiB resident after start-up with the Qwen2.5-VL
# processor (and no more after 20 full-HD requests), plus the slack tests/gateway/test_memory.py allows over the
# bounds at peak (96 MiB: allocator arenas, connection buffers, decoder scratch), rounded up.
PROCESS_OVERHEAD_BYTES = 256 << 20

MEDIA_KNOB = "limits.max_multimodal_cpu_bytes"
BODIES_KNOB = "limits.max_buffered_body_bytes"


def processes(settings: GatewaySettings) -> int:
    """The gateway's processes: its workers, and their supervisor when there are several."""
    workers = settings.server.workers
    return workers + 1 if workers > 1 else workers


def required_bytes(settings: GatewaySettings) -> int | None:
    """What the configured bounds and the processes' baseline add up to; None when a bound is off (null)."""
    media, bodies = settings.limits.max_multimodal_cpu_bytes, settings.limits.max_buffered_body_bytes
    if media is None or bodies is None:
        return None
    return int(media) + int(bodies) + processes(settings) * PROCESS_OVERHEAD_BYTES


def check(settings: GatewaySettings, limit: MemoryLimit | None) -> None:
    """Raise `ConfigError` when the bounds plus overhead do not fit in `limit`; log what was checked."""
    if limit is None or not settings.server.check_memory_limit:
        return
    needed = required_bytes(settings)
    if needed is None:
        off = MEDIA_KNOB if settings.limits.max_multimodal_cpu_bytes is None else BODIES_KNOB
        logger.warning(
            "%s is null: nothing bounds what the gateway holds under the memory limit of %s (%s)",
            off,
            format_bytes(limit.bytes),
            limit.source,
        )
        return
    limits = settings.limits
    parts = (
        f"{MEDIA_KNOB}={format_bytes(int(limits.max_multimodal_cpu_bytes or 0))} + "
        f"{BODIES_KNOB}={format_bytes(int(limits.max_buffered_body_bytes or 0))} + "
        f"{processes(settings)} process(es) x {format_bytes(PROCESS_OVERHEAD_BYTES)} (server.workers="
        f"{settings.server.workers}) = {format_bytes(needed)}"
    )
    if needed > limit.bytes:
        raise ConfigError(
            f"the configured bounds do not fit in this container's memory limit: {parts}, over the cgroup limit "
            f"of {format_bytes(limit.bytes)} ({limit.source}); lower them or raise the container's memory limit "
            "(docs/sizing.md), or set server.check_memory_limit: false"
        )
    logger.info("memory bounds %s fit the cgroup limit of %s", parts, format_bytes(limit.bytes))


def check_container(settings: GatewaySettings) -> None:
    """`check` against this process's cgroup limit: the gateway's start-up check."""
    check(settings, memory_limit())
