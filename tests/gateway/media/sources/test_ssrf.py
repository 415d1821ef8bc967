"""The SSRF guard: the address policy, IP-literal parsing, the domain allowlist, the guarded resolver, and every
vector end to end through `MediaFetcher` against real servers on loopback.

127.0.0.1 plays the internal network (a stub listens there, and must never see a request) and 127.0.0.2 plays a
public server, permitted through `media.fetch.allowed_networks=["127.0.0.2/32"]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from ipaddress import ip_address, ip_network

import pytest
from yarl import URL

from gateway.errors import BadRequest
from gateway.media.sources.fetch import MediaFetcher
from gateway.media.sources.ssrf import (
    AddressBlocked,
    GuardedResolver,
    address_refusal,
    is_domain_allowed,
    parse_ip_literal,
)
from tests.gateway.conftest import (
    FetcherFactory,
)
from tests.gateway.media_stub import PUBLIC, FakeDNS, MediaStub, payload
from tests.servers import ServerThread

BLOCKED = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),
    ("169.254.0.1", "link-local"),
    ("100.64.0.1", "CGNAT"),
    ("100.127.255.254", "CGNAT"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("255.255.255.255", "reserved"),
    ("240.0.0.1", "reserved"),
    ("192.0.0.8", "IETF"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("192.88.99.1", "6to4 relay"),
    ("::1", "loopback"),
    ("::", "unspecified"),
    ("fe80::1", "link-local"),
    ("fc00::1", "unique local"),
    ("fd12:3456::1", "unique local"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("ff0e::1", "multicast"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("2001::1", "Teredo"),
    ("100::1", "discard"),
    ("::ffff:127.0.0.1", "loopback (IPv4-mapped 127.0.0.1)"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "link-local"),
    ("::127.0.0.1", "IPv4-compatible"),
    ("::8.8.8.8", "IPv4-compatible"),
    ("64:ff9b::127.0.0.1", "loopback (NAT64 127.0.0.1)"),
    ("64:ff9b::10.0.0.1", "private"),
    ("64:ff9b:1::1", "NAT64"),
    ("2002:7f00:1::1", "6to4"),
    ("2002:a00:1::1", "6to4"),
    ("2002:a9fe:a9fe::1", "6to4"),
    ("4000::1", "reserved"),
    ("5f00::1", "reserved"),
]

ALLOWED = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "100.63.255.255",
    "100.128.0.0",
    "172.15.255.255",
    "172.32.0.0",
    "192.0.1.1",
    "2606:4700:4700::1111",
    "2a00:1450:4001::200e",
    "::ffff:8.8.8.8",
    "64:ff9b::8.8.8.8",
    "2002:808:808::1",
]


@pytest.mark.parametrize(("address", "why"), BLOCKED)
def test_non_global_addresses_are_refused_with_their_rule_named(address: str, why: str) -> None:
    ip = ip_address(address)
    refusal = address_refusal(ip, allow_private=False, allowed_networks=())
    assert refusal is not None
    assert why in refusal


@pytest.mark.parametrize("address", ALLOWED)
def test_global_unicast_addresses_pass(address: str) -> None:
    assert address_refusal(ip_address(address), allow_private=False, allowed_networks=()) is None


@pytest.mark.parametrize(("address", "why"), BLOCKED)
def test_allow_private_networks_lets_everything_through(address: str, why: str) -> None:
    assert address_refusal(ip_address(address), allow_private=True, allowed_networks=()) is None


def test_allowed_networks_admit_exactly_their_addresses() -> None:
    networks = [ip_network("10.20.0.0/16"), ip_network("fd00:1::/32")]
    allowed = {"10.20.0.1", "10.20.255.255", "fd00:1::5", "::ffff:10.20.3.4", "64:ff9b::10.20.3.4"}
    refused = {"10.21.0.1", "10.19.255.255", "127.0.0.1", "fd00:2::5", "169.254.169.254", "::ffff:10.21.0.1"}
    for address in allowed:
        assert address_refusal(ip_address(address), allow_private=False, allowed_networks=networks) is None, address
    for address in refused:
        assert address_refusal(ip_address(address), allow_private=False, allowed_networks=networks) is not None, address


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("127.0.1", "127.0.0.1"),
        ("0x7f.0.0.1", "127.0.0.1"),
        ("0X7F.0.0.1", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("017700000001", "127.0.0.1"),
        ("127.0.0.1.", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("0", "0.0.0.0"),
        ("0x", "0.0.0.0"),
        ("10.0x10.0300.1", "10.16.192.1"),
        ("3232235777", "192.168.1.1"),
        ("::ffff:7f00:1", "::ffff:7f00:1"),
        ("0:0:0:0:0:ffff:127.0.0.1", "::ffff:7f00:1"),
        ("::1", "::1"),
    ],
)
def test_ip_literals_in_every_spelling_parse_to_one_address(host: str, expected: str) -> None:
    assert parse_ip_literal(host) == ip_address(expected)


@pytest.mark.parametrize("host", ["1.2.3.4.5", "256.1.1.1", "1.2.3.256", "1.2.65536", "08.1", "0x1g.1", "4294967296"])
def test_numeric_hosts_that_are_not_ipv4_are_errors_not_host_names(host: str) -> None:
    with pytest.raises(ValueError, match="not an IPv4 address"):
        parse_ip_literal(host)


@pytest.mark.parametrize("host", ["example.com", "images.example.test", "1e1", "127.0.0.1.nip.io", "0x7f.example"])
def test_host_names_are_not_ip_literals(host: str) -> None:
    assert parse_ip_literal(host) is None


def test_domain_allowlist_admits_subdomains_not_lookalikes() -> None:
    allowed = ("example.com", ".Images.Example.ORG.", "bücher.example")
    for host in (
        "example.com",
        "img.example.com",
        "a.b.example.com",
        "example.com.",
        "images.example.org",
        "cdn.images.example.org",
        "xn--bcher-kva.example",
    ):
        assert is_domain_allowed(host, allowed), host
    for host in (
        "badexample.com",
        "example.com.evil.test",
        "example.co",
        "com",
        "example.org",
        "evilimages.example.org",
        "127.0.0.1",
    ):
        assert not is_domain_allowed(host, allowed), host
    assert is_domain_allowed("anything.test", ())


async def test_guarded_resolver_returns_only_checked_canonical_addresses() -> None:
    dns = FakeDNS({"img.test": ["8.8.8.8", "2606:4700:4700:0:0:0:0:1111"]})
    resolver = GuardedResolver(allow_private=False, allowed_networks=(), inner=dns)
    answers = await resolver.resolve("img.test", 443)
    assert [answer["host"] for answer in answers] == ["8.8.8.8", "2606:4700:4700::1111"]
    assert {answer["port"] for answer in answers} == {443}
    assert dns.lookups == ["img.test"]


@pytest.mark.parametrize(
    "answers", [["127.0.0.1"], ["8.8.8.8", "10.0.0.1"], ["10.0.0.1", "8.8.8.8"], ["8.8.8.8", "::ffff:127.0.0.1"]]
)
async def test_guarded_resolver_refuses_the_host_when_any_answer_is_blocked(answers: list[str]) -> None:
    resolver = GuardedResolver(allow_private=False, allowed_networks=(), inner=FakeDNS({"img.test": answers}))
    with pytest.raises(AddressBlocked) as caught:
        await resolver.resolve("img.test", 80)
    assert caught.value.host == "img.test"
    assert caught.value.address in {"127.0.0.1", "10.0.0.1", "::ffff:7f00:1"}


# --- end to end, through MediaFetcher against real servers ---------------------------------------------------


@pytest.fixture(scope="module")
def local_server() -> Iterator[tuple[MediaStub, int]]:
    stub = MediaStub()
    with ServerThread(stub) as server:
        yield stub, server.port


@pytest.fixture(scope="module")
def public_server() -> Iterator[tuple[MediaStub, int]]:
    stub = MediaStub()
    with ServerThread(stub, bind=(PUBLIC, 0)) as server:
        yield stub, server.port


@pytest.fixture
def local(local_server: tuple[MediaStub, int]) -> tuple[MediaStub, int]:
    local_server[0].reset()
    return local_server


@pytest.fixture
def public(public_server: tuple[MediaStub, int]) -> tuple[MediaStub, int]:
    public_server[0].reset()
    return public_server


async def _refused(fetcher: MediaFetcher, url: str) -> BadRequest:
    counted: list[int] = []
    with pytest.raises(BadRequest) as caught:
        await fetcher.fetch(url, locator="messages[0].content[1]", on_bytes=counted.append)
    assert counted == []
    assert caught.value.message.startswith("messages[0].content[1]: ")
    return caught.value


async def test_the_internal_stub_is_reachable_when_the_guard_is_off(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int]
) -> None:
    # The control for every refusal below: the same URL succeeds once private networks are allowed.
    stub, port = local
    fetcher = make_fetcher(allow_private_networks=True)
    body = await fetcher.fetch(f"http://127.0.0.1:{port}/bytes?size=10", locator="x", on_bytes=lambda n: None)
    assert body == payload(10)
    assert stub.paths() == ["/bytes"]


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.0.0.1.", "loopback"),
        ("2130706433", "loopback"),
        ("127.1", "loopback"),
        ("0x7f.0.0.1", "loopback"),
        ("0x7f000001", "loopback"),
        ("0177.0.0.1", "loopback"),
        ("0", "unspecified"),
        ("0.0.0.0", "unspecified"),
        ("[::1]", "loopback"),
        ("[::]", "unspecified"),
        ("[::ffff:127.0.0.1]", "loopback"),
        ("[0:0:0:0:0:ffff:7f00:1]", "loopback"),
        ("[::127.0.0.1]", "IPv4-compatible"),
        ("[64:ff9b::127.0.0.1]", "loopback"),
        ("[2002:7f00:1::]", "6to4"),
        ("10.0.0.1", "private"),
        ("172.16.0.1", "private"),
        ("192.168.0.1", "private"),
        ("169.254.169.254", "link-local"),
        ("[fe80::1]", "link-local"),
        ("[fd00::1]", "unique local"),
        ("100.64.0.1", "CGNAT"),
        ("224.0.0.1", "multicast"),
        ("[ff02::1]", "multicast"),
    ],
)
async def test_literal_addresses_are_refused_before_connecting(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int], host: str, why: str
) -> None:
    stub, port = local
    url = f"http://{host}:{port}/secret"
    error = await _refused(make_fetcher(), url)
    assert error.reason == "media_url_blocked"
    assert why in error.message
    assert f"host {URL(url).host}" in error.message
    assert "media.fetch.allow_private_networks=false" in error.message
    assert stub.paths() == []


@pytest.mark.parametrize("host", ["2130706434", "127.2", "0x7f.0.0.2", "0177.0.0.02", "127.0.0.2."])
async def test_a_permitted_address_in_another_spelling_is_fetched_from_its_canonical_form(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int], host: str
) -> None:
    stub, port = public
    body = await make_fetcher().fetch(f"http://{host}:{port}/bytes?size=4", locator="x", on_bytes=lambda n: None)
    assert body == payload(4)
    assert stub.only_hit().headers["host"] == f"{PUBLIC}:{port}"


async def test_localhost_resolves_to_loopback_and_is_refused(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int]
) -> None:
    stub, port = local
    error = await _refused(make_fetcher(), f"http://localhost:{port}/secret")  # the real system resolver
    assert error.reason == "media_url_blocked"
    assert "localhost resolves to" in error.message
    assert "loopback" in error.message
    assert stub.paths() == []


async def test_a_host_name_resolving_to_loopback_is_refused(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int]
) -> None:
    stub, port = local
    dns = FakeDNS({"images.example.test": ["127.0.0.1"]})
    error = await _refused(make_fetcher(dns), f"http://images.example.test:{port}/secret")
    assert error.reason == "media_url_blocked"
    assert "images.example.test resolves to 127.0.0.1, a loopback address" in error.message
    assert stub.paths() == []


@pytest.mark.parametrize("answers", [[PUBLIC, "127.0.0.1"], ["127.0.0.1", PUBLIC], [PUBLIC, "::1"]])
async def test_a_host_name_with_one_public_and_one_private_address_is_refused(
    make_fetcher: FetcherFactory,
    local: tuple[MediaStub, int],
    public: tuple[MediaStub, int],
    answers: list[str],
) -> None:
    dns = FakeDNS({"mixed.example.test": answers})
    error = await _refused(make_fetcher(dns), f"http://mixed.example.test:{public[1]}/bytes?size=3")
    assert error.reason == "media_url_blocked"
    assert local[0].paths() == []
    assert public[0].paths() == []


async def test_a_host_name_resolving_to_a_permitted_address_is_fetched(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int]
) -> None:
    stub, port = public
    dns = FakeDNS({"images.example.test": [PUBLIC]})
    body = await make_fetcher(dns).fetch(
        f"http://images.example.test:{port}/bytes?size=100", locator="x", on_bytes=lambda n: None
    )
    assert body == payload(100)
    assert stub.only_hit().headers["host"] == f"images.example.test:{port}"
    assert dns.lookups == ["images.example.test"]


async def test_a_redirect_from_a_public_server_to_loopback_is_refused(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int], public: tuple[MediaStub, int]
) -> None:
    target = f"http://127.0.0.1:{local[1]}/secret"
    error = await _refused(make_fetcher(), f"http://{PUBLIC}:{public[1]}/redirect?to={target}")
    assert error.reason == "media_url_blocked"
    assert error.message.startswith(
        "messages[0].content[1]: media URL (redirect 1) host 127.0.0.1 is a loopback address; refused"
    )
    assert public[0].paths() == ["/redirect"]
    assert local[0].paths() == []


async def test_a_redirect_to_a_host_name_resolving_to_loopback_is_refused(
    make_fetcher: FetcherFactory, local: tuple[MediaStub, int], public: tuple[MediaStub, int]
) -> None:
    dns = FakeDNS({"images.example.test": [PUBLIC], "internal.example.test": ["127.0.0.1"]})
    target = f"http://internal.example.test:{local[1]}/secret"
    error = await _refused(make_fetcher(dns), f"http://images.example.test:{public[1]}/redirect?to={target}")
    assert error.reason == "media_url_blocked"
    assert "internal.example.test resolves to 127.0.0.1" in error.message
    assert public[0].paths() == ["/redirect"]
    assert local[0].paths() == []
    assert dns.lookups == ["images.example.test", "internal.example.test"]


@pytest.mark.parametrize("target", ["file:///etc/passwd", "gopher://127.0.0.2:70/_x", "ftp://example.test/a.png"])
async def test_a_redirect_to_another_scheme_is_refused(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int], target: str
) -> None:
    error = await _refused(make_fetcher(), f"http://{PUBLIC}:{public[1]}/redirect?to={target}")
    assert error.reason == "media_url_blocked"
    assert f"scheme {target.split(':')[0]}: is not allowed" in error.message


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "FILE:///etc/passwd",
        "ftp://example.test/image.png",
        "gopher://127.0.0.1:70/_GET",
        "dict://127.0.0.1:11211/stat",
        "ws://example.test/",
        "javascript:alert(1)",
        "data:image/png;base64,AAAA",
    ],
)
async def test_schemes_other_than_http_and_https_are_refused(make_fetcher: FetcherFactory, url: str) -> None:
    error = await _refused(make_fetcher(), url)
    assert error.reason == "media_url_blocked"
    assert f"scheme {url.split(':')[0].lower()}: is not allowed" in error.message


@pytest.mark.parametrize("userinfo", ["user:pass@", "user@", ":secret@"])
async def test_urls_with_userinfo_are_refused(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int], userinfo: str
) -> None:
    error = await _refused(make_fetcher(), f"http://{userinfo}{PUBLIC}:{public[1]}/bytes?size=3")
    assert error.reason == "media_url_blocked"
    assert "credentials" in error.message
    assert public[0].paths() == []


async def test_disabled_fetch_refuses_every_url(make_fetcher: FetcherFactory, public: tuple[MediaStub, int]) -> None:
    error = await _refused(make_fetcher(enabled=False), f"http://{PUBLIC}:{public[1]}/bytes?size=3")
    assert error.message == ("messages[0].content[1]: remote media URLs are disabled (media.fetch.enabled=false)")
    assert error.status_code == 400
    assert public[0].paths() == []


async def test_allowed_domains_admit_subdomains_and_refuse_lookalikes(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int]
) -> None:
    stub, port = public
    names = ["example.test", "img.example.test", "badexample.test", "example.test.evil.test"]
    dns = FakeDNS({name: [PUBLIC] for name in names})
    fetcher = make_fetcher(dns, allowed_domains=["example.test"])
    for name in ("example.test", "img.example.test"):
        body = await fetcher.fetch(f"http://{name}:{port}/bytes?size=5", locator="x", on_bytes=lambda n: None)
        assert body == payload(5)
    for host in ("badexample.test", "example.test.evil.test", PUBLIC):
        error = await _refused(fetcher, f"http://{host}:{port}/bytes?size=5")
        assert error.reason == "media_url_blocked"
        assert f"host {host} is not in media.fetch.allowed_domains" in error.message
    assert stub.paths() == ["/bytes", "/bytes"]
    assert dns.lookups == ["example.test", "img.example.test"]  # refused names were never even resolved


async def test_allowed_domains_apply_to_redirect_targets(
    make_fetcher: FetcherFactory, public: tuple[MediaStub, int]
) -> None:
    stub, port = public
    dns = FakeDNS({"img.example.test": [PUBLIC], "other.test": [PUBLIC]})
    fetcher = make_fetcher(dns, allowed_domains=["example.test"])
    target = f"http://other.test:{port}/bytes?size=5"
    error = await _refused(fetcher, f"http://img.example.test:{port}/redirect?to={target}")
    assert "host other.test is not in media.fetch.allowed_domains" in error.message
    assert stub.paths() == ["/redirect"]


@pytest.fixture
def twin_servers() -> Iterator[tuple[MediaStub, MediaStub, int]]:
    """A permitted stub on 127.0.0.2 and an internal one on 127.0.0.1, on the same port."""
    public_stub, internal_stub = MediaStub(), MediaStub()
    for _ in range(20):
        with ServerThread(public_stub, bind=(PUBLIC, 0)) as public_server:
            try:
                internal = ServerThread(internal_stub, bind=("127.0.0.1", public_server.port))
            except OSError:
                continue  # that port is taken on 127.0.0.1: try another
            with internal:
                yield public_stub, internal_stub, public_server.port
            return
    pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")


async def test_dns_rebinding_connects_to_the_checked_address_and_rechecks_each_connection(
    make_fetcher: FetcherFactory, twin_servers: tuple[MediaStub, MediaStub, int]
) -> None:
    public_stub, internal_stub, port = twin_servers
    # First answer permitted, every later answer loopback: a rebinding attacker's DNS.
    dns = FakeDNS({"rebind.example.test": [PUBLIC]}, later={"rebind.example.test": ["127.0.0.1"]})
    fetcher = make_fetcher(dns)
    url = f"http://rebind.example.test:{port}/bytes?size=64&close=1"
    body = await fetcher.fetch(url, locator="x", on_bytes=lambda n: None)
    assert body == payload(64)
    assert dns.lookups == ["rebind.example.test"]  # resolved once; the connection used that answer
    assert public_stub.paths() == ["/bytes"]
    assert internal_stub.paths() == []
    # The server closed that connection; the next one resolves again, and the new answer is checked too.
    error = await _refused(fetcher, url)
    assert error.reason == "media_url_blocked"
    assert "resolves to 127.0.0.1" in error.message
    assert dns.lookups == ["rebind.example.test", "rebind.example.test"]
    assert internal_stub.paths() == []


async def test_a_kept_alive_connection_is_reused_without_a_new_lookup(
    make_fetcher: FetcherFactory, twin_servers: tuple[MediaStub, MediaStub, int]
) -> None:
    public_stub, internal_stub, port = twin_servers
    dns = FakeDNS({"rebind.example.test": [PUBLIC]}, later={"rebind.example.test": ["127.0.0.1"]})
    fetcher = make_fetcher(dns)
    url = f"http://rebind.example.test:{port}/bytes?size=64"
    for _ in range(3):
        assert await fetcher.fetch(url, locator="x", on_bytes=lambda n: None) == payload(64)
    assert dns.lookups == ["rebind.example.test"]
    assert public_stub.paths() == ["/bytes"] * 3
    assert internal_stub.paths() == []
