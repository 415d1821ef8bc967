"""Downloading http(s) media URLs: SSRF-guarded, size-capped as bytes arrive, time-limited, redirects by hand.

Every hop (the first URL and each redirect target) is validated the same way before anything connects: scheme
http or https, no userinfo, host in `media.fetch.allowed_domains` when that is set, and an IP-literal host (in any
spelling) checked against the address policy and rewritten to the canonical form that was checked. Host names are
checked when aiohttp resolves them, through `GuardedResolver`, once per new connection (no DNS cache), and aiohttp
connects to the addresses that resolver returned.

Compression: the fetcher asks for `Accept-Encoding: identity` and does not decompress. Images are compressed
already, so servers rarely encode them; one that does anyway is refused with a 400 naming the encoding, because
its bytes are not the image and decompressing would make the per-response cap count something other than what
arrives on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from gateway.config import FetchSettings
from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.sources.ssrf import (
    AddressBlocked,
    GuardedResolver,
    IPAddress,
    address_refusal,
    is_domain_allowed,
    parse_ip_literal,
)
from serving.http_client_errors import HTTP_CLIENT_ERRORS, Failure, connect_cause, described, failure_of

_SCHEMES = frozenset({"http", "https"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# The most one read hands over, so a download stops at most this far past a cap.
_CHUNK_BYTES = 64 << 10
# The rejection reason of a URL its checks (scheme, host, SSRF rules) refused before any fetch.
URL_BLOCKED = "media_url_blocked"
_FAILED = "media_fetch_failed"
_TOO_LARGE = "media_too_large"
_POLICY = "(media.fetch.allow_private_networks=false and not in media.fetch.allowed_networks)"


class MediaFetcher:
    """Downloads media URLs for the loader. One pooled aiohttp session, created on first use inside the loop."""

    def __init__(self, settings: FetchSettings, *, resolver_inner: AbstractResolver | None = None) -> None:
        self.settings = settings
        self._resolver_inner = resolver_inner
        self._session: aiohttp.ClientSession | None = None
        self._resolver: GuardedResolver | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            settings = self.settings
            self._resolver = resolver = GuardedResolver(
                allow_private=settings.allow_private_networks,
                allowed_networks=settings.allowed_networks,
                inner=self._resolver_inner,
            )
            self._session = aiohttp.ClientSession(
                # No DNS cache: each new connection resolves through the guard, and the guard's answer is
                # what that connection uses.
                connector=aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False),
                # `connect` covers the lookup, waiting for a pooled connection and the TCP/TLS handshake;
                # `sock_read` is the longest silence while waiting for headers or between body chunks.
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
                ),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                headers={"User-Agent": settings.user_agent, "Accept-Encoding": "identity"},
            )
        return self._session

    async def aclose(self) -> None:
        session, resolver = self._session, self._resolver
        self._session = self._resolver = None
        if session is not None:
            await session.close()
        if resolver is not None:  # the connector does not close a resolver it was given
            await resolver.close()

    async def fetch(self, url: str, *, locator: str, on_bytes: Callable[[int], None]) -> bytes:
        """The body of `url` after at most `media.fetch.max_redirects` redirects.

        `on_bytes(n)` runs for every chunk as it arrives, before the chunk is kept, so the caller can count it
        toward the per-request cap; whatever it raises propagates unchanged and closes the download. Refusals
        and failures raise `BadRequest`; a body over `media.fetch.max_bytes` raises `RequestTooLarge`.
        Cancelling the call closes the connection at once. The whole fetch, redirects included, gets
        `media.fetch.total_timeout_s`: a server trickling bytes just fast enough never trips the read timeout.
        """
        deadline = asyncio.timeout(self.settings.total_timeout_s)
        try:
            async with deadline:
                return await self._fetch(url, locator, on_bytes)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise BadRequest(
                f"{locator}: media URL took longer than media.fetch.total_timeout_s={self.settings.total_timeout_s:g}",
                reason=_FAILED,
            ) from None

    async def _fetch(self, url: str, locator: str, on_bytes: Callable[[int], None]) -> bytes:
        settings = self.settings
        if not settings.enabled:
            raise BadRequest(
                f"{locator}: remote media URLs are disabled (media.fetch.enabled=false)", reason=URL_BLOCKED
            )
        try:
            current = URL(url)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"{locator}: media URL is not a valid URL ({exc})", reason=URL_BLOCKED) from None
        redirects = 0
        while True:
            subject = f"{locator}: media URL" if not redirects else f"{locator}: media URL (redirect {redirects})"
            current = self._checked(current, subject)
            response = await self._open(current, subject)
            try:
                if response.status in _REDIRECTS:
                    location = response.headers.get("Location")
                    if not location:
                        raise BadRequest(
                            f"{subject} {_origin(current)} answered {response.status} without a Location header",
                            reason=_FAILED,
                        )
                    redirects += 1
                    if redirects > settings.max_redirects:
                        raise BadRequest(
                            f"{locator}: media URL redirected more than "
                            f"media.fetch.max_redirects={settings.max_redirects} times",
                            reason=_FAILED,
                        )
                    current = self._follow(current, location, subject)
                    continue
                if not 200 <= response.status < 300:
                    raise BadRequest(
                        f"{subject} {_origin(current)} answered HTTP {response.status}",
                        reason=_FAILED,
                    )
                body = await self._read(response, current, subject, on_bytes)
            except BaseException:
                # Unread bodies (a redirect's, a refused one's, a cancelled download's) are not drained:
                # the connection is dropped.
                response.close()
                raise
            response.release()
            return body

    def _checked(self, url: URL, subject: str) -> URL:
        """`url` if it may be fetched, with an IP-literal host rewritten to the canonical address checked."""
        settings = self.settings
        scheme = url.scheme.lower()
        if not scheme:
            raise BadRequest(f"{subject} is not an absolute http(s) URL", reason=URL_BLOCKED)
        if scheme not in _SCHEMES:
            raise BadRequest(f"{subject} scheme {scheme}: is not allowed (only http and https)", reason=URL_BLOCKED)
        if url.raw_user is not None or url.raw_password is not None:
            raise BadRequest(f"{subject} carries credentials (user@host); refused", reason=URL_BLOCKED)
        host, raw_host = url.host, url.raw_host
        if not host or not raw_host:
            raise BadRequest(f"{subject} has no host", reason=URL_BLOCKED)
        try:
            ip = parse_ip_literal(host)
        except ValueError as exc:
            raise BadRequest(f"{subject} host is malformed: {exc}", reason=URL_BLOCKED) from None
        if ip is not None:
            raw_host = str(ip)
        if not is_domain_allowed(raw_host, settings.allowed_domains):
            raise BadRequest(
                f"{subject} host {raw_host} is not in media.fetch.allowed_domains",
                reason=URL_BLOCKED,
            )
        if ip is None:
            return url  # a host name: checked by the guarded resolver when aiohttp connects
        why = address_refusal(
            ip, allow_private=settings.allow_private_networks, allowed_networks=settings.allowed_networks
        )
        if why is not None:
            raise BadRequest(
                f"{subject} host {_literal(host, ip)} is {_article(why)} address; refused {_POLICY}",
                reason=URL_BLOCKED,
            )
        # aiohttp connects to a literal host without resolving it: hand it exactly the address just checked.
        return url.with_host(str(ip))

    def _follow(self, current: URL, location: str, subject: str) -> URL:
        try:
            return current.join(URL(location)).with_fragment(None)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"{subject} redirected to an invalid Location ({exc})", reason=_FAILED) from None

    async def _open(self, url: URL, subject: str) -> aiohttp.ClientResponse:
        settings = self.settings
        try:
            return await self.session.get(url, allow_redirects=False)
        except AddressBlocked as exc:
            raise BadRequest(
                f"{subject} host {exc.host} resolves to {exc.address}, {_article(exc.why)} address; refused {_POLICY}",
                reason=URL_BLOCKED,
            ) from None
        except HTTP_CLIENT_ERRORS as exc:
            message = _OPEN_FAILURES[failure_of(exc)](settings, url, subject, exc)
            raise BadRequest(message, reason=_FAILED) from None

    async def _read(
        self, response: aiohttp.ClientResponse, url: URL, subject: str, on_bytes: Callable[[int], None]
    ) -> bytes:
        settings = self.settings
        limit = settings.max_bytes
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise BadRequest(
                f"{subject} {_origin(url)} sent Content-Encoding: {encoding}; "
                "only unencoded (identity) media is accepted",
                reason=_FAILED,
            )
        declared = response.content_length
        if declared is not None and declared > limit:
            raise RequestTooLarge(
                f"{subject} declares Content-Length {declared:,} bytes, over media.fetch.max_bytes={limit:,}",
                reason=_TOO_LARGE,
            )
        body = bytearray()
        received = 0
        try:
            while chunk := await response.content.read(_CHUNK_BYTES):
                received += len(chunk)
                on_bytes(len(chunk))
                if received > limit:
                    raise RequestTooLarge(
                        f"{subject} body reached {received:,} bytes, over media.fetch.max_bytes={limit:,}",
                        reason=_TOO_LARGE,
                    )
                body += chunk
        except HTTP_CLIENT_ERRORS as exc:
            if failure_of(exc).timed_out:
                message = (
                    f"{subject} timed out: {_origin(url)} sent nothing for "
                    f"media.fetch.read_timeout_s={settings.read_timeout_s:g} after {received:,} bytes"
                )
            else:
                message = f"{subject} {_origin(url)} broke off after {received:,} bytes ({described(exc)})"
            raise BadRequest(message, reason=_FAILED) from None
        return bytes(body)


def _origin(url: URL) -> str:
    # Error messages name the server, not the path and query, which may carry signed tokens.
    return str(url.origin())


def _literal(host: str, ip: IPAddress) -> str:
    """`127.0.0.1`, or `0x7f.1 (= 127.0.0.1)` when the URL spelled the address another way."""
    canonical = str(ip)
    return canonical if host == canonical else f"{host} (= {canonical})"


# A download that got no response: the message of its 400, from (settings, url, subject, exception).
_OPEN_FAILURES: dict[Failure, Callable[[FetchSettings, URL, str, Exception], str]] = {
    Failure.CONNECT_TIMEOUT: lambda settings, url, subject, exc: (
        f"{subject} timed out connecting to {_origin(url)} "
        f"(media.fetch.connect_timeout_s={settings.connect_timeout_s:g})"
    ),
    Failure.READ_TIMEOUT: lambda settings, url, subject, exc: (
        f"{subject} timed out waiting for {_origin(url)} to answer "
        f"(media.fetch.read_timeout_s={settings.read_timeout_s:g})"
    ),
    Failure.DNS: lambda settings, url, subject, exc: (
        f"{subject} host {url.host} could not be resolved ({connect_cause(exc)})"
    ),
    Failure.CONNECT: lambda settings, url, subject, exc: (
        f"{subject} {_origin(url)} could not be reached ({connect_cause(exc)})"
    ),
    Failure.PROTOCOL: lambda settings, url, subject, exc: f"{subject} {_origin(url)} failed ({described(exc)})",
}


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"
