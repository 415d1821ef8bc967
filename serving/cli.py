"""The command line both processes start from: `python -m <module> --config FILE [flags]`.

Each process's `__main__` declares a `Process`: its settings class, the flags it takes besides `--config` (each
one sets a settings key, above the environment and the YAML file), the app it serves and the HTTP limits it serves
with. Every process also takes `--log-level` (`server.log_level`), `--version`, and `--check-config`: load and
validate the configuration, print the effective value of every key with its source (default, yaml, env or cli)
and exit 0. A configuration that cannot be used exits with status 2 and the message on stderr; a process that
cannot start for another reason (a port in use, an app whose start-up failed) exits with status 3. Either says
why in one JSON log line unless `server.log_format` is `text` (`--check-config` prints the error as plain text).
"""

from __future__ import annotations

import argparse
import enum
import gc
import importlib.metadata
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import uvicorn
import yaml
from pydantic import BaseModel, ByteSize

from serving.allocator import MemoryTrimmer
from serving.app import ServedApp
from serving.credentials import HIDDEN, hide_url_password, is_credential
from serving.http_limits import HttpLimits
from serving.log_format import LogFormat, failure_line
from serving.server import DrainingServer, configure_logging, uvicorn_config
from serving.settings_loader import ConfigError, LayeredSettings, load_settings, raw_value, value_sources
from serving.settings_types import LOG_LEVELS, format_bytes
from serving.workers import STARTUP_FAILED, ListenError, Supervisor, bind_all


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
    @property
    def log_format(self) -> LogFormat: ...
    @property
    def malloc_trim_interval_s(self) -> float | None: ...


SettingsT = TypeVar("SettingsT", bound=LayeredSettings)

logger = logging.getLogger("mmgate")


@dataclass(frozen=True)
class Flag:
    """`option` sets the settings key `key` (dotted)."""

    option: str
    key: str
    help: str
    type: Callable[[str], Any] = str


# Both processes listen where their `server` section says; these flags override it.
LISTEN_FLAGS = (Flag("--host", "server.host", "listen address"), Flag("--port", "server.port", "listen port", int))

# Every process takes these besides its own flags.
COMMON_FLAGS = (Flag("--log-level", "server.log_level", f"log level: {', '.join(LOG_LEVELS)}", str.lower),)


