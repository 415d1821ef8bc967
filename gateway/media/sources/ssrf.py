"""The SSRF guard for media URLs: which addresses and hosts the gateway may fetch from, and a resolver that checks.

Three pieces, each used by `gateway.media.sources.fetch`:

- `address_refusal`: the address policy (None: the address may be fetched from). Only global unicast addresses
  pass, unless `media.fetch.allow_private_networks` is on or the address lies in `media.fetch.allowed_networks`.
  IPv6 forms that carry an IPv4 address to a translator (IPv4-mapped, NAT64) are judged by that IPv4 address;
  6to4 must be acceptable both ways.
- `parse_ip_literal`: a URL host that is an IP address in any spelling a resolver would accept (`2130706433`,
  `127.1`, `0x7f.0.0.1`, `0177.0.0.1`, `[::ffff:127.0.0.1]`), as one `ipaddress` object. aiohttp connects to
  literal addresses without asking the resolver, so the fetcher checks these itself and hands aiohttp the
  canonical form it checked.
- `GuardedResolver`: resolves a host name once through an inner resolver, refuses the host when any answer is not
  acceptable, and returns only the checked addresses; aiohttp connects to exactly those (no second lookup, so no
  DNS-rebinding window).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# Every special-purpose IPv4 block (IANA IPv4 special-purpose registry) a media fetch must not reach.
# `is_global` already refuses most of these; it is too permissive for multicast, 192.0.0.0/24 and 192.88.99.0/24,
# and each block is spelled out so the rule that refused an address can be named.
_IPV4_REFUSED: tuple[tuple[IPv4Network, str], ...] = (
    (IPv4Network("0.0.0.0/8"), "unspecified ('this network')"),
    (IPv4Network("10.0.0.0/8"), "private"),
    (IPv4Network("100.64.0.0/10"), "shared address space (CGNAT)"),
    (IPv4Network("127.0.0.0/8"), "loopback"),
    (IPv4Network("169.254.0.0/16"), "link-local (incl. cloud metadata 169.254.169.254)"),
    (IPv4Network("172.16.0.0/12"), "private"),
    (IPv4Network("192.0.0.0/24"), "IETF protocol assignment"),
    (IPv4Network("192.0.2.0/24"), "documentation"),
    (IPv4Network("192.88.99.0/24"), "6to4 relay anycast"),
    (IPv4Network("192.168.0.0/16"), "private"),
    (IPv4Network("198.18.0.0/15"), "benchmarking"),
    (IPv4Network("198.51.100.0/24"), "documentation"),
    (IPv4Network("203.0.113.0/24"), "documentation"),
    (IPv4Network("224.0.0.0/4"), "multicast"),
    (IPv4Network("240.0.0.0/4"), "reserved (incl. broadcast)"),
)

# IPv6 blocks checked before the global-unicast rule, so their refusal names the specific block.
_IPV6_REFUSED: tuple[tuple[IPv6Network, str], ...] = (
    (IPv6Network("::/128"), "unspecified"),
    (IPv6Network("::1/128"), "loopback"),
    # ::a.b.c.d, deprecated since RFC 4291; nothing legitimate serves images there.
    (IPv6Network("::/96"), "IPv4-compatible (deprecated)"),
    (IPv6Network("64:ff9b:1::/48"), "local-use NAT64"),
    (IPv6Network("100::/64"), "discard-only"),
    (IPv6Network("2001::/23"), "IETF protocol assignment (incl. Teredo)"),
    (IPv6Network("2001:db8::/32"), "documentation"),
    (IPv6Network("3fff::/20"), "documentation"),
    (IPv6Network("fc00::/7"), "unique local (ULA)"),
    (IPv6Network("fe80::/10"), "link-local"),
    (IPv6Network("fec0::/10"), "site-local (deprecated)"),
    (IPv6Network("ff00::/8"), "multicast"),
)
_IPV6_GLOBAL_UNICAST = IPv6Network("2000::/3")
_NAT64 = IPv6Network("64:ff9b::/96")
_IPV4_MAPPED = IPv6Network("::ffff:0:0/96")


def embedded_ipv4(ip: IPAddress) -> IPv4Address | None:
    """The IPv4 address a connection to `ip` actually reaches: IPv4-mapped (`::ffff:a.b.c.d`) and NAT64
    (`64:ff9b::a.b.c.d`) addresses are translated to it."""
    if isinstance(ip, IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(ip: IPAddress, *, allow_private: bool, allowed_networks: Iterable[IPNetwork]) -> str | None:
    """Why a media fetch may not connect to `ip` (e.g. "loopback"), or None when it may."""
    translated = embedded_ipv4(ip)
    candidates = (ip,) if translated is None else (ip, translated)
    if any(candidate in network for network in allowed_networks for candidate in candidates):
        return None
    if allow_private:
        return None
    if translated is not None:
        why = _ipv4_refusal(translated)
        kind = "IPv4-mapped" if ip in _IPV4_MAPPED else "NAT64"
        return None if why is None else f"{why} ({kind} {translated})"
    if isinstance(ip, IPv4Address):
        return _ipv4_refusal(ip)
    return _ipv6_refusal(ip)


def _ipv4_refusal(ip: IPv4Address) -> str | None:
    for network, why in _IPV4_REFUSED:
        if ip in network:
            return why
    if not ip.is_global:  # whatever the table above misses, the standard library still knows
        return "not globally routable"
    return None


def _ipv6_refusal(ip: IPv6Address) -> str | None:
    for network, why in _IPV6_REFUSED:
        if ip in network:
            return why
    if ip not in _IPV6_GLOBAL_UNICAST:
        return "reserved (outside global unicast 2000::/3)"
    if ip.sixtofour is not None:
        # 6to4 (2002::/16) tunnels to the IPv4 address it embeds.
        inner = _ipv4_refusal(ip.sixtofour)
        if inner is not None:
            return f"6to4 (embedding {inner} IPv4 {ip.sixtofour})"
    if not ip.is_global:
        return "not globally routable"
    return None


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a URL host names when it is an IP literal, else None (a host name).

    IPv4 follows the WHATWG URL host parser: a host whose last label is a number is an IPv4 address in decimal,
    octal (`0` prefix) or hex (`0x` prefix) parts, with 1 to 4 parts where the last fills the remaining bytes;
    one that does not parse raises ValueError rather than falling through to a resolver that would read it its
    own way. IPv6 is the bracketless form yarl gives (`::ffff:7f00:1`), zone ids allowed.
    """
    if ":" in host:
        return IPv6Address(host)
    parts = host.split(".")
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()  # one trailing dot, as in "127.0.0.1."
    if not _is_number(parts[-1]):
        return None
    if len(parts) > 4:
        raise ValueError(f"{host!r} is not an IPv4 address (more than four parts)")
    numbers = [_ipv4_part(part, host) for part in parts]
    last_limit = 256 ** (5 - len(numbers))
    if any(number > 255 for number in numbers[:-1]) or numbers[-1] >= last_limit:
        raise ValueError(f"{host!r} is not an IPv4 address (a part is out of range)")
    value = numbers[-1]
    for index, number in enumerate(numbers[:-1]):
        value += number << (8 * (3 - index))
    return IPv4Address(value)


