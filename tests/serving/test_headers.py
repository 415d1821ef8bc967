from __future__ import annotations

from serving.headers import end_to_end, get_header


def test_hop_by_hop_headers_stop_and_names_are_lowercased() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"TE", b"trailers"),
        (b"Upgrade", b"h2c"),
        (b"X-Custom", b"1"),
    ]
    assert end_to_end(headers) == [(b"content-type", b"application/json"), (b"x-custom", b"1")]


def test_headers_named_in_connection_stop_whichever_header_names_them() -> None:
    headers = [
        (b"x-trace", b"abc"),
        (b"Connection", b"close, X-Trace"),
        (b"x-other", b"1"),
        (b"x-kept", b"2"),
        (b"connection", b" x-OTHER "),
    ]
    assert end_to_end(headers) == [(b"x-kept", b"2")]


def test_a_connection_value_naming_only_hop_by_hop_headers_removes_nothing_else() -> None:
    headers = [(b"Connection", b"Keep-Alive, Upgrade"), (b"server", b"nginx"), (b"date", b"today")]
    assert end_to_end(headers) == [(b"server", b"nginx"), (b"date", b"today")]


def test_dropped_names_stop_too() -> None:
    headers = [(b"host", b"a"), (b"content-length", b"3"), (b"accept", b"*/*")]
    assert end_to_end(headers, drop=frozenset({b"host", b"content-length"})) == [(b"accept", b"*/*")]
    assert end_to_end(headers) == headers


def test_get_header_finds_the_first_value_whatever_the_case() -> None:
    headers = [(b"X-Request-ID", b"one"), (b"x-request-id", b"two"), (b"host", b"h")]
    assert get_header(headers, b"x-request-id") == b"one"
    assert get_header(headers, b"host") == b"h"
    assert get_header(headers, b"hosts") is None
