"""Adversarial checks on the real gateway in uvicorn on loopback: generated request bodies on the three admission
routes, injected upstream and client faults, and a short mixed soak.

Every check ends with the media budget back at zero, both in the gateway's own count and in `/metrics`, nobody
waiting for it, and the gateway still serving. The whole file is bounded to well under 90 s on two cores
(`pytest tests/gateway/test_adversarial.py --durations=0`): the generated bodies are a fixed number of
derandomized examples, the soak runs for a fixed time, and every test carries a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.app import Gateway
from gateway.media.body import SKELETON_MIN_BODY_BYTES
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.media_factory import (
    chat_body,
    data_url,
    image_bytes,
    jpeg_header_claiming,
    messages_body,
    png_claiming,
    responses_body,
)
from tests.gateway.rawhttp import open_request
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric, samples, wait_until
from tests.servers import free_port

CHAT, MESSAGES, RESPONSES = ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
# What docs/errors.md's table lets the gateway answer on an admission route (503 is engine mode only).
DOCUMENTED = frozenset({200, 400, 403, 413, 429, 502, 504})
ENVELOPE_TYPES = {
    400: ("BadRequestError", "invalid_request_error"),
    403: ("PermissionDeniedError", "permission_error"),
    413: ("RequestTooLargeError", "request_too_large"),
    429: ("RateLimitError", "rate_limit_error"),
    502: ("BadGatewayError", "api_error"),
    504: ("GatewayTimeoutError", "api_error"),
}
ANSWER_WITHIN_S = 5.0
# A gateway whose test left a request hanging still stops within a second.
SERVER = {"drain_timeout_s": 1}
SLOT = 1 << 20
ONE_SLOT = {"budget_mode": "slots", "max_multimodal_cpu_bytes": SLOT, "max_multimodal_cpu_bytes_per_request": SLOT}


# --- helpers -------------------------------------------------------------------------------------------------


@cache
def tiny_jpeg() -> bytes:
    return image_bytes(16, 16)


def solid(side: int, fmt: str, **save: Any) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 90)).save(out, format=fmt, **save)
    return out.getvalue()


@cache
def slow_jpeg() -> bytes:
    """A 3000x3000 progressive JPEG: 54 KB that take about 0.2 s to decode (27 MB decoded)."""
    return solid(3000, "JPEG", progressive=True)


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(4)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    return out.getvalue()


def assert_gateway_error(route: str, response: httpx.Response) -> str:
    """A refusal from the gateway: the route's envelope, the type that goes with the status, a message. Returns
    the message."""
    status = response.status_code
    assert status in ENVELOPE_TYPES, (status, response.text[:500])
    openai_type, anthropic_type = ENVELOPE_TYPES[status]
    assert response.headers["content-type"] == "application/json", response.headers
    error = orjson.loads(response.content)
    if route == MESSAGES:
        assert set(error) == {"type", "error"}, error
        assert error["type"] == "error"
        assert set(error["error"]) == {"type", "message"}, error
        assert error["error"]["type"] == anthropic_type, error
        message = error["error"]["message"]
    else:
        assert set(error) == {"object", "message", "type", "param", "code"}, error
        assert error["object"] == "error"
        assert error["type"] == openai_type, error
        assert error["param"] is None
        assert error["code"] == status
        message = error["message"]
    assert isinstance(message, str)
    assert message.strip(), error
    if status == 429:
        assert int(response.headers["retry-after"]) >= 1
    return message


def answered(url: str) -> Counter[int]:
    """`mmgate_requests_total` on the admission routes, by status code."""
    counts: Counter[int] = Counter()
    for name, labels, value in samples(httpx.get(url + "/metrics", timeout=5).text):
        if name == "mmgate_requests_total" and labels["route"] in ROUTES:
            counts[int(labels["code"])] += int(value)
    return +counts  # series pre-created at zero are not answers


def settle(gateway: Gateway, url: str, timeout_s: float = 5.0) -> None:
    """Wait up to `timeout_s` for the budget to drain, then check it from inside and from `/metrics`."""
    budget = gateway.budget
    wait_until(lambda: budget.in_use == 0 and budget.waiting == 0, timeout_s, "the budget to drain")
    assert budget.in_use == 0
    assert budget.waiting == 0
    text = httpx.get(url + "/metrics", timeout=5).text
    assert re.search(r"^mmgate_budget_in_use_bytes 0\.0$", text, re.MULTILINE), text
    assert re.search(r"^mmgate_budget_waiting_requests 0\.0$", text, re.MULTILINE), text


def still_serves(url: str) -> None:
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200
    response = httpx.post(url + CHAT, content=chat_body(data_url(tiny_jpeg())), timeout=ANSWER_WITHIN_S)
    assert response.status_code == 200, response.text


def send_and_keep(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> socket.socket:
    """A whole request on a raw socket, left open: closing it is a client leaving."""
    extra = "".join(f"{name}: {value}\n" for name, value in (headers or {}).items())
    head = f"POST {path} HTTP/1.1\nHost: gateway\nContent-Type: application/json\nContent-Length: {len(body)}\n{extra}"
    sock = open_request(url, head)
    sock.sendall(body)
    return sock


# --- 1. generated request bodies -----------------------------------------------------------------------------

IMAGE_NAMES = (
    "jpeg",
    "jpeg_gray",
    "jpeg_cmyk",
    "jpeg_progressive",
    "png",
    "png_rgba",
    "png_palette",
    "png_la",
    "gif",
    "gif_animated",
    "webp",
    "webp_lossless",
    "bmp",
    "tiff",  # not in media.formats
    "over_cap",  # decoded 1300x1300x3 = 5,070,000 bytes, over the 4 MiB per-request cap
    "jpeg_bomb",  # header claims 40000x40000, over limits.max_image_pixels
    "png_bomb",
    "random_jpeg",  # 64x64 of noise: its base64 is longer than the parser's long-literal threshold
)


@cache
def images() -> dict[str, bytes]:
    return {
        "jpeg": image_bytes(8, 8),
        "jpeg_gray": image_bytes(8, 8, mode="L"),
        "jpeg_cmyk": image_bytes(8, 8, mode="CMYK"),
        "jpeg_progressive": image_bytes(16, 16, progressive=True),
        "png": image_bytes(8, 8, "PNG"),
        "png_rgba": image_bytes(8, 8, "PNG", "RGBA"),
        "png_palette": image_bytes(8, 8, "PNG", "P"),
        "png_la": image_bytes(8, 8, "PNG", "LA"),
        "gif": image_bytes(8, 8, "GIF"),
        "gif_animated": animated_gif(),
        "webp": image_bytes(8, 8, "WEBP"),
        "webp_lossless": image_bytes(8, 8, "WEBP", lossless=True),
        "bmp": image_bytes(8, 8, "BMP"),
        "tiff": image_bytes(8, 8, "TIFF"),
        "over_cap": solid(1300, "PNG"),
        "jpeg_bomb": jpeg_header_claiming(40000, 40000),
        "png_bomb": png_claiming(40000, 40000),
        "random_jpeg": image_bytes(64, 64),
    }


@st.composite
def media_bytes(draw: st.DrawFn) -> bytes:
    data = images()[draw(st.sampled_from(IMAGE_NAMES))]
    how = draw(st.sampled_from(["intact", "intact", "intact", "truncate", "flip", "junk", "empty", "prefix"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "flip":
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            flipped[draw(st.integers(0, len(flipped) - 1))] ^= draw(st.integers(1, 255))
        return bytes(flipped)
    if how == "junk":
        return draw(st.binary(max_size=64))
    if how == "empty":
        return b""
    if how == "prefix":
        return draw(st.binary(min_size=1, max_size=8)) + data
    return data


@st.composite
def base64_text(draw: st.DrawFn) -> str:
    encoded = base64.b64encode(draw(media_bytes())).decode()
    how = draw(st.sampled_from(["standard", "standard", "standard", "unpadded", "urlsafe", "garbage", "text"]))
    if how == "unpadded":
        return encoded.rstrip("=")
    if how == "urlsafe":
        return encoded.replace("+", "-").replace("/", "_")
    if how == "garbage":
        at = draw(st.integers(0, len(encoded)))
        junk = draw(st.text(alphabet="!*= \t\n\r-_.~é\u2028\x00", min_size=1, max_size=3))
        return encoded[:at] + junk + encoded[at:]
    if how == "text":
        return draw(st.text(max_size=40))
    return encoded


DATA_URL_PREFIXES = (
    "data:image/jpeg;base64,",
    "data:image/png;base64,",
    "data:image/gif;base64,",
    "data:;base64,",
    "DATA:image/png;BASE64,",
    "data:image/png;charset=utf-8;base64,",
    "data:image/png,",
    "data:image/png;base64",
    "data:text/plain;base64,",
    " data:image/png;base64,",
    "data:" + "x" * 300 + ";base64,",
)
# Only IP literals (in several spellings): none needs a DNS lookup, and every one is refused by the SSRF guard.
BLOCKED_URLS = (
    "http://127.0.0.1:1/x.png",
    "http://10.0.0.1/x.png",
    "http://169.254.169.254/latest/meta-data/",
    "https://[::1]/x.png",
    "http://0.0.0.0/x.png",
    "http://[::ffff:127.0.0.1]/x.png",
    "http://2130706433/x.png",
    "http://0x7f.0.0.1/x.png",
    "https://user:pass@192.168.0.1:8443/a.jpg",
)
ODD_URLS = (
    "file:///etc/passwd",
    "ftp://10.0.0.1/x.png",
    "javascript:alert(1)",
    "",
    "http://",
    "http://[::1",
    "//10.0.0.1/x.png",
    "http://127.0.0.1:99999/x.png",
)


@st.composite
def media_url(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["data", "data", "data", "data", "data", "blocked", "odd", "text"]))
    if kind == "data":
        return draw(st.sampled_from(DATA_URL_PREFIXES)) + draw(base64_text())
    if kind == "blocked":
        return draw(st.sampled_from(BLOCKED_URLS))
    if kind == "odd":
        return draw(st.sampled_from(ODD_URLS))
    return draw(st.text(max_size=30))


wrong_types = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from(["url", "data", "type", "source"]), st.integers(0, 9), max_size=2),
)
text_part = st.builds(lambda text: {"type": "text", "text": text}, st.text(max_size=30))

chat_parts = st.one_of(
    st.builds(lambda url: {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}, media_url()),
    st.builds(lambda url: {"type": "image_url", "image_url": url}, media_url()),
    st.builds(lambda wrong: {"type": "image_url", "image_url": wrong}, wrong_types),
    st.builds(lambda wrong: {"type": "image_url", "image_url": {"url": wrong}}, wrong_types),
    st.builds(lambda url: {"type": "video_url", "video_url": {"url": url}}, media_url()),
    st.builds(
        lambda data, fmt: {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
        base64_text(),
        st.sampled_from(["wav", "mp3", 3, None]),
    ),
    st.builds(lambda wrong: {"type": "input_audio", "input_audio": wrong}, wrong_types),
    text_part,
    wrong_types,
)

media_types = st.sampled_from(["image/jpeg", "image/png", "image/gif", "image/webp", "text/plain", "", None, 7])
anthropic_images = st.one_of(
    st.builds(
        lambda media_type, data: {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        },
        media_types,
        base64_text(),
    ),
    st.builds(lambda url: {"type": "image", "source": {"type": "url", "url": url}}, media_url()),
    st.builds(lambda wrong: {"type": "image", "source": wrong}, wrong_types),
    st.builds(lambda wrong: {"type": "image", "source": {"type": "base64", "data": wrong}}, wrong_types),
    st.builds(lambda wrong: {"type": "image", "source": {"type": "url", "url": wrong}}, wrong_types),
    st.builds(
        lambda kind: {"type": "image", "source": {"type": kind, "file_id": "file_1"}},
        st.sampled_from(["file", "text", "", None]),
    ),
)
anthropic_blocks = st.recursive(
    st.one_of(anthropic_images, text_part, wrong_types),
    lambda children: st.one_of(
        st.builds(lambda content: {"type": "tool_result", "tool_use_id": "t1", "content": content}, st.lists(children)),
        st.builds(lambda wrong: {"type": "tool_result", "tool_use_id": "t1", "content": wrong}, wrong_types),
    ),
    max_leaves=6,
)

responses_images = st.one_of(
    st.builds(lambda url: {"type": "input_image", "image_url": url, "detail": "auto"}, media_url()),
    st.builds(lambda wrong: {"type": "input_image", "image_url": wrong}, wrong_types),
    st.just({"type": "input_image", "file_id": "file-1"}),
    st.just({"type": "input_image", "file_id": None, "image_url": "data:image/png;base64,"}),
)
responses_items = st.recursive(
    st.one_of(
        responses_images, st.builds(lambda t: {"type": "input_text", "text": t}, st.text(max_size=20)), wrong_types
    ),
    lambda children: st.builds(
        lambda key, content: {"type": "message", "role": "user", key: content},
        st.sampled_from(["content", "output"]),
        st.lists(children, max_size=3),
    ),
    max_leaves=6,
)

PARTS = {CHAT: chat_parts, MESSAGES: anthropic_blocks, RESPONSES: responses_items}


def document(shape: str, parts: list[Any]) -> dict[str, Any]:
    if shape == CHAT:
        return {"model": "m", "messages": [{"role": "user", "content": parts}]}
    if shape == MESSAGES:
        return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": parts}]}
    return {"model": "m", "input": [{"role": "user", "content": parts}]}


HUGE_NUMBERS = (
    b"1e400",
    b"-1e400",
    b"1" + b"0" * 400,
    b"-0",
    b"1.5e-400",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"0.1e999999999",
    b"1E+2",
    b"01",
)


@st.composite
def structured_body(draw: st.DrawFn, route: str) -> bytes:
    # Mostly the route's own shape; sometimes another route's, which that route's finder must shrug off.
    shape = draw(st.sampled_from([route, route, route, *ROUTES]))
    parts = draw(st.lists(PARTS[shape], max_size=4))
    if parts and draw(st.integers(0, 9)) == 0:
        parts = parts * draw(st.integers(5, 12))  # past limits.max_media_items_per_request when they are media
    doc = document(shape, parts)
    if draw(st.booleans()):
        doc["stream"] = True
    number = draw(st.one_of(st.none(), st.sampled_from(HUGE_NUMBERS)))
    if number is not None:
        doc["max_tokens"] = "\x01number\x01"
    body = orjson.dumps(doc)
    return body if number is None else body.replace(b'"\\u0001number\\u0001"', number)


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
generic_json = st.one_of(
    json_values,
    st.fixed_dictionaries({"messages": json_values}),
    st.fixed_dictionaries({"input": json_values}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"content": json_values}), max_size=3)}),
).map(orjson.dumps)

raw_bodies = st.one_of(
    st.binary(max_size=256),
    st.binary(max_size=64).map(lambda junk: b'{"model":"' + junk + b'","messages":[]}'),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b'"x"',
            b"1",
            b"{",
            b"}",
            b"\xef\xbb\xbf{}",
            b'{"a":NaN}',
            b'{"a":"\\ud800"}',
            b'{"a":"\xff"}',
            b'{"a":"\xed\xa0\x80"}',
            b"{} x",
            b'{"a":1}{"b":2}',
            b"\x00",
            b'{"messages":' + b"1" * 5000 + b"}",
            b'{"messages":[{"content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,\\u0041AAA"}}]}]}',
            b'{"input":"data:image/png;base64,AAAA"}',
            b'{"messages":[{"role":"user","content":"data:image/png;base64,AAAA"}]}',
        ]
    ),
)


@st.composite
def deep_body(draw: st.DrawFn, route: str) -> bytes:
    """Nesting around orjson's depth limit of 1024, with a valid image at the bottom where the shape allows."""
    depth = draw(st.sampled_from([50, 508, 509, 510, 511, 512, 1022, 1023, 1024, 1025, 3000]))
    kind = draw(st.sampled_from(["arrays", "objects", "tool_result", "responses"]))
    image = base64.b64encode(tiny_jpeg())
    if kind == "arrays":
        return b'{"model":"m","x":' + b"[" * depth + b"]" * depth + b"}"
    if kind == "objects":
        return b'{"model":"m","x":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    if kind == "tool_result":
        leaf = b'{"type":"image","source":{"type":"base64","media_type":"image/jpeg","data":"' + image + b'"}}'
        nested = b'{"type":"tool_result","tool_use_id":"t","content":[' * depth + leaf + b"]}" * depth
        return b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":[' + nested + b"]}]}"
    leaf = b'{"type":"input_image","image_url":"data:image/jpeg;base64,' + image + b'"}'
    nested = b'{"type":"message","content":[' * depth + leaf + b"]}" * depth
    return b'{"model":"m","input":[' + nested + b"]}"


