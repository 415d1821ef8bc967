from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.media.body import (
    _PLACEHOLDER_PREFIX,
    _PLACEHOLDER_TOKEN,
    LONG_STRING_BYTES,
    SKELETON_MIN_BODY_BYTES,
    parse_request_body,
    string_spans,
)


def _big_b64(n: int = 900_000) -> str:
    return base64.b64encode(os.urandom(n)).decode()


def test_long_literals_resolve_to_views_of_the_raw_body() -> None:
    payload = "data:image/png;base64," + _big_b64()
    raw = orjson.dumps({"messages": [{"content": [{"image_url": {"url": payload}}, {"text": "hi"}]}]})
    assert len(raw) >= SKELETON_MIN_BODY_BYTES
    parsed = parse_request_body(raw)
    value = parsed.document["messages"][0]["content"][0]["image_url"]["url"]
    assert len(value) < 64  # the skeleton holds a placeholder, not a copy
    resolved = parsed.resolve(value)
    assert isinstance(resolved, memoryview)
    assert resolved.obj is raw  # zero copy
    assert bytes(resolved) == payload.encode()
    assert parsed.document["messages"][0]["content"][1]["text"] == "hi"


def test_short_and_escaped_strings_parse_as_usual() -> None:
    escaped = 'quote " backslash \\ newline \n ' * 200  # long, but holds escapes
    raw = orjson.dumps({"a": escaped, "b": "x" * (LONG_STRING_BYTES - 1), "c": _big_b64()})
    parsed = parse_request_body(raw)
    assert parsed.resolve(parsed.document["a"]) == escaped
    assert parsed.resolve(parsed.document["b"]) == "x" * (LONG_STRING_BYTES - 1)
    assert bytes(parsed.resolve(parsed.document["c"])) == orjson.loads(raw)["c"].encode()


