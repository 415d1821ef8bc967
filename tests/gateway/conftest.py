from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gateway.media.image.loader
import gateway.media.sources.inline
from gateway.config import FetchSettings
from gateway.media.parts import MediaRef
from gateway.media.sources.fetch import MediaFetcher
from tests.gateway.media_stub import PUBLIC, FakeDNS
from tests.gateway.stub_upstream import StubUpstream
from tests.redis_server import RedisServer
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


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, which the test may stop and restart."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def full_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the base64 payloads of inline items decoded whole (`inline.decode_item`, which images take)."""
    calls: list[int] = []
    original = gateway.media.sources.inline.decode_item

    def counting(ref: MediaRef) -> bytes:
        calls.append(len(gateway.media.sources.inline.inline_payload(ref)))
        return original(ref)

    monkeypatch.setattr(gateway.media.sources.inline, "decode_item", counting)
    monkeypatch.setattr(gateway.media.image.loader, "decode_item", counting)
    return calls
