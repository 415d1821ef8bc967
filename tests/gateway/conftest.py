from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.config import FetchSettings, GatewaySettings
from gateway.fetch import MediaFetcher
from gateway.server import uvicorn_config
from tests.engine_adapter.conftest import make_engine, stub_llm  # noqa: F401  (engine mode runs a real engine)
from tests.gateway.media_stub import PUBLIC, FakeDNS
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


@pytest.fixture
def stub() -> Iterator[tuple[StubUpstream, str]]:
    app = StubUpstream()
    with ServerThread(app) as server:
        yield app, server.url


GatewayFactory = Callable[..., AbstractContextManager[tuple[Gateway, str]]]


@pytest.fixture
def make_gateway() -> GatewayFactory:
    """`with make_gateway(upstream_url, limits={...}) as (gateway, url):` runs the real gateway app."""

    @contextmanager
    def factory(upstream_url: str, **sections: Any) -> Iterator[tuple[Gateway, str]]:
        options = _merge({"upstream": {"url": upstream_url}, "server": {"access_log": False}}, sections)
        settings = GatewaySettings(**options)
        gateway = Gateway(settings)
        with ServerThread(gateway, config=uvicorn_config(gateway, settings)) as server:
            yield gateway, server.url

    return factory


FetcherFactory = Callable[..., MediaFetcher]


@pytest.fixture
async def make_fetcher() -> AsyncIterator[FetcherFactory]:
    """`make_fetcher(dns=None, **media.fetch settings)`: fetchers that may reach the PUBLIC stub address."""
    fetchers: list[MediaFetcher] = []

    def factory(dns: FakeDNS | None = None, **settings: Any) -> MediaFetcher:
        options: dict[str, Any] = {
            "connect_timeout_s": 2.0,
            "read_timeout_s": 2.0,
            "allowed_networks": [f"{PUBLIC}/32"],
            **settings,
        }
        fetcher = MediaFetcher(FetchSettings(**options), resolver_inner=dns)
        fetchers.append(fetcher)
        return fetcher

    yield factory
    for fetcher in fetchers:
        await fetcher.aclose()