@st.composite
def big_body(draw: st.DrawFn, route: str) -> bytes:
    """Bodies from SKELETON_MIN_BODY_BYTES up to just past the raw-body cap: the placeholder parser's path."""
    size = draw(st.integers(SKELETON_MIN_BODY_BYTES, FUZZ_LIMITS["max_request_body_bytes"] + (64 << 10)))
    filler = b"A" * size
    kind = draw(st.sampled_from(["text", "image", "escaped_quote", "backslashes", "unterminated", "odd_quotes"]))
    if kind in ("text", "image"):
        parts: list[Any]
        if route == MESSAGES:
            parts = [{"type": "text", "text": "\x02"}]
            if kind == "image":
                data = base64.b64encode(images()["random_jpeg"]).decode()
                parts.append({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}})
        elif route == RESPONSES:
            parts = [{"type": "input_text", "text": "\x02"}]
            if kind == "image":
                parts.append({"type": "input_image", "image_url": data_url(images()["random_jpeg"])})
        else:
            parts = [{"type": "text", "text": "\x02"}]
            if kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": data_url(images()["random_jpeg"])}})
        return orjson.dumps(document(route, parts)).replace(b"\\u0002", filler)
    if kind == "escaped_quote":
        return b'{"model":"m","x":"' + filler + b'\\"","messages":[]}'
    if kind == "backslashes":
        run = draw(st.integers(1, 5))
        return b'{"model":"m","x":"' + filler + b"\\" * run + b'","messages":[]}'
    if kind == "unterminated":
        return b'{"model":"m","messages":[],"x":"' + filler
    return b'{"model":"m","x":"' + filler + b'"' * draw(st.integers(2, 3)) + b"}"


