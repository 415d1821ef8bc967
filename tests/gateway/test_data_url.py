"""gateway.data_url: where a data URL's payload starts, read from its head alone, the same for a view of the body
and for a string; and the refusals naming the item."""

from __future__ import annotations

import re

import pytest

from gateway.data_url import data_url_start, decode_base64, split_data_url
from gateway.errors import BadRequest


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
