"""gateway.media.sources.inline: where a data URL's payload starts, read from its head alone, the same for a view of the
body and for a string, and the refusals naming the item; `Base64Input`: the bytes base64 text encodes, read by range
without decoding the rest, and checked whole a piece at a time; the probe that sizes a request in bytes mode and the
load both read an inline video or audio through it, so no decoded copy of the item is ever made."""

from __future__ import annotations

import base64
import os
import re
from typing import Any

import httpx
import pytest

import gateway.media.sources.inline
from gateway.errors import BadRequest
from gateway.media.body import SKELETON_MIN_BODY_BYTES
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.sources.inline import (
    CHECK_CHARS,
    Base64Input,
    data_url_start,
    decode_base64,
    inline_payload,
    payload_head,
    split_data_url,
)
from tests.conftest import GatewayFactory
from tests.gateway.media.audio.test_decode import make_audio
from tests.gateway.media.audio.test_loader import audio_body
from tests.gateway.media.video.test_decode import make_video
from tests.gateway.media.video.test_loader import CHAT, mp4_url, video_body
from tests.gateway.stub_upstream import StubUpstream

# A text part that makes a body over SKELETON_MIN_BODY_BYTES: its long literals are parsed as views of the body.
LONG_TEXT = "words " * (SKELETON_MIN_BODY_BYTES // 6)


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("source", [Source.DATA_URL, Source.BASE64])
def test_payload_head_is_the_start_of_the_payload(source: Source, as_view: bool) -> None:
    text = base64.b64encode(bytes(range(256)) * 40).decode()
    value = "data:image/jpeg;base64," + text if source is Source.DATA_URL else text
    ref = MediaRef(Modality.IMAGE, source, "x", memoryview(value.encode()) if as_view else value)
    whole = inline_payload(ref)
    assert bytes(whole.encode() if isinstance(whole, str) else whole) == text.encode()
    for chars in (0, 4, 1000, len(text), len(text) + 10):
        head = payload_head(ref, chars)
        assert bytes(head.encode() if isinstance(head, str) else head) == text.encode()[:chars]


@pytest.mark.parametrize("as_view", [False, True])
def test_the_payload_starts_after_the_comma_and_the_media_type_is_lowercased(as_view: bool) -> None:
    text = "data:Video/MP4;codecs=avc1;base64,QUJD" + "QUJD" * 1000
    value = memoryview(text.encode()) if as_view else text
    assert data_url_start(value, "x") == ("video/mp4", 34)
    media_type, payload = split_data_url(value, "x")
    assert media_type == "video/mp4"
    assert decode_base64(payload, "x") == b"ABC" * 1001


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("QUJD", "messages[0].content[1].video_url: not a data URL"),
        ("data:video/mp4;base64" + "A" * 300 + ",QUJD", "not a data URL"),  # no comma in the head
        ("data:video/mp4,QUJD", "only base64 data URLs are accepted, got data:video/mp4"),
        ("data:vidéo/mp4;utf8,QUJD", "only base64 data URLs are accepted, got data:vid\ufffdo/mp4;utf8"),
    ],
)
def test_what_is_not_a_base64_data_url_is_a_400_naming_the_item(value: str, message: str) -> None:
    for form in (value, memoryview(value.encode("latin-1"))):
        with pytest.raises(BadRequest, match=re.escape(message)):
            data_url_start(form, "messages[0].content[1].video_url")


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


def test_a_string_and_a_data_urls_offset_read_as_the_view_does() -> None:
    data = os.urandom(1000)
    text = "data:video/mp4;base64," + base64.b64encode(data).decode()
    for value in (text, memoryview(text.encode())):
        source = Base64Input(value, "x", start=22)
        assert len(source) == 1000
        source.seek(301)
        assert source.read(97) == data[301:398]
        source.check()
    with pytest.raises(BadRequest, match=r"^x: invalid base64 data"):
        Base64Input(text[:500] + "\u00e9" + text[501:], "x", start=22).check()  # not ASCII


