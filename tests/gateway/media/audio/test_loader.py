"""Audio through the real gateway and a stub upstream on loopback, with audio the tests encode with PyAV: the
header is read first, the decoded float32 samples are predicted and charged before decoding, and lies about the
duration are stopped before memory grows."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from gateway.media.body import SKELETON_MIN_BODY_BYTES
from tests.conftest import GatewayFactory
from tests.gateway.media.audio.test_decode import _flac_claiming, make_audio
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric

CHAT = "/v1/chat/completions"


def audio_body(data: bytes, fmt: str = "wav") -> bytes:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
    content: list[dict[str, Any]] = [{"type": "text", "text": "Transcribe."}, part]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def audio_frames(url: str) -> float:
    return metric(url, "mmgate_media_frames_decoded_total", modality="audio")


@pytest.mark.parametrize(("codec", "fmt"), [("pcm_s16le", "wav"), ("flac", "flac"), ("libmp3lame", "mp3")])
@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_input_audio_is_decoded_and_its_prediction_is_what_is_counted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, codec: str, fmt: str, mode: str
) -> None:
    app, upstream = stub
    body = audio_body(make_audio(codec, fmt, seconds=2.0), fmt)
    with make_gateway(upstream, limits={"budget_mode": mode}) as (gateway, url):
        response = httpx.post(url + CHAT, content=body)
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="audio")
        counted = metric(url, "mmgate_media_counted_bytes_sum")
        frames = audio_frames(url)
        items = metric(url, "mmgate_media_items_total", modality="audio", source="base64")
        in_use = gateway.budget.in_use
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    # Mono float32 at 16 kHz: about 2 s x 16,000 x 4 bytes, from the header.
    assert predicted == pytest.approx(2.0 * 16000 * 4, rel=0.03)
    assert counted == len(body) + predicted
    assert frames > 0
    assert items == 1
    assert in_use == 0


def ten_hour_flac() -> bytes:
    """A 1 s FLAC whose STREAMINFO declares 10 hours of 16 kHz samples. (A WAV cannot: FFmpeg bounds its data
    chunk by the file's size.)"""
    return _flac_claiming(make_audio("flac", "flac", seconds=1.0, rate=16000, layout="mono"), 10 * 3600 * 16000)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({}, "lasts 36000.0 s, over limits.max_audio_seconds=3600"),
        ({"max_audio_seconds": None, "budget_mode": "slots"}, "decoded media reached"),
        ({"max_audio_seconds": None, "budget_mode": "bytes"}, "media predicted from the headers reach"),
    ],
)
def test_audio_declaring_ten_hours_is_refused_from_its_header(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, limits: dict[str, Any], message: str
) -> None:
    app, upstream = stub
    with make_gateway(upstream, limits=limits) as (gateway, url):
        response = httpx.post(url + CHAT, content=audio_body(ten_hour_flac(), "flac"))
        frames = audio_frames(url)
        in_use = gateway.budget.in_use
    assert response.status_code == 413, response.text
    assert message in response.json()["message"]
    assert frames == 0
    assert in_use == 0
    assert app.state.requests == []


def test_audio_understating_its_duration_is_stopped_by_the_running_count(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """A 10 s FLAC whose STREAMINFO claims 1 s passes the header checks; decoding stops at
    limits.max_audio_seconds, or at the cap when that is off."""
    _, upstream = stub
    lying = _flac_claiming(make_audio("flac", "flac", seconds=10.0, rate=16000, layout="mono"), 16000)
    with make_gateway(upstream, limits={"max_audio_seconds": 5}) as (_, url):
        long = httpx.post(url + CHAT, content=audio_body(lying, "flac"))
    cap = 300_000  # the body and the 1 s prediction fit; 10 s of samples (640,000 bytes) do not
    limits = {"max_audio_seconds": None, "max_multimodal_cpu_bytes_per_request": cap, "budget_mode": "slots"}
    with make_gateway(upstream, limits=limits) as (gateway, url):
        capped = httpx.post(url + CHAT, content=audio_body(lying, "flac"))
        in_use = gateway.budget.in_use
    assert long.status_code == 413, long.text
    assert "runs past limits.max_audio_seconds=5" in long.json()["message"]
    assert capped.status_code == 413, capped.text
    assert "decoded media reached" in capped.json()["message"]
    assert in_use == 0


@pytest.mark.parametrize(
    ("data", "options", "message"),
    [
        (np.random.default_rng(7).bytes(1 << 20), {}, "not a readable audio container"),
        (make_audio(seconds=3.0), {"media": {"audio_formats": ["mp3"]}}, "audio container 'wav' is not accepted"),
        (make_audio(seconds=3.0), {"media": {"audio_codecs": ["flac"]}}, "audio codec 'pcm_s16le' is not accepted"),
    ],
)
def test_unreadable_or_unaccepted_audio_is_400_before_decoding(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, data: bytes, options: dict[str, Any], message: str
) -> None:
    _, upstream = stub
    with make_gateway(upstream, **options) as (_, url):
        response = httpx.post(url + CHAT, content=audio_body(data))
        frames = audio_frames(url)
    assert response.status_code == 400
    assert message in response.json()["message"]
    assert "messages[0].content[1].input_audio" in response.json()["message"]
    assert frames == 0


def test_responses_input_audio_is_loaded_and_the_audio_count_limit_applies(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(make_audio()).decode(), "format": "wav"}}
    one = orjson.dumps({"model": "m", "input": [{"role": "user", "content": [part]}]})
    two = orjson.dumps({"model": "m", "input": [{"role": "user", "content": [part, part]}]})
    with make_gateway(upstream, limits={"max_items": {"audio": 1}}) as (_, url):
        loaded = httpx.post(url + "/v1/responses", content=one)
        frames = audio_frames(url)
        refused = httpx.post(url + "/v1/responses", content=two)
    assert loaded.status_code == 200, loaded.text
    assert frames > 0
    assert refused.status_code == 413
    assert refused.json()["message"] == "request has 2 audio items, over limits.max_items.audio=1"


def test_a_bad_base64_character_deep_inside_inline_audio_is_a_400_before_any_decode(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """Inline audio is read through its base64 as it decodes; a character outside base64 near its end is found
    before the header is read (every character is checked first), not after most of it was decoded."""
    app, upstream = stub
    text = bytearray(base64.b64encode(make_audio("pcm_s16le", "wav", seconds=20.0)))
    text[len(text) - 1000] = ord("*")
    part = {"type": "input_audio", "input_audio": {"data": text.decode(), "format": "wav"}}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]})
    assert len(body) >= SKELETON_MIN_BODY_BYTES  # the base64 is a view of the body, read by range
    with make_gateway(upstream) as (gateway, url):
        response = httpx.post(url + CHAT, content=body)
        frames = audio_frames(url)
        in_use = gateway.budget.in_use
    assert response.status_code == 400, response.text
    assert response.json()["message"].startswith("messages[0].content[0].input_audio: invalid base64 data")
    assert frames == 0
    assert in_use == 0
    assert app.state.requests == []
