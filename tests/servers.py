"""Real uvicorn servers on loopback ephemeral ports, each in a thread with its own event loop."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends.

    `bind=(host, port)` picks another loopback address or a fixed port (default: 127.0.0.1, any free port).
    """

    def __init__(
        self,
        app: Any,
        config: uvicorn.Config | None = None,
        *,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        **config_kwargs: Any,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(bind)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        if config is None:
            options: dict[str, Any] = {"lifespan": "on", "log_level": "warning", "access_log": False}
            options.update(config_kwargs)
            config = uvicorn.Config(app, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def served_process(
    module: str,
    config: Path,
    *args: str,
    start_timeout_s: float = 60.0,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
) -> Iterator[ServedProcess]:
    """`python -m <module> --config <config> --port <free port> [args]` until `/healthz` answers; stopped with
    a kill on exit if still running. Its output goes to `log` when given (a long run would fill a pipe).
    `command` replaces `python -m <module>` (e.g. the `mmgate gateway` console command)."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(log.open("w")) if log is not None else subprocess.PIPE
        process = subprocess.Popen(
            [*(command or [sys.executable, "-m", module]), "--config", str(config), "--port", str(port), *args],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    said = log.read_text() if log is not None else process.communicate()[0]
                    raise RuntimeError(f"python -m {module} did not start: {said}")
                time.sleep(0.1)
            yield ServedProcess(process, url)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


class ServedProcess:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url
