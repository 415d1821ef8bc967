"""Running the gateway under uvicorn, with a drain on SIGTERM."""

from __future__ import annotations

import uvicorn

from gateway.app import Gateway
from gateway.config import GatewaySettings
from serving.http_limits import HttpLimits
from serving.server import DrainingServer
from serving.server import uvicorn_config as serving_config


def uvicorn_config(app: Gateway, settings: GatewaySettings) -> uvicorn.Config:
    server = settings.server
    limits = HttpLimits(
        max_connections=server.max_connections,
        max_header_bytes=server.max_header_bytes,
        max_headers=server.max_headers,
        header_timeout_s=server.header_timeout_s,
        body_idle_timeout_s=server.body_idle_timeout_s,
    )
    return serving_config(
        app,
        host=server.host,
        port=server.port,
        drain_timeout_s=server.drain_timeout_s,
        log_level=server.log_level,
        http_limits=limits,
    )


def serve(settings: GatewaySettings) -> None:
    gateway = Gateway(settings)
    DrainingServer(uvicorn_config(gateway, settings), gateway).run()
