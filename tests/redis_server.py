"""A throwaway `redis-server` for the tests of the shared media budget (Debian package redis-server)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.servers import free_port


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (Debian package redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; .ci/run installs it when it is missing")
        pytest.skip(message)
    return binary


class RedisServer:
    """A throwaway `redis-server` on 127.0.0.1 with no persistence; `stop()` and `start()` keep its port.

    With `password`, clients must AUTH; with `unix_socket`, it also listens on `socket_path`; with `tls`, it also
    listens for TLS on `tls_port` with a self-signed certificate for 127.0.0.1 (`ca_path`, made with openssl)."""

    def __init__(
        self, directory: Path, *, password: str | None = None, unix_socket: bool = False, tls: bool = False
    ) -> None:
        self.binary = redis_server_binary()
        self.directory = directory
        self.port = free_port()
        self.password = password
        self.socket_path = directory / "redis.sock" if unix_socket else None
        self.tls_port = free_port() if tls else None
        self.ca_path = directory / "cert.pem"
        if tls:
            openssl = shutil.which("openssl")
            if openssl is None:
                pytest.skip("openssl is not installed: no certificate for the TLS server")
            subprocess.run(
                [
                    *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
                    *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "key.pem")),
                    *("-out", str(self.ca_path)),
                ],
                check=True,
                capture_output=True,
            )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, password=self.password, decode_responses=True, socket_timeout=2
        )

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *(["--requirepass", self.password] if self.password else []),
                *(["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"] if self.socket_path else []),
                *(self._tls_arguments() if self.tls_port else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        with self.client() as client:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.02)

    def _tls_arguments(self) -> list[str]:
        return [
            "--tls-port",
            str(self.tls_port),
            "--tls-cert-file",
            str(self.ca_path),
            "--tls-key-file",
            str(self.directory / "key.pem"),
            "--tls-auth-clients",
            "no",
        ]

    def kill(self) -> None:
        """SIGKILL: the state goes with it, as in a crash of a server without persistence."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
