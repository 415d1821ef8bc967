"""aiohttp's exceptions sorted into kinds: every class the three callers tell apart lands on its own kind."""

from __future__ import annotations

import ssl
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from serving.http_client_errors import HTTP_CLIENT_ERRORS, Failure, connect_cause, described, failure_of

KEY: Any = SimpleNamespace(host="example.test", port=443, ssl=True)
REFUSED = ConnectionRefusedError(111, "Connection refused")


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (aiohttp.ConnectionTimeoutError("connect"), Failure.CONNECT_TIMEOUT),
        (aiohttp.SocketTimeoutError("read"), Failure.READ_TIMEOUT),
        (aiohttp.ServerTimeoutError("read"), Failure.READ_TIMEOUT),
        (TimeoutError(), Failure.READ_TIMEOUT),
        (aiohttp.ClientConnectorDNSError(KEY, OSError(-2, "Name or service not known")), Failure.DNS),
        (aiohttp.ClientConnectorError(KEY, REFUSED), Failure.CONNECT),
        (aiohttp.ClientConnectorCertificateError(KEY, ssl.SSLCertVerificationError("bad cert")), Failure.CONNECT),
        (aiohttp.ServerDisconnectedError(), Failure.PROTOCOL),
        (aiohttp.ClientPayloadError("truncated"), Failure.PROTOCOL),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), Failure.PROTOCOL),
        (aiohttp.ClientError(), Failure.PROTOCOL),
    ],
)
def test_each_exception_class_has_its_kind(exc: Exception, kind: Failure) -> None:
    assert isinstance(exc, HTTP_CLIENT_ERRORS)
    assert failure_of(exc) is kind
    assert failure_of(exc).timed_out == (kind in (Failure.CONNECT_TIMEOUT, Failure.READ_TIMEOUT))


def test_connect_cause_names_the_os_error_else_the_exception() -> None:
    assert connect_cause(aiohttp.ClientConnectorError(KEY, REFUSED)) is REFUSED
    other = aiohttp.ServerDisconnectedError()
    assert connect_cause(other) is other


def test_described_falls_back_to_the_class_name() -> None:
    assert described(aiohttp.ClientPayloadError("truncated")) == "truncated"
    assert described(aiohttp.ServerDisconnectedError()) == "Server disconnected"
    assert described(aiohttp.ClientError()) == "ClientError"
