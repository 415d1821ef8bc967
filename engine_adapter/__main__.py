"""`python -m engine_adapter --config FILE [--host H] [--port P]`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from engine_adapter.config import EngineSettings
from engine_adapter.server import serve
from serving.server import configure_logging
from serving.settings_loader import ConfigError, load_settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine_adapter", description="mmgate engine process")
    parser.add_argument("--config", help="YAML config file (see configs/engine.yaml)")
    parser.add_argument("--host", help="listen address (server.host)")
    parser.add_argument("--port", type=int, help="listen port (server.port)")
    return parser.parse_args(argv)


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    return {"server": server} if server else {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(EngineSettings, args.config, cli_overrides(args))
    except ConfigError as exc:
        print(f"mmgate engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level)
    try:
        serve(settings)
    except ConfigError as exc:
        print(f"mmgate engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
