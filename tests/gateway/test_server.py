from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.gateway.stub_upstream import StubUpstream
from tests.servers import served_process

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def gateway_process(
    tmp_path: Path, upstream: str, drain_timeout_s: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"server:\n  drain_timeout_s: {drain_timeout_s}\n  access_log: false\n")
    with served_process("gateway", config, "--upstream", upstream, start_timeout_s=30) as served:
        yield served.process, served.url


def test_sigterm_drains_in_flight_streams_then_exits(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    app, upstream = stub
    with (
        gateway_process(tmp_path, upstream, drain_timeout_s=20) as (process, url),
        httpx.stream("GET", url + "/sse", timeout=20) as response,
    ):
        lines = response.iter_lines()
        assert next(lines) == 'data: {"n": 1}'
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/healthz", timeout=2)
        assert process.poll() is None  # still finishing the stream
        app.state.sse_release.set()
        assert [line for line in lines if line] == ['data: {"n": 2}', "data: [DONE]"]
        # uvicorn re-raises the signal once shut down, so the exit status says "terminated by SIGTERM".
        assert process.wait(timeout=15) in (0, -signal.SIGTERM)


def test_drain_timeout_bounds_the_wait(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    _, upstream = stub
    with (
        gateway_process(tmp_path, upstream, drain_timeout_s=1) as (process, url),
        httpx.stream("GET", url + "/sse", timeout=20) as response,
    ):
        assert next(response.iter_lines()) == 'data: {"n": 1}'
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        assert time.monotonic() - started < 5
