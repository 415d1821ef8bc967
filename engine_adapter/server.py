"""Running the engine under uvicorn, with a drain on SIGTERM."""

from __future__ import annotations

from types import FrameType

import uvicorn

from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings


class DrainingServer(uvicorn.Server):
    """On SIGTERM: submits get 503 at once, uvicorn stops accepting, and admitted requests get up to
    `server.drain_timeout_s` to finish streaming."""

    def __init__(self, config: uvicorn.Config, app: EngineApp) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.start_draining()
        super().handle_exit(sig, frame)


def uvicorn_config(app: EngineApp, settings: EngineSettings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        lifespan="on",
        server_header=False,
        date_header=False,
        access_log=False,
        proxy_headers=False,
        log_config=None,
        timeout_graceful_shutdown=int(settings.server.drain_timeout_s + 0.999),
        log_level=settings.server.log_level,
    )


def serve(settings: EngineSettings) -> None:
    app = EngineApp(settings)
    DrainingServer(uvicorn_config(app, settings), app).run()
