"""Real uvicorn servers on loopback ephemeral ports, each in a thread with its own event loop."""

from __future__ import annotations

import contextlib
import os
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


_PORT_ATTEMPTS = 3


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on 127.0.0.1:`port` (a gateway's workers share their
    supervisor's); True where /proc cannot tell."""
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
        fds = Path(f"/proc/{pid}/fd")
        held = {os.readlink(fd) for fd in fds.iterdir()}
    except OSError:
        return not Path("/proc/net/tcp").exists()
    local = f"0100007F:{port:04X}"
    inodes = {fields[9] for fields in (line.split() for line in table) if fields[1] == local and fields[3] == "0A"}
    return any(f"socket:[{inode}]" in held for inode in inodes)


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
    """`python -m <module> --config <config> --port <free port> [args]` until it listens on that port and
    `/healthz` answers; stopped with a kill on exit if still running. Its output goes to `log` when given (a long
    run would fill a pipe). `command` replaces `python -m <module>` (e.g. the `mmgate gateway` console command).

    The free port can be taken by another process (another test run) before the server binds it: the server then
    exits, and a new port is tried; the port's listening socket must be the server's own, so a server of another
    run answering there is never taken for it."""
    for attempt in range(_PORT_ATTEMPTS):
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
                        if _listens(process.pid, port) and httpx.get(url + "/healthz", timeout=1).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if process.poll() is not None or time.monotonic() > deadline:
                        said = log.read_text() if log is not None else process.communicate()[0]
                        if process.returncode is not None and "in use" in said and attempt + 1 < _PORT_ATTEMPTS:
                            break
                        raise RuntimeError(f"python -m {module} did not start: {said}")
                    time.sleep(0.1)
                if process.poll() is None:
                    yield ServedProcess(process, url)
                    return
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()


class ServedProcess:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url