def test_check_refuses_what_decoding_the_whole_text_refuses_holding_one_piece_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces of 16 characters: a bad character anywhere, and padding that ends a piece but not the text, are
    refused as the whole text is; good text of any length passes; no decode is longer than a piece and a group."""
    monkeypatch.setattr(gateway.media.sources.inline, "CHECK_CHARS", 16)
    pieces: list[int] = []

    def counting(payload: Any, locator: str) -> bytes:
        pieces.append(len(payload))
        return decode_base64(payload, locator)

    monkeypatch.setattr(gateway.media.sources.inline, "decode_base64", counting)
    for size in (0, 1, 11, 12, 13, 24, 100):
        Base64Input(memoryview(base64.b64encode(os.urandom(size))), "x").check()
    assert max(pieces, default=0) == 16 + 4
    good = base64.b64encode(os.urandom(60))  # 80 characters: five pieces
    for position in (0, 15, 16, 17, 40, 79):
        text = bytearray(good)
        text[position] = ord("*")
        with pytest.raises(BadRequest, match=r"^messages\[0\]\.content\[1\]\.video_url: invalid base64 data"):
            Base64Input(memoryview(bytes(text)), "messages[0].content[1].video_url").check()
    padded_inside = base64.b64encode(os.urandom(10)) + good  # 16 characters ending in "=", then more
    assert padded_inside[15:16] == b"="
    with pytest.raises(BadRequest, match="invalid base64 data"):
        decode_base64(padded_inside, "x")
    with pytest.raises(BadRequest, match="invalid base64 data"):
        Base64Input(memoryview(padded_inside), "x").check()


@pytest.mark.parametrize("modality", ["video", "audio"])
@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_an_inline_item_in_the_body_is_read_through_its_base64_and_never_decoded_whole(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    full_decodes: list[int],
    monkeypatch: pytest.MonkeyPatch,
    modality: str,
    mode: str,
) -> None:
    """A body of several MiB, whose base64 the parser leaves as a view of the body: the load checks every
    character a piece at a time and reads the container through the base64, decoding at most a piece at once;
    the video's load (and probe) read less than half of its bytes, its sampled frames only."""
    ranges: list[int] = []
    original = gateway.media.sources.inline.decode_base64

    def counting(payload: Any, locator: str) -> bytes:
        ranges.append(len(payload))
        return original(payload, locator)

    read: list[int] = []
    original_read = Base64Input.read

    def counting_read(self: Base64Input, size: int = -1, /) -> bytes:
        chunk = original_read(self, size)
        read.append(len(chunk))
        return chunk

    monkeypatch.setattr(gateway.media.sources.inline, "decode_base64", counting)
    monkeypatch.setattr(Base64Input, "read", counting_read)
    app, upstream = stub
    if modality == "video":
        data = make_video("mpeg4", "mp4", frames=3000, gop=1)
        body = video_body(mp4_url(data), text=LONG_TEXT)
    else:
        data = make_audio("pcm_s16le", "wav", seconds=20.0)
        body = audio_body(data)
    assert len(body) >= SKELETON_MIN_BODY_BYTES
    encoded = len(base64.b64encode(data))
    options = {"limits": {"budget_mode": mode}, "media": {"video": {"num_frames": 4}}}
    with make_gateway(upstream, **options) as (_, url):
        response = httpx.post(url + CHAT, content=body)
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    assert full_decodes == []
    assert max(ranges) <= CHECK_CHARS + 4
    # The check decoded every character once (and the group after each piece again).
    assert sum(ranges) >= encoded
    assert read
    if modality == "video":
        assert sum(read) < len(data) / 2
    else:
        assert sum(read) >= len(data)  # PCM: every sample is decoded, every byte read once


@pytest.mark.parametrize("body_kind", ["small", "escaped"])
def test_an_inline_item_the_parsed_document_holds_as_a_string_is_read_through_it_too(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, full_decodes: list[int], body_kind: str
) -> None:
    """A small body is parsed whole, and a literal with escapes (`\\/`, as PHP's json_encode writes a slash) is
    never a view of the body: the item's base64 is a `str` the parsed document holds, read by range as the body
    is, not decoded whole."""
    app, upstream = stub
    data = make_video("mpeg4", "mp4", frames=20, gop=1)
    body = video_body(mp4_url(data), text=LONG_TEXT if body_kind == "escaped" else "What happens?")
    if body_kind == "escaped":
        body = body.replace(b"/", b"\\/")
        assert len(body) >= SKELETON_MIN_BODY_BYTES
    else:
        assert len(body) < SKELETON_MIN_BODY_BYTES
    with make_gateway(upstream, limits={"budget_mode": "bytes"}, media={"video": {"num_frames": 4}}) as (_, url):
        response = httpx.post(url + CHAT, content=body)
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    assert full_decodes == []