HEADER_SETS = (
    {"content-type": "application/json"},
    {},
    {"content-type": "text/plain"},
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "multipart/form-data; boundary=x"},
    {"content-type": "application/json; charset=latin-1"},
    {"content-type": "application/json", "content-encoding": "gzip"},
    {"content-type": "application/json", "x-request-id": "r" * 300},
    {"content-type": "application/json", "x-request-id": "\u00fc-latin-1".encode("latin-1")},
)


@dataclass(frozen=True)
class Case:
    route: str
    body: bytes
    headers: dict[str, str | bytes]
    chunked: bool

    def __repr__(self) -> str:  # hypothesis prints failing cases; a 2 MiB body is not useful there
        body = self.body if len(self.body) <= 600 else self.body[:300] + b"..." + self.body[-100:]
        return f"Case({self.route!r}, {len(self.body)} bytes {body!r}, {self.headers!r}, chunked={self.chunked})"


@st.composite
def cases(draw: st.DrawFn) -> Case:
    route = draw(st.sampled_from(ROUTES))
    body = draw(
        st.one_of(
            structured_body(route),
            structured_body(route),
            structured_body(route),
            generic_json,
            raw_bodies,
            deep_body(route),
            big_body(route),
        )
    )
    return Case(route, body, draw(st.sampled_from(HEADER_SETS)), draw(st.booleans()))