def test_document_equals_a_plain_parse_after_resolving() -> None:
    doc = {
        'k"ey': ["v", 1, 2.5, None, True, {"x": _big_b64(700_000)}],
        "t": '\\"' + "A" * 5000 + "\\",
        "u": "\u00e9" * 3000,
    }
    raw = orjson.dumps(doc)
    parsed = parse_request_body(raw)

    def resolve_all(node: object) -> object:
        if isinstance(node, dict):
            return {k: resolve_all(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve_all(v) for v in node]
        if isinstance(node, str):
            value = parsed.resolve(node)
            return value if isinstance(value, str) else bytes(value).decode()
        return node

    assert resolve_all(parsed.document) == doc


def test_client_cannot_forge_a_placeholder() -> None:
    raw = orjson.dumps({"url": "\x00mmgate-0000000000000000:0", "pad": _big_b64()})
    parsed = parse_request_body(raw)
    assert parsed.resolve(parsed.document["url"]) == "\x00mmgate-0000000000000000:0"


@pytest.mark.parametrize("raw", [b"{", b'{"a": }', b"", b'{"a": "' + b"A" * (2 << 20), b"\xff\xfe"])
def test_malformed_json_is_400(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request_body(raw)


@pytest.mark.parametrize("index", ["0", "1", "99", "-1", "x"])
def test_a_client_that_knows_the_token_still_cannot_forge_a_placeholder(index: str) -> None:
    forged = _PLACEHOLDER_PREFIX + index
    pad = _big_b64()
    raw = orjson.dumps({"url": forged, "pad": pad, "more": _big_b64()})
    parsed = parse_request_body(raw)
    assert parsed.resolve(parsed.document["url"]) == forged
    resolved = parsed.resolve(parsed.document["pad"])
    assert (resolved if isinstance(resolved, str) else bytes(resolved).decode()) == pad


def test_the_token_inside_a_long_literal_is_never_parsed_and_leaves_the_literals_swapped() -> None:
    pad = _big_b64(450_000) + _PLACEHOLDER_TOKEN + _big_b64(450_000)
    raw = orjson.dumps({"pad": pad, "text": "hi"})
    parsed = parse_request_body(raw)
    resolved = parsed.resolve(parsed.document["pad"])
    assert isinstance(resolved, memoryview)
    assert bytes(resolved).decode() == pad
    # The same token as a value of its own, outside the long literal: the body is parsed directly.
    raw = orjson.dumps({"pad": pad, "text": _PLACEHOLDER_TOKEN})
    parsed = parse_request_body(raw)
    assert parsed.resolve(parsed.document["pad"]) == pad


def test_a_small_body_never_resolves_a_placeholder() -> None:
    forged = _PLACEHOLDER_PREFIX + "0"
    parsed = parse_request_body(orjson.dumps({"url": forged}))
    assert parsed.resolve(parsed.document["url"]) == forged


@pytest.mark.parametrize("junk", [b"\xff", b"\n", b"\x01", b"\xed\xa0\x80"])
def test_malformed_json_inside_a_long_literal_is_400(junk: bytes) -> None:
    raw = b'{"pad": "' + b"A" * SKELETON_MIN_BODY_BYTES + junk + b'"}'
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request_body(raw)


def test_long_literals_with_text_beyond_ascii_are_parsed_by_orjson() -> None:
    text = "é" * LONG_STRING_BYTES
    raw = orjson.dumps({"text": text, "pad": "B" * SKELETON_MIN_BODY_BYTES})
    parsed = parse_request_body(raw)
    assert parsed.document["text"] == text
    assert len(parsed.spans) == 1


json_documents = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=30,
)


def _string_leaves(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _string_leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _string_leaves(value, (*path, index))


@settings(max_examples=300, deadline=None)
@given(document=json_documents, indent=st.booleans())
def test_string_spans_find_each_string_where_the_parser_read_it(document: Any, indent: bool) -> None:
    raw = orjson.dumps(document, option=orjson.OPT_INDENT_2 if indent else 0)
    leaves = dict(_string_leaves(document))
    spans = string_spans(raw, leaves)
    assert set(spans) == set(leaves)
    for path, (start, end) in spans.items():
        assert orjson.loads(raw[start:end]) == leaves[path]


def test_string_spans_read_a_repeated_key_as_its_last_value_and_skip_what_is_not_asked() -> None:
    raw = (
        b'{"a": {"u": "first", "x": [1, {"u": "no"}], "u": "last"}, "b": "\\"quoted\\" \\\\", "c": ["'
        + b"A" * 5000
        + b'"]}'
    )
    spans = string_spans(raw, [("a", "u"), ("b",), ("c", 0)])
    assert raw[slice(*spans[("a", "u")])] == b'"last"'
    assert orjson.loads(raw[slice(*spans[("b",)])]) == '"quoted" \\'
    assert raw[slice(*spans[("c", 0)])] == b'"' + b"A" * 5000 + b'"'
    assert string_spans(raw, [("a", "x", 1, "u"), ("missing",)]) == {
        ("a", "x", 1, "u"): (raw.index(b'"no"'), raw.index(b'"no"') + 4)
    }


# Bodies of about 8 MiB in the shapes that parse into the most memory a byte, and text: (Python expression, N=size).
PARSE_SHAPES = {
    "empty objects": 'b"[" + b"{}," * (N // 3) + b"{}]"',
    "empty lists": 'b"[" + b"[]," * (N // 3) + b"[]]"',
    "small numbers": 'b"[" + b"1," * (N // 2) + b"1]"',
    "floats": 'b"[" + b"1.5," * (N // 4) + b"1]"',
    "one-letter strings": 'b"[" + b\'"a",\' * (N // 4) + b\'"a"]\'',
    "distinct strings": 'b"[" + b",".join(b\'"%d"\' % i for i in range(N // 9)) + b"]"',
    "object entries": 'b"{" + b",".join(b\'"k%d":1\' % i for i in range(N // 10)) + b"}"',
    "objects of one entry": 'b"[" + b\'{"a":[]},\' * (N // 9) + b"{}]"',
    "escaped text": 'b\'{"text":"\' + b"a\\\\n" * (N // 3) + b\'"}\'',
    "text past U+FFFF": "b'[\"\\\\ud83d\\\\ude00' + b\"a\" * N + b'\"]'",
}
_MEASURE_PARSE = """
import sys
from gateway.media.body import prepare_body
from tests.observe import process_memory, reset_peak
N = 8 << 20
prepared = prepare_body({expression})
before = reset_peak("self")
parsed = prepared.parse()
print(process_memory("self", "VmHWM") - before, prepared.parse_bytes)
"""


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(PARSE_SHAPES))
def test_what_parsing_allocates_is_within_its_bound(shape: str) -> None:
    """Peak RSS of parsing a body (in a fresh interpreter) against `PreparedBody.parse_bytes`, the bound held
    against limits.max_buffered_body_bytes before the body is parsed: it covers the peak, and is no more than
    4 times it where the body is mostly tokens (2 times and less for most shapes)."""
    import subprocess
    import sys

    from tests.servers import ROOT

    code = _MEASURE_PARSE.format(expression=PARSE_SHAPES[shape])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    peak, bound = (int(value) for value in out.stdout.split())
    assert peak <= bound <= 4 * peak, f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
