"""MediaFetcher downloads: caps as bytes arrive, timeouts, redirects, status handling, cancellation, and what it
sends and keeps, against a real stub server on 127.0.0.2 (permitted through `media.fetch.allowed_networks`)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from gateway.config import FetchSettings
from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.sources.fetch import MediaFetcher
from tests.gateway.conftest import (
    FetcherFactory,
)
from tests.gateway.media_stub import PUBLIC, FakeDNS, Hit, MediaStub, payload
from tests.observe import until

LOCATOR = "messages[0].content[2]"
MiB = 1 << 20


async def left_unfinished(server: MediaStub) -> Hit:
    """The server's only request, which the fetcher closed before its body was sent whole."""
    hit = server.only_hit()
    assert await asyncio.to_thread(hit.disconnected.wait, 2)
    assert not hit.finished
    return hit


class Counter:
    """The caller's per-request count: every `on_bytes` call, optionally raising past a cap."""

    def __init__(self, cap: int | None = None) -> None:
        self.calls: list[int] = []
        self.cap = cap
        self.error: RequestTooLarge | None = None
        self.first = asyncio.Event()

    def __call__(self, n: int) -> None:
        self.calls.append(n)
        self.first.set()
        if self.cap is not None and self.total > self.cap:
            self.error = RequestTooLarge(f"request over {self.cap}", reason="media_too_large")
            raise self.error

    @property
    def total(self) -> int:
        return sum(self.calls)