FUZZ_LIMITS: dict[str, Any] = {
    "max_request_body_bytes": 2 << 20,  # above SKELETON_MIN_BODY_BYTES, so the placeholder parser runs
    "max_multimodal_cpu_bytes_per_request": 4 << 20,
    "max_multimodal_cpu_bytes": 8 << 20,
    "max_media_items_per_request": 16,
}
FUZZ_EXAMPLES = 400


def _edge_case(route: str, body: bytes, chunked: bool = False) -> Case:
    return Case(route, body, {"content-type": "application/json"}, chunked)


@pytest.mark.timeout(80)
def test_generated_bodies_get_documented_answers(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    app.state.sse_release.set()  # generated `"stream": true` bodies get their whole event stream at once
    statuses: Counter[int] = Counter()
    sent = 0
    with (
        make_gateway(upstream, limits=FUZZ_LIMITS, media={"load_workers": 2}, server=SERVER) as (gateway, url),
        httpx.Client(base_url=url, timeout=ANSWER_WITHIN_S * 2) as client,
    ):

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )
        @given(case=cases())
        @example(case=_edge_case(CHAT, b""))
        @example(case=_edge_case(MESSAGES, b"", chunked=True))
        @example(case=_edge_case(RESPONSES, b"[1]"))
        @example(case=_edge_case(CHAT, chat_body(data_url(images()["over_cap"]))))
        @example(case=_edge_case(MESSAGES, messages_body(images()["png_bomb"], media_type="image/png")))
        @example(case=_edge_case(RESPONSES, responses_body(data_url(images()["gif_animated"], "image/gif"))))
        @example(case=_edge_case(CHAT, b"x" * ((2 << 20) + 1)))
        @example(case=_edge_case(CHAT, b"x" * ((2 << 20) + 1), chunked=True))
        @example(case=_edge_case(CHAT, chat_body(data_url(images()["jpeg_bomb"]))))
        @example(case=_edge_case(RESPONSES, responses_body(*[data_url(images()["jpeg"])] * 17)))
        def check(case: Case) -> None:
            nonlocal sent
            sent += 1
            started = time.monotonic()
            content: Any = iter([case.body]) if case.chunked else case.body
            response = client.post(case.route, content=content, headers=case.headers)
            # Answered, not left waiting on a timeout: each of these takes tens of milliseconds even on a loaded
            # machine, and a wait for media.decode_timeout_s (10 s) or any longer timeout fails this bound.
            assert time.monotonic() - started < ANSWER_WITHIN_S
            status = response.status_code
            statuses[status] += 1
            assert status in DOCUMENTED, (status, response.text[:500])
            # One request at a time to a healthy upstream: nothing can time out, queue or fail upstream.
            assert status in (200, 400, 413), (status, response.text[:500])
            if status == 200:
                # Forwarded: the stub's echo or its event stream, not something the gateway made up.
                assert response.headers.get("x-upstream-header") == "kept" or response.headers[
                    "content-type"
                ].startswith("text/event-stream"), response.headers
            else:
                assert_gateway_error(case.route, response)

        check()
        settle(gateway, url)
        # Every request was answered and counted exactly once.
        wait_until(lambda: answered(url).total() == sent, 5, f"an answer counted for each of the {sent} requests")
        assert answered(url) == statuses
        assert metric(url, "mmgate_inflight_requests") == 1  # the scrape itself
    # The mix reached each kind of answer, not only the parser's 400.
    assert statuses[200] > 20
    assert statuses[400] > 20
    assert statuses[413] > 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("junk", [b"\xff", b"\n", b"\xed\xa0\x80"], ids=["invalid-utf8", "control-char", "surrogate"])
