"""`gateway.paths`: what the gateway matches is the path an upstream resolves, through the real gateway."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.paths import UnnormalizablePath, _normalized, normal_path
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import chat_body, data_url, jpeg_header_claiming
from tests.gateway.rawhttp import open_request, read_response
from tests.gateway.stub_upstream import StubUpstream


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (b"/", b"/"),
        (b"//", b"/"),
        (b"//release_memory", b"/release_memory"),
        (b"/v1/../release_memory", b"/release_memory"),
        (b"/./release_memory", b"/release_memory"),
        (b"/%2e%2E/release_memory", b"/release_memory"),
        (b"/v1//chat///completions", b"/v1/chat/completions"),
        (b"/v1/chat/completions/", b"/v1/chat/completions/"),
        (b"/a/b/..", b"/a/"),
        (b"/a/./b/../../c", b"/c"),
        (b"/../../x", b"/x"),
        (b"/a%20b/%41", b"/a%20b/%41"),  # other escapes stay as the client wrote them
    ],
)
def test_the_normal_form_removes_dot_segments_and_merges_slashes(raw: bytes, normal: bytes) -> None:
    assert normal_path(raw) == normal
    assert normal_path(normal) == normal


@given(st.lists(st.sampled_from([b"/", b".", b"..", b"a", b"%", b"2e", b"%2e", b"v1", b"\\"]), max_size=12))
def test_a_path_already_normal_is_recognised_without_being_rewritten(pieces: list[bytes]) -> None:
    raw = b"/" + b"".join(pieces)
    try:
        expected = _normalized(raw)
    except UnnormalizablePath:
        with pytest.raises(UnnormalizablePath):
            normal_path(raw)
        return
    assert normal_path(raw) == expected


@pytest.mark.parametrize("raw", [b"/%2Frelease_memory", b"/v1%2fmodels", b"/a%5Cb", b"/a\\b"])
def test_an_encoded_slash_or_a_backslash_has_no_normal_form(raw: bytes) -> None:
    with pytest.raises(UnnormalizablePath):
        normal_path(raw)


def raw_request(url: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    method = "POST" if body else "GET"
    sock = open_request(url, f"{method} {target} HTTP/1.1\nHost: gateway\nContent-Length: {len(body)}\n")
    with sock:
        sock.sendall(body)
        status, _, answer = read_response(sock)
    return status, answer


@pytest.mark.parametrize(
    "target",
    ["/release_memory", "//release_memory", "/v1/../release_memory", "/./release_memory", "/%2e%2e/release_memory"],
)
def test_a_blocked_path_cannot_be_walked_around(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, target: str
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"blocked_paths": ["/release_memory"]}) as (_, url):
        status, _ = raw_request(url, target)
    assert status == 403
    assert app.state.requests == []


def test_an_encoded_slash_is_refused_not_forwarded(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"blocked_paths": ["/release_memory"]}) as (_, url):
        status, answer = raw_request(url, "/%2Frelease_memory")
    assert status == 400
    assert b"percent-encoded slash" in answer
    assert app.state.requests == []


def test_an_admission_route_written_another_way_is_still_admitted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """`/v1//chat/./completions` is the chat route: its media are counted (a header bomb is refused)."""
    app, upstream = stub
    bomb = chat_body(data_url(jpeg_header_claiming(40000, 40000)))
    with make_gateway(upstream) as (_, url):
        status, _ = raw_request(url, "/v1//chat/./completions", bomb)
        forwarded, _ = raw_request(url, "/v1/x/../chat/completions", chat_body())
    assert status == 413
    assert forwarded == 200
    assert [seen.path for seen in app.state.requests] == ["/v1/chat/completions"]  # forwarded in normal form