def _is_number(label: str) -> bool:
    if label[:2].lower() == "0x":
        return all(char in "0123456789abcdefABCDEF" for char in label[2:])
    return label != "" and label.isascii() and label.isdigit()


def _ipv4_part(part: str, host: str) -> int:
    try:
        if part[:2].lower() == "0x":
            return int(part[2:] or "0", 16)
        if len(part) > 1 and part.startswith("0"):
            return int(part[1:], 8)
        if part.isascii() and part.isdigit():
            return int(part)
    except ValueError:
        pass
    raise ValueError(f"{host!r} is not an IPv4 address (bad part {part!r})")


def normalize_domain(domain: str) -> str:
    """The form hosts are compared in: yarl's encoded host (lower-case, IDNA), without leading or trailing dots."""
    bare = domain.strip().strip(".")
    return (URL.build(scheme="http", host=bare).raw_host or "").lower() if bare else ""


def is_domain_allowed(host: str, allowed_domains: Sequence[str]) -> bool:
    """True when `allowed_domains` is empty, or `host` is one of them or a subdomain of one.

    `host` is the URL's encoded host (yarl's `raw_host`: lower-case, punycode). `example.com` allows
    `img.example.com` but not `badexample.com`.
    """
    if not allowed_domains:
        return True
    name = host.rstrip(".").lower()
    for entry in allowed_domains:
        domain = normalize_domain(entry)
        if domain and (name == domain or name.endswith("." + domain)):
            return True
    return False


class AddressBlocked(Exception):
    """A host resolved to (or is) an address the policy refuses. Raised from `GuardedResolver.resolve`."""

    def __init__(self, host: str, address: str, why: str) -> None:
        super().__init__(f"{host} resolves to {address}, a {why} address")
        self.host = host
        self.address = address
        self.why = why


class GuardedResolver(AbstractResolver):
    """Resolves through `inner` (aiohttp's `ThreadedResolver` by default) and lets through only checked answers.

    Every address in the answer must pass `address_refusal`; if any does not, the whole host is refused (an
    attacker controlling DNS could otherwise mix one acceptable address with a blocked one and let connection
    fallback reach the blocked one). The returned results carry the canonical form of each checked address,
    and aiohttp connects to those without resolving again. Closing this resolver closes `inner`.
    """

    def __init__(
        self,
        *,
        allow_private: bool,
        allowed_networks: Sequence[IPNetwork],
        inner: AbstractResolver | None = None,
    ) -> None:
        self.allow_private = allow_private
        self.allowed_networks = tuple(allowed_networks)
        self._inner = inner if inner is not None else ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family)
        checked: list[ResolveResult] = []
        for answer in answers:
            try:
                ip = ip_address(answer["host"])
            except ValueError:
                raise AddressBlocked(host, repr(answer["host"]), "malformed") from None
            why = address_refusal(ip, allow_private=self.allow_private, allowed_networks=self.allowed_networks)
            if why is not None:
                raise AddressBlocked(host, str(ip), why)
            result = answer.copy()
            result["host"] = str(ip)
            checked.append(result)
        return checked

    async def close(self) -> None:
        await self._inner.close()