def test_malformed_long_literal_in_a_big_body_is_400(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, junk: bytes
) -> None:
    app, upstream = stub
    head, tail = b'{"model":"m","messages":[{"role":"user","content":"', b'"}]}'
    big = head + b"A" * SKELETON_MIN_BODY_BYTES + junk + tail
    small = head + b"A" + junk + tail
    with make_gateway(upstream, limits={"max_request_body_bytes": 2 << 20}, server=SERVER) as (gateway, url):
        refused_small = httpx.post(url + CHAT, content=small, timeout=ANSWER_WITHIN_S)
        refused_big = httpx.post(url + CHAT, content=big, timeout=ANSWER_WITHIN_S)
        settle(gateway, url)
    assert refused_small.status_code == 400  # the same malformed JSON in a small body
    assert refused_big.status_code == 400, refused_big.text[:200]
    assert "not valid JSON" in assert_gateway_error(CHAT, refused_big)
    assert app.state.requests == []


# --- 2. fault injection ----------------------------------------------------------------------------------------


@pytest.fixture
def fault() -> Iterator[FaultUpstream]:
    with FaultUpstream() as upstream:
        yield upstream


def image_bodies() -> list[tuple[str, bytes]]:
    jpeg = tiny_jpeg()
    return [
        (CHAT, chat_body(data_url(jpeg))),
        (MESSAGES, messages_body(jpeg)),
        (RESPONSES, responses_body(data_url(jpeg))),
    ]