async def test_a_body_is_returned_whole_and_every_byte_is_counted(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    body = await make_fetcher().fetch(f"{url}/bytes?size={3 * MiB + 7}&chunk=50000", locator=LOCATOR, on_bytes=counter)
    assert body == payload(3 * MiB + 7)
    assert isinstance(body, bytes)
    assert counter.total == len(body)
    assert len(counter.calls) > 1  # counted as chunks arrived, not once at the end
    # The stub marks its answer finished once its last send returns, which can come after the fetch read it all.
    await until(lambda: server.only_hit().finished, what="the stub to have sent its whole answer")


async def test_the_configured_user_agent_is_sent_and_no_encoding_is_asked_for(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    await make_fetcher(user_agent="test-agent/9").fetch(f"{url}/bytes?size=1", locator=LOCATOR, on_bytes=Counter())
    headers = server.only_hit().headers
    assert headers["user-agent"] == "test-agent/9"
    assert headers["accept-encoding"] == "identity"


async def test_cookies_are_not_kept_between_fetches(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    # A host name: a cookie jar would not keep cookies from an IP address anyway.
    fetcher = make_fetcher(FakeDNS({"images.example.test": [PUBLIC]}))
    url = url.replace(PUBLIC, "images.example.test")
    await fetcher.fetch(f"{url}/set-cookie", locator=LOCATOR, on_bytes=Counter())
    await fetcher.fetch(f"{url}/bytes?size=1", locator=LOCATOR, on_bytes=Counter())
    assert "cookie" not in server.hits[1].headers


async def test_proxy_environment_variables_are_ignored(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = media_stub
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    body = await make_fetcher().fetch(f"{url}/bytes?size=9", locator=LOCATOR, on_bytes=Counter())
    assert body == payload(9)


async def test_content_length_over_max_bytes_is_refused_before_the_body_is_read(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    with pytest.raises(RequestTooLarge) as caught:
        await make_fetcher(max_bytes=MiB).fetch(f"{url}/declare?size={64 * MiB}", locator=LOCATOR, on_bytes=counter)
    assert caught.value.message == (
        f"{LOCATOR}: media URL declares Content-Length 67,108,864 bytes, over media.fetch.max_bytes=1,048,576"
    )
    assert caught.value.reason == "media_too_large"
    assert caught.value.status_code == 413
    assert counter.calls == []
    await left_unfinished(server)


async def test_a_body_without_content_length_is_stopped_as_soon_as_the_count_passes_max_bytes(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    size, cap = 16 * MiB, 256 * 1024
    with pytest.raises(RequestTooLarge) as caught:
        await make_fetcher(max_bytes=cap).fetch(
            f"{url}/bytes?size={size}&length=0&chunk=16384", locator=LOCATOR, on_bytes=counter
        )
    assert caught.value.message == (
        f"{LOCATOR}: media URL body reached {counter.total:,} bytes, over media.fetch.max_bytes=262,144"
    )
    assert caught.value.reason == "media_too_large"
    assert cap < counter.total <= cap + 65536  # one read's worth past the cap at most
    assert counter.total - counter.calls[-1] <= cap  # stopped at the first chunk that passed it
    hit = await left_unfinished(server)
    assert hit.sent < size


async def test_a_body_of_exactly_max_bytes_is_accepted(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    _, url = media_stub
    for length in ("0", "1"):
        body = await make_fetcher(max_bytes=100_000).fetch(
            f"{url}/bytes?size=100000&length={length}", locator=LOCATOR, on_bytes=Counter()
        )
        assert len(body) == 100_000


async def test_on_bytes_raising_stops_the_download_and_propagates_unchanged(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter(cap=200_000)
    with pytest.raises(RequestTooLarge) as caught:
        await make_fetcher().fetch(f"{url}/bytes?size={16 * MiB}&chunk=16384", locator=LOCATOR, on_bytes=counter)
    assert caught.value is counter.error
    assert counter.total - counter.calls[-1] <= 200_000  # no chunk read after the one that raised
    await left_unfinished(server)


async def test_a_stalled_body_times_out_naming_read_timeout_s(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    started = time.monotonic()
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(read_timeout_s=0.3).fetch(f"{url}/stall?after=1000", locator=LOCATOR, on_bytes=counter)
    # The silence timed out (the message names it, and 1000 bytes came of a body the stub holds for 10 s); the
    # timer never fires early, whatever the machine's load.
    assert time.monotonic() - started >= 0.3 * 0.9
    assert caught.value.reason == "media_fetch_failed"
    assert "timed out" in caught.value.message
    assert "media.fetch.read_timeout_s=0.3" in caught.value.message
    assert counter.total == 1000
    assert await asyncio.to_thread(server.only_hit().disconnected.wait, 2)


async def test_a_trickling_body_is_cut_off_by_total_timeout_s(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    started = time.monotonic()
    with pytest.raises(BadRequest) as caught:
        # 100 bytes every 50 ms: never quiet for read_timeout_s, done only after 20 s.
        await make_fetcher(read_timeout_s=1.0, total_timeout_s=0.5).fetch(
            f"{url}/bytes?size=40000&chunk=100&delay=0.05", locator=LOCATOR, on_bytes=counter
        )
    assert time.monotonic() - started >= 0.5 * 0.9  # cut off (the message and the count say so), never early
    assert caught.value.reason == "media_fetch_failed"
    assert "media.fetch.total_timeout_s=0.5" in caught.value.message
    assert 0 < counter.total < 40000
    assert await asyncio.to_thread(server.only_hit().disconnected.wait, 2)


async def test_slow_response_headers_time_out_naming_read_timeout_s(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(read_timeout_s=0.3).fetch(f"{url}/slow-headers?delay=5", locator=LOCATOR, on_bytes=Counter())
    assert caught.value.reason == "media_fetch_failed"
    assert "timed out" in caught.value.message
    assert "media.fetch.read_timeout_s=0.3" in caught.value.message
    assert await asyncio.to_thread(server.only_hit().disconnected.wait, 2)


async def test_a_slow_lookup_times_out_naming_connect_timeout_s(make_fetcher: FetcherFactory) -> None:
    dns = FakeDNS({"slow.example.test": [PUBLIC]}, delay_s=30)
    started = time.monotonic()
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(dns, connect_timeout_s=0.3).fetch(
            "http://slow.example.test/x.png", locator=LOCATOR, on_bytes=Counter()
        )
    assert 0.3 * 0.9 <= time.monotonic() - started < 10  # not the 30 s the lookup would take
    assert dns.lookups == ["slow.example.test"]
    assert caught.value.reason == "media_fetch_failed"
    assert "timed out connecting" in caught.value.message
    assert "media.fetch.connect_timeout_s=0.3" in caught.value.message


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A port on 127.0.0.2 whose accept queue is full, so a new connection's SYN goes unanswered."""
    listener = socket.socket()
    listener.bind((PUBLIC, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((PUBLIC, port))
            fillers.append(filler)
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect((PUBLIC, port))
        except TimeoutError:
            pass
        else:
            pytest.skip("connects to a full accept queue do not hang here")
        finally:
            probe.close()
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_an_unanswered_connect_times_out_naming_connect_timeout_s(
    make_fetcher: FetcherFactory, unanswered_port: int
) -> None:
    started = time.monotonic()
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(connect_timeout_s=0.3).fetch(
            f"http://{PUBLIC}:{unanswered_port}/x.png", locator=LOCATOR, on_bytes=Counter()
        )
    # The message names the timeout that fired; far below the kernel's SYN retries (about 2 min), never early.
    assert 0.3 * 0.9 <= time.monotonic() - started < 10
    assert "timed out connecting" in caught.value.message
    assert "media.fetch.connect_timeout_s=0.3" in caught.value.message


async def test_a_refused_connection_is_a_400(make_fetcher: FetcherFactory) -> None:
    with socket.socket() as sock:
        sock.bind((PUBLIC, 0))
        port = sock.getsockname()[1]
    with pytest.raises(BadRequest) as caught:
        await make_fetcher().fetch(f"http://{PUBLIC}:{port}/x.png", locator=LOCATOR, on_bytes=Counter())
    assert caught.value.reason == "media_fetch_failed"
    assert f"media URL http://{PUBLIC}:{port} could not be reached" in caught.value.message


async def test_an_unresolvable_host_is_a_400(make_fetcher: FetcherFactory) -> None:
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(FakeDNS({})).fetch("http://nowhere.example.test/x.png", locator=LOCATOR, on_bytes=Counter())
    assert caught.value.reason == "media_fetch_failed"
    assert "nowhere.example.test could not be resolved" in caught.value.message


@pytest.mark.parametrize("status", [404, 403, 500, 204, 304])
async def test_a_non_2xx_status_is_a_400_naming_it(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str], status: int
) -> None:
    _, url = media_stub
    if status == 204:
        # 2xx without a body is fine for the fetcher (an empty image fails in the decoder)
        assert await make_fetcher().fetch(f"{url}/status/204", locator=LOCATOR, on_bytes=Counter()) == b""
        return
    with pytest.raises(BadRequest) as caught:
        await make_fetcher().fetch(f"{url}/status/{status}", locator=LOCATOR, on_bytes=Counter())
    assert caught.value.message == f"{LOCATOR}: media URL {url} answered HTTP {status}"
    assert caught.value.reason == "media_fetch_failed"


async def test_an_encoded_body_is_refused(make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]) -> None:
    _, url = media_stub
    with pytest.raises(BadRequest) as caught:
        await make_fetcher().fetch(f"{url}/gzip", locator=LOCATOR, on_bytes=Counter())
    assert "Content-Encoding: gzip" in caught.value.message


def _redirect(url: str, to: str, status: int = 302) -> str:
    return f"{url}/redirect?status={status}&to={quote(to, safe='')}"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirects_are_followed_up_to_max_redirects(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str], status: int
) -> None:
    server, url = media_stub
    chain = f"{url}/bytes?size=77"
    for _ in range(3):
        chain = _redirect(url, chain, status)
    body = await make_fetcher(max_redirects=3).fetch(chain, locator=LOCATOR, on_bytes=Counter())
    assert body == payload(77)
    assert server.paths() == ["/redirect"] * 3 + ["/bytes"]


async def test_one_redirect_more_than_max_redirects_is_refused(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    chain = f"{url}/bytes?size=77"
    for _ in range(3):
        chain = _redirect(url, chain)
    with pytest.raises(BadRequest) as caught:
        await make_fetcher(max_redirects=2).fetch(chain, locator=LOCATOR, on_bytes=Counter())
    assert caught.value.message == f"{LOCATOR}: media URL redirected more than media.fetch.max_redirects=2 times"
    assert server.paths() == ["/redirect"] * 3


async def test_max_redirects_zero_refuses_any_redirect(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    _, url = media_stub
    with pytest.raises(BadRequest, match=r"media\.fetch\.max_redirects=0"):
        await make_fetcher(max_redirects=0).fetch(
            _redirect(url, f"{url}/bytes?size=1"), locator=LOCATOR, on_bytes=Counter()
        )


async def test_a_redirect_loop_ends_at_max_redirects(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    with pytest.raises(BadRequest, match=r"media\.fetch\.max_redirects=3"):
        await make_fetcher(max_redirects=3).fetch(f"{url}/loop", locator=LOCATOR, on_bytes=Counter())
    assert len(server.paths()) == 4


async def test_a_relative_location_resolves_against_the_current_url(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    body = await make_fetcher().fetch(_redirect(url, "/bytes?size=12#fragment"), locator=LOCATOR, on_bytes=Counter())
    assert body == payload(12)
    assert server.paths() == ["/redirect", "/bytes"]


async def test_a_redirect_without_location_is_a_400(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    _, url = media_stub
    with pytest.raises(BadRequest, match="answered 302 without a Location header"):
        await make_fetcher().fetch(f"{url}/no-location", locator=LOCATOR, on_bytes=Counter())


async def test_a_redirect_hop_counts_no_bytes(make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]) -> None:
    _, url = media_stub
    counter = Counter()
    await make_fetcher().fetch(_redirect(url, f"{url}/bytes?size=5"), locator=LOCATOR, on_bytes=counter)
    assert counter.total == 5


async def test_cancelling_a_download_closes_the_connection_at_once(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    counter = Counter()
    task = asyncio.ensure_future(make_fetcher().fetch(f"{url}/stall?after=1000", locator=LOCATOR, on_bytes=counter))
    await asyncio.wait_for(counter.first.wait(), 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    hit = server.only_hit()
    assert await asyncio.to_thread(hit.disconnected.wait, 2)


async def test_cancelling_while_waiting_for_headers_closes_the_connection(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    task = asyncio.ensure_future(
        make_fetcher().fetch(f"{url}/slow-headers?delay=5", locator=LOCATOR, on_bytes=Counter())
    )
    assert await asyncio.to_thread(server.hit_event.wait, 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(server.only_hit().disconnected.wait, 2)


async def test_a_successful_fetch_keeps_the_connection_for_the_next_one(
    make_fetcher: FetcherFactory, media_stub: tuple[MediaStub, str]
) -> None:
    server, url = media_stub
    fetcher = make_fetcher()
    for _ in range(3):
        await fetcher.fetch(f"{url}/bytes?size=10", locator=LOCATOR, on_bytes=Counter())
    assert len({hit.client for hit in server.hits}) == 1


async def test_aclose_before_any_fetch_and_twice_is_harmless() -> None:
    fetcher = MediaFetcher(FetchSettings())
    await fetcher.aclose()
    await fetcher.aclose()


async def test_an_invalid_url_is_a_400(make_fetcher: FetcherFactory) -> None:
    for url in ("http://", "http://example.test:99999/", "not a url", "http://[::1/"):
        with pytest.raises(BadRequest) as caught:
            await make_fetcher().fetch(url, locator=LOCATOR, on_bytes=Counter())
        assert caught.value.message.startswith(f"{LOCATOR}: media URL"), url
