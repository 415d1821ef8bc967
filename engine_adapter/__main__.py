"""`python -m engine_adapter --config FILE [--host H] [--port P]`.

Submits get 503 at once on SIGTERM; uvicorn stops accepting, and admitted requests get up to
`server.drain_timeout_s` to finish streaming."""

from __future__ import annotations

import sys

from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings
from serving.cli import LISTEN_FLAGS, Process

ENGINE = Process(
    module="engine_adapter",
    label="engine",
    description="mmgate engine process",
    default_config="configs/engine.yaml",
    settings=EngineSettings,
    server=lambda settings: settings.server,
    app=EngineApp,
    flags=LISTEN_FLAGS,
)

if __name__ == "__main__":
    sys.exit(ENGINE.main())