@pytest.mark.timeout(30)
def test_upstream_refusing_connections_is_502(make_gateway: GatewayFactory) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with make_gateway(closed, limits=ONE_SLOT, server=SERVER) as (gateway, url):
        for route, body in [*image_bodies(), (CHAT, chat_body())]:
            response = httpx.post(url + route, content=body, timeout=ANSWER_WITHIN_S)
            assert response.status_code == 502
            assert "unreachable" in assert_gateway_error(route, response)
        settle(gateway, url)
        assert metric(url, "mmgate_upstream_errors_total", kind="connect") == 4
        assert httpx.get(url + "/healthz", timeout=5).status_code == 200


@pytest.mark.timeout(30)
def test_upstream_hanging_before_headers_is_504(fault: FaultUpstream, make_gateway: GatewayFactory) -> None:
    with make_gateway(fault.url, limits=ONE_SLOT, upstream={"read_timeout_s": 0.5}, server=SERVER) as (gateway, url):
        for route, body in [*image_bodies(), (CHAT, chat_body())]:
            started = time.monotonic()
            response = httpx.post(url + route, content=body, headers={"x-fault": "hang"}, timeout=ANSWER_WITHIN_S)
            assert response.status_code == 504
            assert "upstream.read_timeout_s=0.5" in assert_gateway_error(route, response)
            # The gateway's timeout answered (the message names it), never early, and long before the upstream's
            # 30 s hang or the client's own timeout would have ended the wait.
            assert 0.5 * 0.9 <= time.monotonic() - started < ANSWER_WITHIN_S
        settle(gateway, url)
        # The gateway closed every upstream request it gave up on.
        assert fault.wait_until(lambda f: f.peer_closed["hang"] == 4, 2), fault.peer_closed
        assert metric(url, "mmgate_upstream_errors_total", kind="read_timeout") == 4
        still_serves(url)


@pytest.mark.timeout(30)
def test_upstream_closing_without_an_answer_is_502(fault: FaultUpstream, make_gateway: GatewayFactory) -> None:
    with make_gateway(fault.url, limits=ONE_SLOT, server=SERVER) as (gateway, url):
        still_serves(url)  # a pooled keep-alive connection exists before the upstream starts closing them
        for route, body in [*image_bodies(), (CHAT, chat_body())]:
            response = httpx.post(url + route, content=body, headers={"x-fault": "close"}, timeout=ANSWER_WITHIN_S)
            assert response.status_code == 502
            assert_gateway_error(route, response)
        settle(gateway, url)
        still_serves(url)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["garbage", "big_header"])
def test_upstream_speaking_broken_http_is_502(fault: FaultUpstream, make_gateway: GatewayFactory, mode: str) -> None:
    with make_gateway(fault.url, limits=ONE_SLOT, server=SERVER) as (gateway, url):
        for route, body in [*image_bodies(), (CHAT, chat_body())]:
            response = httpx.post(url + route, content=body, headers={"x-fault": mode}, timeout=ANSWER_WITHIN_S)
            assert response.status_code == 502
            assert_gateway_error(route, response)
        settle(gateway, url)
        assert metric(url, "mmgate_upstream_errors_total", kind="protocol") == 4
        still_serves(url)


@pytest.mark.timeout(30)
def test_upstream_body_shorter_than_its_length_truncates_the_client(
    fault: FaultUpstream, make_gateway: GatewayFactory
) -> None:
    with make_gateway(fault.url, limits=ONE_SLOT, server=SERVER) as (gateway, url):
        for route, body in [*image_bodies(), (CHAT, chat_body())]:
            # The status is out before the body falls short: the client sees a body that ends too soon.
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.post(url + route, content=body, headers={"x-fault": "short_body"}, timeout=ANSWER_WITHIN_S)
        settle(gateway, url)
        wait_until(lambda: metric(url, "mmgate_inflight_requests") == 1, 2)
        still_serves(url)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("release_on", ["first_byte", "complete"])
def test_upstream_reset_mid_stream_truncates_the_client_and_frees_everything(
    fault: FaultUpstream, make_gateway: GatewayFactory, release_on: str
) -> None:
    limits = {**ONE_SLOT, "release_on": release_on}
    with make_gateway(fault.url, limits=limits, server=SERVER) as (gateway, url):
        lines: list[str] = []
        error: Exception | None = None
        with httpx.stream(
            "POST",
            url + CHAT,
            content=chat_body(data_url(tiny_jpeg()), stream=True),
            headers={"x-fault": "reset"},
            timeout=ANSWER_WITHIN_S,
        ) as response:
            assert response.status_code == 200
            try:
                lines.extend(response.iter_lines())
            except httpx.TransportError as exc:
                error = exc
        assert 'data: {"n": 1}' in lines
        assert "data: [DONE]" not in lines
        # The gateway cannot change a status already sent: the client learns of the failure from a body that
        # never ends properly.
        assert isinstance(error, httpx.RemoteProtocolError), error
        settle(gateway, url)
        assert metric(url, "mmgate_upstream_errors_total", kind="protocol") == 1
        assert metric(url, "mmgate_inflight_requests") == 1  # the scrape itself
        still_serves(url)


