"""N worker processes serving one port: `python -m gateway --workers N`.

The parent binds the listening socket, makes a directory for prometheus-client's multiprocess mode (every worker
writes its metric values there; whichever worker answers a scrape adds them all up) and forks the workers, each of
which builds its own app and serves the shared socket under its own event loop. The parent serves nothing:

- SIGTERM or SIGINT to the parent sends SIGTERM to every worker, so each one drains as a single process does (its
  `/readyz` turns 503, it stops accepting, in-flight responses finish within the drain timeout); the parent closes
  its copies of the listening sockets at once, so that once the workers have closed theirs the kernel refuses new
  connections instead of queueing them for nobody. Workers still running past the drain timeout plus a margin are
  killed. The parent exits when the last worker has, and removes
  the metrics directory.
- A worker that dies on its own (a crash, `kill -9`) is replaced, and its live gauges leave the sums. A worker that
  fails its start-up stops them all: the configuration or a dependency (the shared budget's Redis) is at fault,
  and restarting would only repeat the failure.
- Workers run in a process group of their own, so a terminal's Ctrl-C reaches them only through the parent (once,
  as SIGTERM), and on Linux each is sent SIGTERM when the parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from types import FrameType

from prometheus_client import values
from prometheus_client.multiprocess import mark_process_dead

logger = logging.getLogger("mmgate.workers")

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# uvicorn's exit status for an app whose start-up failed; a worker exits with it when its server never started.
STARTUP_FAILED = 3
# Past the drain timeout, how long the parent still waits for its workers before killing them.
KILL_MARGIN_S = 5.0
_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}

# Serves the bound sockets until told to stop; returns the worker's exit status.
RunWorker = Callable[[list[socket.socket]], int]


class ListenError(Exception):
    """A port the process is configured to serve cannot be listened on."""


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
    sock.set_inheritable(True)
    return sock


def bind_all(host: str, ports: list[int]) -> list[socket.socket]:
    """Every port bound, or none (`ListenError` naming the first that failed)."""
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sockets.append(bind(host, port))
    except ListenError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Supervisor:
    def __init__(self, workers: int, run_worker: RunWorker, *, drain_timeout_s: float, label: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.run_worker = run_worker
        self.drain_timeout_s = drain_timeout_s
        self.label = label
        self.children: dict[int, float] = {}  # pid -> start time (monotonic)
        self.stopping_since: float | None = None
        self.status = 0
        self.sockets: list[socket.socket] = []
        self._parent = os.getpid()

    def serve(self, sockets: list[socket.socket]) -> int:
        """Serve `sockets` (the first is the main port) until stopped; the parent's copies are closed on return."""
        self.sockets = sockets
        metrics_dir = tempfile.mkdtemp(prefix="mmgate-metrics-")
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        try:
            host, port = sockets[0].getsockname()[:2]
            logger.info("%s: %d worker processes on %s:%d", self.label, self.workers, host, port)
            for _ in range(self.workers):
                self._spawn()
            self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for pid in list(self.children):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            self._close_sockets()
            os.environ.pop(MULTIPROC_DIR_ENV, None)
            shutil.rmtree(metrics_dir, ignore_errors=True)
        return self.status

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping_since is None:
            logger.info("%s: %s, draining %d workers", self.label, signal.Signals(sig).name, len(self.children))
            self.stopping_since = time.monotonic()
            # No worker is started from now on; the listener goes away when the last worker closes its copy.
            self._close_sockets()
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            sock.close()

    def _spawn(self) -> None:
        # Signals wait until the worker has put back the default handlers: the parent's would forward them.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the worker process; its status is what the tests see
            status = 1
            try:
                status = self._worker()
            except BaseException:
                logger.exception("%s worker %d failed", self.label, os.getpid())
            finally:
                logging.shutdown()
                os._exit(status)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        self.children[pid] = time.monotonic()

    def _worker(self) -> int:
        os.setpgid(0, 0)
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self._parent:
            return 0  # the parent died before the death signal was armed
        # Metrics created from now on write to the shared directory (the parent imported prometheus-client before
        # the directory existed, which fixed the value class to in-process values).
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        return self.run_worker(self.sockets)

    def _supervise(self) -> None:
        while self.children:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if self.stopping_since is not None and (
                    time.monotonic() - self.stopping_since > self.drain_timeout_s + KILL_MARGIN_S
                ):
                    logger.warning("%s: workers still running past the drain timeout: killed", self.label)
                    for child in self.children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child, signal.SIGKILL)
                    self.status = self.status or 1
                    self.stopping_since = time.monotonic()
                time.sleep(0.05)
                continue
            self.children.pop(pid, None)
            with contextlib.suppress(OSError):
                mark_process_dead(pid)  # type: ignore[no-untyped-call]
            code = os.waitstatus_to_exitcode(wait_status)
            if self.stopping_since is not None:
                if code not in (0, -signal.SIGTERM):
                    self.status = self.status or 1
                continue
            if code == STARTUP_FAILED:
                logger.error("%s worker %d failed its start-up: stopping every worker", self.label, pid)
                self.status = STARTUP_FAILED
                self._on_signal(signal.SIGTERM, None)
                continue
            logger.warning("%s worker %d exited (status %d): starting another", self.label, pid, code)
            time.sleep(0.1)
            self._spawn()
