"""serving/forwarded.py: the client and scheme believed only from trusted proxies; their headers dropped from
anyone else."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from serving.forwarded import TrustedProxies, direct_peer, parse_trusted


def seen(trusted: list[str], peer: tuple[str, int] | None, headers: dict[str, str]) -> dict[str, Any]:
    """The scope the app inside gets for a request from `peer` with `headers`."""
    got: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.update(scope, peer=direct_peer(scope))

    scope = {
        "type": "http",
        "scheme": "http",
        "client": peer,
        "headers": [(name.encode(), value.encode()) for name, value in headers.items()],
    }
    asyncio.run(TrustedProxies(app, trusted)(scope, None, None))  # type: ignore[arg-type]
    return got


@pytest.mark.parametrize(
    ("chain", "client"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("198.51.100.1, 203.0.113.7, 10.0.0.2", "203.0.113.7"),  # the rightmost that is not a trusted proxy
        ("10.0.0.3, 10.0.0.2", "10.0.0.3"),  # every hop trusted: the leftmost
    ],
)
def test_a_trusted_peer_says_who_the_client_is(chain: str, client: str) -> None:
    scope = seen(["10.0.0.0/8"], ("10.0.0.1", 5000), {"x-forwarded-for": chain, "x-forwarded-proto": "https"})
    assert scope["client"] == (client, 0)
    assert scope["scheme"] == "https"
    assert scope["peer"] == ("10.0.0.1", 5000)
    assert (b"x-forwarded-for", chain.encode()) in scope["headers"]


def test_an_untrusted_peer_loses_every_forwarding_header() -> None:
    headers = {"x-forwarded-for": "6.6.6.6", "forwarded": "for=6.6.6.6", "x-real-ip": "6.6.6.6", "x-other": "kept"}
    scope = seen(["10.0.0.0/8"], ("192.0.2.9", 5000), {**headers, "x-forwarded-proto": "https"})
    assert scope["client"] == ("192.0.2.9", 5000)
    assert scope["scheme"] == "http"
    assert scope["headers"] == [(b"x-other", b"kept")]


@pytest.mark.parametrize(
    ("trusted", "peer", "believed"),
    [
        (["*"], ("192.0.2.9", 1), True),
        (["::1"], ("::1", 1), True),
        (["2001:db8::/32"], ("2001:db8::5", 1), True),
        (["127.0.0.1"], ("127.0.0.2", 1), False),
        ([], ("127.0.0.1", 1), False),
        (["127.0.0.1"], ("/run/mmgate.sock", 0), False),  # not an address: never a proxy
    ],
)
def test_which_peers_are_trusted(trusted: list[str], peer: tuple[str, int], believed: bool) -> None:
    scope = seen(trusted, peer, {"x-forwarded-for": "203.0.113.7"})
    assert (scope["client"] == ("203.0.113.7", 0)) is believed


def test_a_request_without_a_peer_passes_untouched() -> None:
    scope = seen([], None, {"x-forwarded-for": "203.0.113.7"})
    assert scope["headers"] == [(b"x-forwarded-for", b"203.0.113.7")]
    assert scope["peer"] is None


def test_entries_that_are_not_addresses_are_refused() -> None:
    assert parse_trusted(["*", "10.0.0.1", "10.0.0.0/8"])[0] is True
    with pytest.raises(ValueError, match=re.escape("'gateway.local' is not an IP address, a CIDR network or '*'")):
        parse_trusted(["gateway.local"])
