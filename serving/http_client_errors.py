"""aiohttp's exceptions sorted into the few kinds of failure its callers tell apart. Each caller (the upstream
proxy, the media fetcher, the engine client) turns a kind into its own error class, message and metric label
with a small table keyed by `Failure`."""

from __future__ import annotations

import enum

import aiohttp

# What an aiohttp call raises when the exchange fails: its own errors, and TimeoutError for its timeouts.
HTTP_CLIENT_ERRORS: tuple[type[Exception], ...] = (TimeoutError, aiohttp.ClientError)


class Failure(enum.StrEnum):
    CONNECT_TIMEOUT = "connect_timeout"
    """No connection within the connect timeout."""
    READ_TIMEOUT = "read_timeout"
    """The peer sent nothing within the read timeout (or another timeout ran out)."""
    DNS = "dns"
    """The host name did not resolve."""
    CONNECT = "connect"
    """The connection was refused, unreachable, or its TLS handshake failed."""
    PROTOCOL = "protocol"
    """Anything else: the peer broke off or broke the HTTP exchange."""

    @property
    def timed_out(self) -> bool:
        return self in (Failure.CONNECT_TIMEOUT, Failure.READ_TIMEOUT)


# The first class an exception is an instance of names its kind: subclasses come before their bases
# (ConnectionTimeoutError is a ServerTimeoutError, which is both a TimeoutError and a ClientError).
_KINDS: tuple[tuple[type[BaseException], Failure], ...] = (
    (aiohttp.ConnectionTimeoutError, Failure.CONNECT_TIMEOUT),
    (TimeoutError, Failure.READ_TIMEOUT),
    (aiohttp.ClientConnectorDNSError, Failure.DNS),
    (aiohttp.ClientConnectorError, Failure.CONNECT),
)


def failure_of(exc: BaseException) -> Failure:
    """The kind of an exception caught as one of `HTTP_CLIENT_ERRORS`."""
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind
    return Failure.PROTOCOL


def connect_cause(exc: BaseException) -> object:
    """What a connect failure names: the OS error under it, or the exception itself where it carries none."""
    return getattr(exc, "os_error", None) or exc


def described(exc: BaseException) -> object:
    """The exception's text, or its class name when it has none."""
    return str(exc) or type(exc).__name__
