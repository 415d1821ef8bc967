"""A media server on 127.0.0.2, the address the fetch tests permit through `media.fetch.allowed_networks`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.media_stub import PUBLIC, MediaStub
from tests.servers import ServerThread


@pytest.fixture(scope="module")
def media_server() -> Iterator[tuple[MediaStub, str]]:
    stub = MediaStub()
    with ServerThread(stub, bind=(PUBLIC, 0)) as running:
        yield stub, running.url


@pytest.fixture
def media_stub(media_server: tuple[MediaStub, str]) -> tuple[MediaStub, str]:
    """The module's media server with what the previous test did to it forgotten."""
    media_server[0].reset()
    return media_server
