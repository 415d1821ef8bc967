from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from gateway.config import FetchSettings
from gateway.fetch import MediaFetcher
from tests.gateway.media_stub import PUBLIC, FakeDNS
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread


@pytest.fixture
def stub() -> Iterator[tuple[StubUpstream, str]]:
    app = StubUpstream()
    with ServerThread(app) as server:
        yield app, server.url


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