def version() -> str:
    try:
        return importlib.metadata.version("mmgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def render_effective_config(rows: Iterable[tuple[str, Any, str]]) -> str:
    """YAML of every key with its source as a comment (`port: 8000  # default`); byte sizes in the form a config
    file takes (`64MiB`), credentials hidden."""
    lines: list[str] = []
    opened: list[str] = []
    for key, value, source in rows:
        *sections, name = key.split(".")
        common = 0
        while common < min(len(opened), len(sections)) and opened[common] == sections[common]:
            common += 1
        del opened[common:]
        for depth in range(common, len(sections)):
            lines.append(f"{'  ' * depth}{sections[depth]}:")
            opened.append(sections[depth])
        lines.append(f"{'  ' * len(sections)}{name}: {_scalar(name, value)}  # {source}")
    return "\n".join(lines) + "\n"


def _scalar(name: str, value: Any) -> str:
    if value is not None and is_credential(name):
        return HIDDEN
    if isinstance(value, ByteSize):
        return format_bytes(int(value)).replace(",", "")  # 64MiB, else the plain integer
    if isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, tuple):
        value = [item if isinstance(item, str | int | float | bool) or item is None else str(item) for item in value]
    elif isinstance(value, Mapping):  # a mapping of sections (e.g. per-tenant settings): one flow mapping
        value = {str(k): v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
    elif not (isinstance(value, str | int | float | bool) or value is None):
        value = str(value)
    if isinstance(value, str):
        value = hide_url_password(value)
    text: str = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


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
    # Processes serving the one port (`serving.workers`); 1 serves in this process.
    workers: Callable[[SettingsT], int] = lambda settings: 1
    # More ports the same app is served on, on the same host (the app tells them apart by `scope["server"]`).
    extra_ports: Callable[[SettingsT], Sequence[int]] = lambda settings: ()
    # What uvicorn serves: the app, or the app inside middleware (the engine's access log, `serving.access_log`).
    wrap: Callable[[ServedApp, SettingsT], object] = lambda app, settings: app
    # Checks a configuration must pass before anything is bound (e.g. that its bounds fit the memory limit): a
    # `ConfigError` stops the start with status 2.
    preflight: Callable[[SettingsT], None] = lambda settings: None

    def parse_args(self, argv: list[str] | None = None, *, prog: str | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog=prog or f"python -m {self.module}", description=self.description)
        parser.add_argument("--config", help=f"YAML config file (see {self.default_config})")
        parser.add_argument(
            "--check-config",
            action="store_true",
            help="load and validate the configuration, print every key's effective value and its source "
            "(default, yaml, env, cli) and exit: 0 when valid, 2 (with the error) when not",
        )
        parser.add_argument("--version", action="version", version=f"mmgate {self.label} {version()}")
        for flag in self.flags:
            parser.add_argument(flag.option, type=flag.type, help=f"{flag.help} ({flag.key})")
        for flag in COMMON_FLAGS:
            parser.add_argument(flag.option, type=flag.type, choices=LOG_LEVELS, help=f"{flag.help} ({flag.key})")
        return parser.parse_args(argv)

    def overrides(self, args: argparse.Namespace) -> dict[str, Any]:
        """The flags given, as nested settings keys."""
        overrides: dict[str, Any] = {}
        for flag in (*self.flags, *COMMON_FLAGS):
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
            self.wrap(app, settings),
            host=server.host,
            port=server.port,
            drain_timeout_s=server.drain_timeout_s,
            log_level=server.log_level,
            http_limits=self.http_limits(settings),
        )

    def serve(self, settings: SettingsT) -> int:
        """Serve until stopped; the exit status (`STARTUP_FAILED` when the app's start-up failed)."""
        workers = self.workers(settings)
        server = self.server(settings)
        # Bound before the app is built, so that a port in use fails the start the same way with any --workers.
        try:
            sockets = bind_all(server.host, [server.port, *self.extra_ports(settings)])
        except ListenError as exc:
            self.report_failure(str(exc), server.log_format)
            return STARTUP_FAILED
        try:
            if workers == 1:
                return self._serve_one(settings, sockets)
            supervisor = Supervisor(
                workers,
                lambda bound: self._serve_one(settings, bound),
                drain_timeout_s=server.drain_timeout_s,
                label=self.label,
            )
            return supervisor.serve(sockets)
        finally:
            for sock in sockets:
                sock.close()

    def _serve_one(self, settings: SettingsT, sockets: list[socket.socket]) -> int:
        """Serve in this process (one of the workers, or the only one)."""
        interval = self.server(settings).malloc_trim_interval_s
        trimmer = MemoryTrimmer(interval) if interval is not None else None
        if trimmer is not None and not trimmer.start():
            logger.info(
                "%s: the C library cannot trim its heap: server.malloc_trim_interval_s has no effect", self.label
            )
        try:
            app = self.app(settings)
            # The modules and the app live as long as the process: out of the collector's sight, a full collection
            # no longer walks their objects, which otherwise costs every request a share of it.
            gc.collect()
            gc.freeze()
            server = DrainingServer(self.server_config(app, settings), app)
            try:
                server.run(sockets=sockets)
            except KeyboardInterrupt:
                # uvicorn re-raises a SIGINT it drained for once it has shut down: an exit, not an error.
                return 128 + signal.SIGINT
            except SystemExit:
                # uvicorn exits this way when the app's start-up failed, which the app has logged.
                if server.started:
                    raise
                return STARTUP_FAILED
            return 0 if server.started else STARTUP_FAILED
        finally:
            if trimmer is not None:
                trimmer.stop()

    def main(self, argv: list[str] | None = None, *, prog: str | None = None) -> int:
        """`prog`: how --help and usage errors name the command (default `python -m <module>`)."""
        args = self.parse_args(argv, prog=prog)
        overrides = self.overrides(args)
        if args.check_config:
            try:
                sys.stdout.write(render_effective_config(value_sources(self.settings, args.config, overrides)))
            except ConfigError as exc:
                print(f"mmgate {self.label}: {exc}", file=sys.stderr)
                return 2
            return 0
        try:
            settings = load_settings(self.settings, args.config, overrides)
        except ConfigError as exc:
            # The configuration's own log format, where the file or the environment names one that is known.
            wanted = raw_value(self.settings, args.config, overrides, ("server", "log_format"))
            self.report_failure(str(exc), LogFormat.TEXT if wanted == LogFormat.TEXT.value else LogFormat.JSON)
            return 2
        server = self.server(settings)
        configure_logging(server.log_level, log_format=server.log_format, access_logger=self.access_logger)
        try:
            self.preflight(settings)
            return self.serve(settings)
        except ConfigError as exc:  # the app refused a setting as it was built (e.g. a checkpoint that does not load)
            self.report_failure(str(exc), server.log_format)
            return 2

    def report_failure(self, message: str, log_format: LogFormat) -> None:
        """Why the process does not start, as its last line on stderr: `mmgate <label>: <message>`."""
        print(failure_line(f"mmgate {self.label}: {message}", log_format), file=sys.stderr)
