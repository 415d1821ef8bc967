"""Fixtures shared across the test packages: real engine and gateway servers on loopback, the stub LLM, and an
environment without MMGATE_* variables."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from engine_adapter.__main__ import ENGINE
from engine_adapter.app import EngineApp
from engine_adapter.config import EngineSettings
from engine_adapter.runtime import IterationHook
from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import GatewaySettings
from tests.engine_adapter.stub_llm import StubLLM
from tests.servers import ServerThread


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set, nested sections merged key by key."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


def engine_settings(**sections: Any) -> EngineSettings:
    """Test defaults: the tiny tower on the CPU, float32, seed 0; `sections` override per key."""
    base = {"model": {"preset": "tiny", "device": "cpu", "dtype": "float32"}, "server": {"log_level": "warning"}}
    return EngineSettings(**merge(base, sections))


EngineFactory = Callable[..., AbstractContextManager[tuple[EngineApp, str]]]


@pytest.fixture
def make_engine() -> EngineFactory:
    """`with make_engine(encoder={...}, on_iteration=hook) as (app, url):` serves a real engine on loopback."""

    @contextmanager
    def factory(*, on_iteration: IterationHook | None = None, **sections: Any) -> Iterator[tuple[EngineApp, str]]:
        settings = engine_settings(**sections)
        app = EngineApp(settings, on_iteration=on_iteration)
        with ServerThread(app, config=ENGINE.server_config(app, settings)) as server:
            yield app, server.url

    return factory


@pytest.fixture
def stub_llm() -> Iterator[tuple[StubLLM, str]]:
    stub = StubLLM()
    with ServerThread(stub) as server:
        yield stub, server.url
    stub.release()


GatewayFactory = Callable[..., AbstractContextManager[tuple[Gateway, str]]]


@contextmanager
def gateway_served(upstream_url: str, **sections: Any) -> Iterator[tuple[Gateway, str]]:
    """The real gateway app in uvicorn on loopback: (the app, its URL)."""
    # Charges are decoded pixels unless a test names a processor: the stub upstreams serve no known model.
    defaults = {"upstream": {"url": upstream_url}, "server": {"access_log": False}, "media": {"processor": None}}
    options = merge(defaults, sections)
    settings = GatewaySettings(**options)
    gateway = Gateway(settings)
    with ServerThread(gateway, config=GATEWAY.server_config(gateway, settings)) as server:
        yield gateway, server.url


@pytest.fixture
def make_gateway() -> GatewayFactory:
    """`with make_gateway(upstream_url, limits={...}) as (gateway, url):` runs the real gateway app."""
    return gateway_served


@pytest.fixture
def clean_mmgate_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MMGATE_* variable from the developer's shell leaks into a settings load."""
    for name in list(os.environ):
        if name.startswith("MMGATE_"):
            monkeypatch.delenv(name)
    return monkeypatch
