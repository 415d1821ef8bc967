"""serving/command.py: the `mmgate` console command the package installs, run as a user runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread, served_process

ROOT = Path(__file__).resolve().parents[2]
# pip puts the console script beside the interpreter it installs for.
MMGATE = shutil.which("mmgate", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def mmgate() -> str:
    assert MMGATE is not None, "the mmgate console command is not installed in this venv (pip install -e .)"
    return MMGATE


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert MMGATE is not None
    return subprocess.run([MMGATE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def stub() -> Iterator[str]:
    with ServerThread(StubUpstream()) as server:
        yield server.url


def test_without_a_command_it_lists_both_and_fails(mmgate: str) -> None:
    done = run()
    assert done.returncode == 2
    assert "gateway" in done.stdout
    assert "engine" in done.stdout


def test_an_unknown_command_is_a_usage_error_naming_the_choices(mmgate: str) -> None:
    done = run("gatway")
    assert done.returncode == 2
    assert "unknown command 'gatway'; choose one of gateway, engine" in done.stderr


@pytest.mark.parametrize(("command", "port"), [("gateway", "8000"), ("engine", "8100")])
def test_each_command_is_its_process_under_its_own_name(mmgate: str, command: str, port: str) -> None:
    helped = run(command, "--help")
    assert helped.returncode == 0
    assert helped.stdout.startswith(f"usage: mmgate {command} ")
    checked = run(command, "--check-config")
    assert checked.returncode == 0, checked.stderr
    assert f"port: {port}  # default" in checked.stdout


@pytest.mark.slow
def test_mmgate_gateway_serves(mmgate: str, stub: str, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  drain_timeout_s: 1\n")
    with served_process("gateway", config, "--upstream", stub, command=[mmgate, "gateway"]) as served:
        response = httpx.post(served.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
    assert response.status_code == 200


def test_the_engine_without_torch_says_what_to_install() -> None:
    # A fresh interpreter in which `import torch` fails, as it does where only the gateway was installed.
    code = "import sys; sys.modules['torch'] = None; from serving.command import main; sys.exit(main(['engine']))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stderr == "mmgate engine: needs torch, which is not installed: pip install 'mmgate[engine]'\n"
