"""`python -m engine_adapter --config FILE [--host H] [--port P]`.

Submits get 503 at once on SIGTERM; uvicorn stops accepting, and admitted requests get up to
`server.drain_timeout_s` to finish streaming."""

from __future__ import annotations

import sys

from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings
from serving.access_log import ACCESS_LOGGER, RequestLog
from serving.app import ServedApp
from serving.cli import LISTEN_FLAGS, Process

# Polled by orchestrators and Prometheus; `server.access_log_probes: false` leaves them out of the log.
UNLOGGED_PROBES = ("/healthz", "/metrics")


def with_access_log(app: ServedApp, settings: EngineSettings) -> object:
    """The engine's requests logged as the gateway's are: one JSON line each on stdout."""
    if not settings.server.access_log:
        return app
    return RequestLog(app, skip_paths=() if settings.server.access_log_probes else UNLOGGED_PROBES)


ENGINE = Process(
    module="engine_adapter",
    label="engine",
    description="mmgate engine process",
    default_config="configs/engine.yaml",
    settings=EngineSettings,
    server=lambda settings: settings.server,
    app=EngineApp,
    flags=LISTEN_FLAGS,
    access_logger=ACCESS_LOGGER,
    wrap=with_access_log,
)

if __name__ == "__main__":
    sys.exit(ENGINE.main())
