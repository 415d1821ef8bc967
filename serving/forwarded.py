"""Which peers may say who the client is: `X-Forwarded-For`, `X-Forwarded-Proto` and `Forwarded` are believed
only from trusted proxies (`server.forwarded_allow_ips`), as uvicorn's `--forwarded-allow-ips` rules.

From a trusted peer the client is the rightmost `X-Forwarded-For` address that is not itself a trusted proxy (the
leftmost when all are), and the scheme is `X-Forwarded-Proto`'s. From any other peer those headers are removed
before the app sees the request: nothing downstream (the access log, the upstream) takes a client's own claim
for one the gateway vouches for. The peer itself stays readable with `direct_peer`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from serving.asgi import ASGIApp, Receive, Scope, Send

__all__ = ["FORWARDING_HEADERS", "TrustedProxies", "direct_peer", "parse_trusted"]

FORWARDING_HEADERS = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded", b"x-real-ip"}
)
_PEER = "mmgate.peer"
# Peers whose trust `TrustedProxies` remembers; past it the memory starts over.
_VERDICTS_KEPT = 4096

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_trusted(entries: Iterable[str]) -> tuple[bool, tuple[Network, ...]]:
    """`*` (every peer), addresses and CIDR networks; ValueError naming an entry that is none of them."""
    everyone = False
    networks: list[Network] = []
    for entry in entries:
        if entry.strip() == "*":
            everyone = True
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address, a CIDR network or '*'") from None
    return everyone, tuple(networks)


def direct_peer(scope: Scope) -> tuple[str, int] | None:
    """The address the connection came from, whatever a trusted proxy said the client was."""
    peer: tuple[str, int] | None = scope.get(_PEER, scope.get("client"))
    return peer


class TrustedProxies:
    """Raw ASGI middleware: the client and scheme from trusted proxies' headers; those headers dropped from others."""

    def __init__(self, app: ASGIApp, trusted: Iterable[str], vouched: Iterable[bytes] = ()) -> None:
        """`vouched`: more header names (lowercase) that only a trusted proxy may set, dropped from other peers."""
        self.app = app
        self.everyone, self.networks = parse_trusted(trusted)
        self.dropped = FORWARDING_HEADERS | frozenset(vouched)
        # Peers seen lately and whether they are trusted: parsing an address costs more than the rest of this layer.
        self._verdicts: dict[str, bool] = {}

    def trusts(self, host: str) -> bool:
        if self.everyone:
            return True
        verdict = self._verdicts.get(host)
        if verdict is None:
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                verdict = False  # a unix socket path or a name: never a trusted proxy
            else:
                verdict = any(address in network for network in self.networks)
            if len(self._verdicts) >= _VERDICTS_KEPT:
                self._verdicts.clear()
            self._verdicts[host] = verdict
        return verdict

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] == "http" and client:
            scope[_PEER] = tuple(client)
            if self.trusts(client[0]):
                self._believe(scope)
            else:
                headers, dropped = scope["headers"], self.dropped
                if any(name in dropped for name, _ in headers):
                    scope["headers"] = [(name, value) for name, value in headers if name not in dropped]
        await self.app(scope, receive, send)

    def _believe(self, scope: Scope) -> None:
        hosts: list[str] = []
        proto: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"x-forwarded-for":
                hosts += [host.strip() for host in value.decode("latin-1").split(",") if host.strip()]
            elif name == b"x-forwarded-proto":
                proto = value
        if hosts:
            untrusted = [host for host in reversed(hosts) if not self.trusts(host)]
            scope["client"] = (untrusted[0] if untrusted else hosts[0], 0)
        if proto is not None:
            scheme = proto.decode("latin-1").strip().lower()
            if scheme in ("http", "https"):
                scope["scheme"] = scheme
