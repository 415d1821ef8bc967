"""The command line both processes start from: `python -m <module> --config FILE [flags]`.

Each process's `__main__` declares a `Process`: its settings class, the flags it takes besides `--config` (each
one sets a settings key, above the environment and the YAML file), the app it serves and the HTTP limits it serves
with. A configuration that cannot be used exits with status 2 and the message on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import uvicorn

from serving.app import ServedApp
from serving.http_limits import HttpLimits
from serving.server import DrainingServer, configure_logging, uvicorn_config
from serving.settings_loader import ConfigError, LayeredSettings, load_settings


class ServerSection(Protocol):
    """The `server` settings both processes have."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def drain_timeout_s(self) -> float: ...
    @property
    def log_level(self) -> str: ...


SettingsT = TypeVar("SettingsT", bound=LayeredSettings)


@dataclass(frozen=True)
class Flag:
    """`option` sets the settings key `key` (dotted)."""

    option: str
    key: str
    help: str
    type: Callable[[str], Any] = str


# Both processes listen where their `server` section says; these flags override it.
LISTEN_FLAGS = (Flag("--host", "server.host", "listen address"), Flag("--port", "server.port", "listen port", int))


@dataclass(frozen=True)
class Process(Generic[SettingsT]):
    module: str  # `python -m <module>`
    label: str  # names the process in error messages: "mmgate <label>: ..."
    description: str
    default_config: str  # the annotated example config, named in --help
    settings: type[SettingsT]
    server: Callable[[SettingsT], ServerSection]
    app: Callable[[SettingsT], ServedApp]
    flags: Sequence[Flag] = ()
    http_limits: Callable[[SettingsT], HttpLimits | None] = lambda settings: None
    access_logger: str | None = None

    def parse_args(self, argv: list[str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog=f"python -m {self.module}", description=self.description)
        parser.add_argument("--config", help=f"YAML config file (see {self.default_config})")
        for flag in self.flags:
            parser.add_argument(flag.option, type=flag.type, help=f"{flag.help} ({flag.key})")
        return parser.parse_args(argv)

    def overrides(self, args: argparse.Namespace) -> dict[str, Any]:
        """The flags given, as nested settings keys."""
        overrides: dict[str, Any] = {}
        for flag in self.flags:
            value = getattr(args, flag.option.removeprefix("--").replace("-", "_"))
            if value is None:
                continue
            *sections, name = flag.key.split(".")
            target = overrides
            for section in sections:
                target = target.setdefault(section, {})
            target[name] = value
        return overrides

    def server_config(self, app: ServedApp, settings: SettingsT) -> uvicorn.Config:
        server = self.server(settings)
        return uvicorn_config(
            app,
            host=server.host,
            port=server.port,
            drain_timeout_s=server.drain_timeout_s,
            log_level=server.log_level,
            http_limits=self.http_limits(settings),
        )

    def serve(self, settings: SettingsT) -> None:
        app = self.app(settings)
        DrainingServer(self.server_config(app, settings), app).run()

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parse_args(argv)
        try:
            settings = load_settings(self.settings, args.config, self.overrides(args))
            configure_logging(self.server(settings).log_level, access_logger=self.access_logger)
            self.serve(settings)
        except ConfigError as exc:
            print(f"mmgate {self.label}: {exc}", file=sys.stderr)
            return 2
        return 0
