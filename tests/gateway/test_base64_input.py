"""`Base64Input`: the bytes base64 text encodes, read by range without decoding the rest; and the probe that sizes
a request in bytes mode reads an inline video's or audio's header through it, so each item's base64 is decoded
once (by the load), not twice."""

from __future__ import annotations

import base64
import os
from typing import Any

import httpx
import pytest

import gateway.base64_input
import gateway.modality_loader
from gateway.base64_input import Base64Input
from gateway.errors import BadRequest
from tests.conftest import GatewayFactory
from tests.gateway.stub_upstream import StubUpstream
from tests.gateway.test_audio_decode import make_audio
from tests.gateway.test_audio_loader import audio_body
from tests.gateway.test_video_decode import make_video
from tests.gateway.test_video_loader import CHAT, mp4_url, video_body


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 299, 300, 301])
def test_every_range_reads_the_bytes_the_text_encodes(size: int) -> None:
    data = os.urandom(size)
    source = Base64Input(memoryview(base64.b64encode(data)), "x")
    assert len(source) == size
    for start in range(min(size, 8)):
        for length in (0, 1, 2, 3, 4, 7, size):
            source.seek(start)
            assert source.read(length) == data[start : start + length], (start, length)
    source.seek(-min(size, 2), 2)
    assert source.read() == data[len(data) - min(size, 2) :]
    source.seek(size + 10)
    assert source.read(5) == b""
    source.seek(0)
    assert source.read() == data
    assert source.tell() == size


def test_a_range_with_characters_outside_base64_is_a_400_naming_the_item() -> None:
    text = bytearray(base64.b64encode(os.urandom(300)))
    text[200] = ord("*")
    source = Base64Input(memoryview(bytes(text)), "messages[0].content[1].video_url")
    assert source.read(100) == base64.b64decode(bytes(text[:136]))[:100]  # the range before it reads
    source.seek(140)
    with pytest.raises(BadRequest, match=r"^messages\[0\]\.content\[1\]\.video_url: invalid base64 data"):
        source.read(20)
    with pytest.raises(BadRequest, match="invalid base64 data"):
        Base64Input(memoryview(b"QUJD" + b"QU"), "x")  # not a whole number of 4-character groups


@pytest.fixture
def full_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the whole-item base64 decodes (inline items) and of the ranges the probes decode."""
    calls: list[int] = []
    original = gateway.modality_loader.decode_base64

    def counting(payload: Any, locator: str) -> bytes:
        calls.append(len(payload))
        return original(payload, locator)

    monkeypatch.setattr(gateway.modality_loader, "decode_base64", counting)
    return calls


@pytest.mark.parametrize("modality", ["video", "audio"])
def test_bytes_mode_decodes_an_inline_item_once_and_the_probe_reads_its_header_only(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    full_decodes: list[int],
    monkeypatch: pytest.MonkeyPatch,
    modality: str,
) -> None:
    ranges: list[int] = []
    original = gateway.base64_input.decode_base64

    def counting(payload: Any, locator: str) -> bytes:
        ranges.append(len(payload))
        return original(payload, locator)

    monkeypatch.setattr(gateway.base64_input, "decode_base64", counting)
    app, upstream = stub
    if modality == "video":
        data = make_video("mpeg4", "mp4", frames=1500, gop=1)
        body = video_body(mp4_url(data))
    else:
        data = make_audio("pcm_s16le", "wav", seconds=20.0)
        body = audio_body(data)
    encoded = len(base64.b64encode(data))
    with make_gateway(upstream, limits={"budget_mode": "bytes"}, media={"video": {"num_frames": 4}}) as (_, url):
        response = httpx.post(url + CHAT, content=body)
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    # The load decoded the whole item once; the probe decoded parts of it, less than half in all.
    assert full_decodes == [encoded]
    assert ranges
    assert sum(ranges) < encoded / 2
