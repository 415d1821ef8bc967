"""`python -m gateway --config FILE [--host H] [--port P] [--upstream URL] [--workers N]`."""

from __future__ import annotations

import sys

from gateway import memory_fit
from gateway.app import Gateway
from gateway.config import GatewaySettings
from serving.access_log import ACCESS_LOGGER
from serving.cli import LISTEN_FLAGS, Flag, Process
from serving.http_limits import HttpLimits


def http_limits(settings: GatewaySettings) -> HttpLimits:
    server = settings.server
    return HttpLimits(
        max_connections=server.max_connections,
        max_header_bytes=server.max_header_bytes,
        max_headers=server.max_headers,
        header_timeout_s=server.header_timeout_s,
        body_idle_timeout_s=server.body_idle_timeout_s,
        body_min_rate=server.body_min_rate_bytes_s,
        body_rate_grace_s=server.body_rate_grace_s,
    )


GATEWAY = Process(
    module="gateway",
    label="gateway",
    description="mmgate gateway",
    default_config="configs/gateway.yaml",
    settings=GatewaySettings,
    server=lambda settings: settings.server,
    app=Gateway,
    flags=(
        *LISTEN_FLAGS,
        Flag("--upstream", "upstream.url", "upstream model server URL"),
        Flag("--workers", "server.workers", "worker processes serving the port, sharing the media budget", int),
    ),
    http_limits=http_limits,
    access_logger=ACCESS_LOGGER,
    workers=lambda settings: settings.server.workers,
    extra_ports=lambda settings: () if settings.server.metrics_port is None else (settings.server.metrics_port,),
    preflight=memory_fit.check_container,
)

if __name__ == "__main__":
    sys.exit(GATEWAY.main())
