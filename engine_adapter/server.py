"""Running the engine under uvicorn, with a drain on SIGTERM: submits get 503 at once, uvicorn stops accepting,
and admitted requests get up to `server.drain_timeout_s` to finish streaming."""

from __future__ import annotations

import uvicorn

from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings
from serving.server import DrainingServer
from serving.server import uvicorn_config as serving_config


def uvicorn_config(app: EngineApp, settings: EngineSettings) -> uvicorn.Config:
    server = settings.server
    return serving_config(
        app, host=server.host, port=server.port, drain_timeout_s=server.drain_timeout_s, log_level=server.log_level
    )


def serve(settings: EngineSettings) -> None:
    app = EngineApp(settings)
    DrainingServer(uvicorn_config(app, settings), app).run()
