"""Running the gateway under uvicorn, with a drain on SIGTERM."""

from __future__ import annotations

from types import FrameType

import uvicorn

from gateway.app import Gateway
from gateway.config import GatewaySettings


class DrainingServer(uvicorn.Server):
    """uvicorn stops accepting and lets in-flight streams finish up to `server.drain_timeout_s`; this also
    flips `/readyz` to 503 first."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.gateway.start_draining()
        super().handle_exit(sig, frame)


def uvicorn_config(app: Gateway, settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        lifespan="on",
        # Upstream's Server and Date headers pass through unchanged.
        server_header=False,
        date_header=False,
        access_log=False,
        # The gateway appends the peer to X-Forwarded-For itself; uvicorn must not rewrite the peer from it.
        proxy_headers=False,
        log_config=None,
        timeout_graceful_shutdown=int(settings.server.drain_timeout_s + 0.999),
        log_level=settings.server.log_level,
    )


def serve(settings: GatewaySettings) -> None:
    gateway = Gateway(settings)
    DrainingServer(uvicorn_config(gateway, settings), gateway).run()