@pytest.mark.timeout(30)
def test_client_leaving_while_queued_for_the_budget(fault: FaultUpstream, make_gateway: GatewayFactory) -> None:
    with make_gateway(fault.url, limits=ONE_SLOT, server=SERVER) as (gateway, url):
        results: list[httpx.Response] = []
        holder = threading.Thread(
            target=lambda: results.append(
                httpx.post(url + CHAT, content=chat_body(data_url(tiny_jpeg())), headers={"x-fault": "slow=1.0"})
            )
        )
        holder.start()
        wait_until(lambda: gateway.budget.in_use == SLOT, 5)
        leaver = send_and_keep(url, MESSAGES, messages_body(tiny_jpeg(), tiny_jpeg()))
        wait_until(lambda: gateway.budget.waiting == 1, 5)
        leaver.close()
        # It leaves the queue at once, while the holder still holds the only slot.
        wait_until(lambda: gateway.budget.waiting == 0, 0.5)
        assert gateway.budget.in_use == SLOT
        holder.join(10)
        assert results[0].status_code == 200
        settle(gateway, url)
        assert fault.received == Counter({"slow": 1})  # nothing of the leaver's request went upstream
        assert metric(url, "mmgate_requests_total", route=MESSAGES, code="499") == 1
        still_serves(url)


@pytest.mark.timeout(30)
def test_client_leaving_while_its_media_decode(fault: FaultUpstream, make_gateway: GatewayFactory) -> None:
    slow = data_url(slow_jpeg())
    items = 6  # about 0.2 s of decoding each, one at a time
    limits = {
        "budget_mode": "slots",
        "max_multimodal_cpu_bytes": 256 << 20,
        "max_multimodal_cpu_bytes_per_request": 256 << 20,
    }
    # Full decodes: the structure check (media.decode: check) of these JPEGs is too quick to be caught running.
    media = {"load_workers": 1, "decode": "full"}
    with make_gateway(fault.url, limits=limits, media=media, server=SERVER) as (gateway, url):
        leaver = send_and_keep(url, CHAT, chat_body(*[slow] * items))
        wait_until(lambda: gateway.budget.in_use > 0, 5)
        time.sleep(0.1)  # the first decode is under way
        leaver.close()
        wait_until(lambda: gateway.budget.in_use == 0, 10, "the leaver's reservation to come back")
        started = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        decoded = metric(url, "mmgate_media_decode_seconds_count", modality="image")
        # Back before the decodes ran out: the request's end stopped them, they did not end it.
        assert decoded < items
        time.sleep(1.5)  # long enough for all of them, had they gone on
        # Nothing started or finished after the request was gone: the rest were never started, and the decode
        # under way was stopped.
        assert metric(url, "mmgate_media_items_total", modality="image", source="data_url") == started < items
        assert metric(url, "mmgate_media_decode_seconds_count", modality="image") == decoded
        settle(gateway, url)
        assert sum(fault.received.values()) == 0
        still_serves(url)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("media", [True, False], ids=["media", "text"])
def test_client_leaving_while_awaiting_upstream_headers(
    fault: FaultUpstream, make_gateway: GatewayFactory, media: bool
) -> None:
    body = chat_body(data_url(tiny_jpeg())) if media else chat_body()
    with make_gateway(fault.url, limits=ONE_SLOT, upstream={"read_timeout_s": 10}, server=SERVER) as (gateway, url):
        leaver = send_and_keep(url, CHAT, body, {"x-fault": "hang"})
        assert fault.wait_until(lambda f: f.waiting["hang"] == 1, 5)
        assert gateway.budget.in_use == (SLOT if media else 0)
        leaver.close()
        # The gateway closes the upstream request at once and gives the budget back.
        assert fault.wait_until(lambda f: f.peer_closed["hang"] == 1, 1.0), "upstream request left open"
        settle(gateway, url, timeout_s=0.5)
        still_serves(url)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("release_on", ["first_byte", "complete"])
def test_client_leaving_mid_stream(fault: FaultUpstream, make_gateway: GatewayFactory, release_on: str) -> None:
    limits = {**ONE_SLOT, "release_on": release_on}
    with make_gateway(fault.url, limits=limits, server=SERVER) as (gateway, url):
        leaver = send_and_keep(url, CHAT, chat_body(data_url(tiny_jpeg()), stream=True), {"x-fault": "stall"})
        received = b""
        while b'data: {"n": 1}' not in received:
            chunk = leaver.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        assert gateway.budget.in_use == (SLOT if release_on == "complete" else 0)
        leaver.close()
        assert fault.wait_until(lambda f: f.peer_closed["stall"] == 1, 1.0), "upstream stream left open"
        settle(gateway, url, timeout_s=1.0)
        wait_until(lambda: metric(url, "mmgate_inflight_requests") == 1, 2)
        still_serves(url)


# --- 3. a short soak ---------------------------------------------------------------------------------------------

