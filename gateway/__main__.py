"""`python -m gateway --config FILE [--host H] [--port P] [--upstream URL]`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from gateway.config import GatewaySettings
from gateway.server import serve
from serving.settings_loader import ConfigError, load_settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="mmgate gateway")
    parser.add_argument("--config", help="YAML config file (see configs/gateway.yaml)")
    parser.add_argument("--host", help="listen address (server.host)")
    parser.add_argument("--port", type=int, help="listen port (server.port)")
    parser.add_argument("--upstream", help="upstream model server URL (upstream.url)")
    return parser.parse_args(argv)


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, dict[str, Any]] = {}
    if args.host is not None:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    if args.upstream is not None:
        overrides.setdefault("upstream", {})["url"] = args.upstream
    return overrides


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    access = logging.getLogger("mmgate.access")
    access.propagate = False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(GatewaySettings, args.config, cli_overrides(args))
    except ConfigError as exc:
        print(f"mmgate gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level)
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
