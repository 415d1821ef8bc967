"""`make run` as a newcomer runs it (on free ports through the configs' environment variables): the gateway starts
once the engine answers, so its log says nothing about an engine it cannot reach, and the stack serves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.servers import ROOT, free_port

pytestmark = pytest.mark.slow


def test_make_run_starts_the_gateway_once_the_engine_answers(tmp_path: object) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    engine, gateway = free_port(), free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    env |= {
        "MMGATE_ENGINE_SERVER__PORT": str(engine),
        "MMGATE_SERVER__PORT": str(gateway),
        "MMGATE_ENGINE__URL": f"http://127.0.0.1:{engine}",
        "MMGATE_UPSTREAM__URL": f"http://127.0.0.1:{engine}",
    }
    # -o: the installed environment is taken as it is (the suite runs in it).
    process = subprocess.Popen(
        [make, "--no-print-directory", "-o", ".venv/.installed-run", "run"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        ready = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{gateway}/readyz", timeout=2)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{gateway}/v1/models", timeout=10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
        output = process.communicate(timeout=60)[0]
    assert ready is not None, output
    assert ready.status_code == 200, output
    assert models.status_code == 200, output
    assert "unreachable" not in output, output
    assert '"level":"warning"' not in output, output