SOAK_S = 10.0
SOAK_CLIENTS = 20
SOAK_LIMITS: dict[str, Any] = {
    "max_multimodal_cpu_bytes": 4 * (256 << 10),  # four slots
    "max_multimodal_cpu_bytes_per_request": 256 << 10,
    "admission_timeout_s": 2.0,
    "max_queued_requests": 64,
}
# kind: (weight, statuses a client may see). 429 is always possible: the budget may stay full past its timeout.
SOAK_KINDS: dict[str, tuple[int, frozenset[int]]] = {
    "text": (4, frozenset({200})),
    "image": (5, frozenset({200, 429})),
    "stream": (2, frozenset({200, 429})),
    "over_cap": (2, frozenset({413, 429})),
    "corrupt": (1, frozenset({400, 429})),
    "slow": (1, frozenset({200, 429})),
    "hang": (1, frozenset({504, 429})),
    "close": (1, frozenset({502, 429})),
    "reset": (1, frozenset({200, 429})),  # 200, then a truncated stream
    "leave": (2, frozenset()),
}
FAULTS = {"slow": "slow=0.2", "hang": "hang", "close": "close", "reset": "reset", "stream": "sse"}


@cache
def soak_bodies() -> dict[str, bytes]:
    small = [data_url(image_bytes(32, 32, seed=i)) for i in range(2)]
    corrupt = data_url(image_bytes(64, 64)[:300])
    return {
        "text": chat_body(),
        "image": chat_body(*small),
        "image_messages": messages_body(image_bytes(32, 32)),
        "image_responses": responses_body(*small),
        "stream": chat_body(small[0], stream=True),
        "over_cap": chat_body(data_url(solid(400, "PNG"))),  # 480,000 decoded bytes, over the 256 KiB share
        "corrupt": chat_body(corrupt),
    }


async def _soak(url: str) -> tuple[Counter[tuple[str, Any]], int]:
    outcomes: Counter[tuple[str, Any]] = Counter()
    sent = 0
    bodies = soak_bodies()
    kinds = list(SOAK_KINDS)
    weights = [SOAK_KINDS[kind][0] for kind in kinds]
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + SOAK_S

    async def leave(rng: random.Random) -> str:
        """A whole media request on its own connection, then gone after 0-100 ms: queued, decoding, awaiting
        headers (`slow`) or mid-stream (`stall`)."""
        fault = rng.choice(["", "slow=0.3", "stall"])
        body = bodies["stream"] if fault == "stall" else bodies["image"]
        extra = f"x-fault: {fault}\r\n" if fault else ""
        head = f"POST {CHAT} HTTP/1.1\r\nhost: g\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head.encode() + body)
        await writer.drain()
        await asyncio.sleep(rng.random() * 0.1)
        writer.close()
        await writer.wait_closed()
        return "left"

    async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> Any:
        if kind == "leave":
            return await leave(rng)
        route = CHAT
        body = bodies.get(kind, bodies["image"])
        if kind == "image":
            route = rng.choice(ROUTES)
            body = {CHAT: bodies["image"], MESSAGES: bodies["image_messages"], RESPONSES: bodies["image_responses"]}[
                route
            ]
        headers = {"x-fault": FAULTS[kind]} if kind in FAULTS else {}
        async with client.stream("POST", url + route, content=body, headers=headers) as response:
            try:
                await response.aread()
            except httpx.RemoteProtocolError:
                assert kind == "reset", kind
                return "truncated"
            if response.status_code != 200:
                assert_gateway_error(route, response)
            return response.status_code

    async def worker(seed: int, client: httpx.AsyncClient) -> None:
        nonlocal sent
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            sent += 1
            outcomes[(kind, await one(client, kind, rng))] += 1

    limits = httpx.Limits(max_connections=SOAK_CLIENTS, max_keepalive_connections=SOAK_CLIENTS)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:
        await asyncio.gather(*(worker(seed, client) for seed in range(SOAK_CLIENTS)))
    return outcomes, sent


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_soak_conserves_the_budget(fault: FaultUpstream, make_gateway: GatewayFactory) -> None:
    # The read timeout is 10 times the slow fault's 0.2 s: on a loaded machine a slow answer still comes within it.
    with make_gateway(
        fault.url, limits=SOAK_LIMITS, media={"load_workers": 2}, upstream={"read_timeout_s": 2.0}, server=SERVER
    ) as (gateway, url):
        outcomes, sent = asyncio.run(_soak(url))
        settle(gateway, url)
        # Leavers the gateway was still serving finish within the upstream's read timeout.
        wait_until(lambda: answered(url).total() == sent, 5, f"an answer counted for each of the {sent} requests")
        wait_until(lambda: metric(url, "mmgate_inflight_requests") == 1, 2)
        codes = answered(url)
        still_serves(url)
    for (kind, outcome), _ in outcomes.items():
        allowed = SOAK_KINDS[kind][1]
        if kind == "leave":
            assert outcome == "left"
        elif kind == "reset" and outcome == "truncated":
            pass
        else:
            assert outcome in allowed, (kind, outcome, outcomes)
    # 5xx only from the injected faults, each one accounted for.
    assert {code for code in codes if code >= 500} <= {502, 504}, codes
    assert codes[502] == outcomes[("close", 502)]
    assert codes[504] == outcomes[("hang", 504)]
    # Every kind happened and most requests were served, not refused.
    assert {kind for kind, _ in outcomes} == set(SOAK_KINDS)
    assert outcomes[("image", 200)] > outcomes[("image", 429)]
    assert sent > 200
