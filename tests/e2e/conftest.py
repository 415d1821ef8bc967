"""End-to-end tests against a real vLLM (`make e2e`, docs/e2e.md): collected only when E2E_VLLM=1 is set.

One vLLM (from .venv-vllm, serving the tiny Qwen2-VL checkpoint tests/e2e/make_checkpoint.py writes) for the whole
session, and the gateway in proxy mode in front of it, both on free loopback ports; vLLM's caches, temporary files
and log are in the session's temporary directory. A module may start another vLLM with other item limits or
another checkpoint (`start_vllm`; the Qwen3-VL one is `qwen3_checkpoint`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import GatewaySettings
from tests.e2e.support import MM_LIMITS, MODEL, QWEN_VIDEO_SAMPLING, VLLMServer, vllm_server
from tests.servers import ROOT, ServerThread

# Not MMGATE_*: the gateway's settings read every MMGATE_ variable and refuse unknown ones.
ENABLED = os.environ.get("E2E_VLLM") == "1"
collect_ignore_glob: list[str] = [] if ENABLED else ["test_*.py"]

# Absolute, since vLLM runs in its own directory; not resolved, since the venv's python is a link out of the venv.
VLLM_PYTHON = Path(os.environ.get("E2E_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).absolute()
CHECKPOINT = Path(os.environ.get("E2E_VLLM_CHECKPOINT", ROOT / ".venv-vllm" / "checkpoint")).absolute()
QWEN3_CHECKPOINT = Path(
    os.environ.get("E2E_VLLM_QWEN3_CHECKPOINT", ROOT / ".venv-vllm" / "checkpoint-qwen3-vl")
).absolute()
# A backstop: on a shared two-core machine vLLM was up in 36-45 s.
START_TIMEOUT_S = float(os.environ.get("E2E_VLLM_START_TIMEOUT_S", "300"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e_last: runs after every other end-to-end test (it bloats vLLM for good)")
    if ENABLED:
        # A SIGTERM (`timeout` in CI) ends the run as Ctrl-C does, so the fixtures stop vLLM and the gateway.
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked e2e_last go to the end, so what they leave in vLLM's memory cannot touch another test."""
    here = Path(__file__).parent
    last = [item for item in items if item.path.is_relative_to(here) and item.get_closest_marker("e2e_last")]
    if last:
        items[:] = [item for item in items if item not in last] + last


VLLMFactory = Callable[..., AbstractContextManager[VLLMServer]]


def complete_checkpoint(path: Path, family: str) -> Path:
    if not (path / ".complete").exists():
        pytest.fail(f"no {family} checkpoint in {path}: `make e2e` writes it with tests/e2e/make_checkpoint.py")
    return path


@pytest.fixture(scope="session")
def vllm_checkpoint() -> Path:
    """The tiny Qwen2-VL checkpoint vLLM serves (the engine-mode tests' engine loads its vision tower from it)."""
    return complete_checkpoint(CHECKPOINT, "Qwen2-VL")


@pytest.fixture(scope="session")
def qwen3_checkpoint() -> Path:
    """The tiny Qwen3-VL checkpoint (DeepStack mergers included)."""
    return complete_checkpoint(QWEN3_CHECKPOINT, "Qwen3-VL")


@pytest.fixture(scope="session")
def start_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> VLLMFactory:
    """`with start_vllm(name, mm_limits=..., checkpoint=..., served_name=...) as server:` runs a vLLM serving a
    checkpoint (the Qwen2-VL one unless told) (support.vllm_server) with its home in a fresh temporary directory
    named `name`; prints its start time and log path, and its log's last lines when a test of the session failed."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} not found: `make e2e` creates .venv-vllm")

    @contextmanager
    def factory(
        name: str,
        mm_limits: Mapping[str, int] = MM_LIMITS,
        checkpoint: Path = vllm_checkpoint,
        served_name: str = MODEL,
    ) -> Iterator[VLLMServer]:
        home = tmp_path_factory.mktemp(name)
        with vllm_server(str(VLLM_PYTHON), str(checkpoint), home, START_TIMEOUT_S, mm_limits, served_name) as server:
            rss = server.rss_bytes() / (1 << 20)
            print(f"\n{name}: vLLM up in {server.started_in_s:.1f} s at {server.url}, RSS {rss:,.0f} MiB")
            print(f"{name}: vLLM log: {server.log}")
            yield server
            if request.session.testsfailed:
                print(f"\n--- the last lines of vLLM's log ({server.log}) ---\n{server.log_tail()}")

    return factory


@pytest.fixture(scope="session")
def vllm(start_vllm: VLLMFactory) -> Iterator[VLLMServer]:
    """The session's vLLM: its own vision tower, up to IMAGE_LIMIT images and VIDEO_LIMIT videos a prompt, and image
    embeddings taken."""
    with start_vllm("vllm") as server:
        yield server


# The media URLs the tests serve are on loopback, which the fetcher refuses unless allowed.
LOOPBACK_FETCH: dict[str, Any] = {"allowed_networks": ["127.0.0.0/8"]}


@contextmanager
def proxy_gateway(upstream: str, media: Mapping[str, Any]) -> Iterator[str]:
    """A gateway in proxy mode in front of `upstream` with `media` as its media settings, its defaults'
    per-request cap (512 MiB) and no per-modality item cap of its own (max_media_items_per_request: 256)."""
    options: dict[str, Any] = {
        "upstream": {"url": upstream},
        "server": {"access_log": False, "log_level": "warning"},
        "media": dict(media),
        "limits": {"max_items": {"image": None}},
    }
    settings = GatewaySettings(**options)
    gateway = Gateway(settings)
    with ServerThread(gateway, config=GATEWAY.server_config(gateway, settings)) as server:
        yield server.url


@pytest.fixture(scope="session")
def gateway_url(vllm: VLLMServer) -> Iterator[str]:
    """The gateway in proxy mode in front of vLLM, charging Qwen2-VL's processed tensors, sampling videos as vLLM
    0.32 does for Qwen models (`QWEN_VIDEO_SAMPLING`), media URLs on loopback allowed."""
    media = {"processor": "qwen2_vl", "video": QWEN_VIDEO_SAMPLING, "fetch": LOOPBACK_FETCH}
    with proxy_gateway(vllm.url, media) as url:
        yield url
