"""`media.fetch.forward`: a downloaded item goes upstream as a data URL of exactly the bytes the gateway checked and
counted, so the upstream never fetches it again (and never gets other bytes, from its own network), through the
real gateway and a real media server."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import orjson
from PIL import Image

from tests.conftest import GatewayFactory
from tests.gateway.media.audio.test_decode import make_audio
from tests.gateway.media_factory import chat_body, image_bytes
from tests.gateway.media_stub import PUBLIC, MediaStub
from tests.gateway.stub_upstream import StubUpstream

CHAT = "/v1/chat/completions"


def options(forward: str = "inline", cap: int = 64 << 20) -> dict[str, Any]:
    fetch = {"allowed_networks": [f"{PUBLIC}/32"], "forward": forward}
    limits = {"max_multimodal_cpu_bytes_per_request": cap, "max_multimodal_cpu_bytes": 4 * cap}
    return {"media": {"fetch": fetch}, "limits": limits}


def forwarded_urls(upstream: StubUpstream) -> list[str]:
    """The image URLs of the requests that reached the upstream."""
    return [
        part["image_url"]["url"]
        for seen in upstream.state.requests
        for part in orjson.loads(seen.body)["messages"][0]["content"]
        if part.get("type") == "image_url"
    ]


def png(side: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def test_a_server_that_answers_the_gateway_one_image_and_others_another_cannot_switch_them(
    media_stub: tuple[MediaStub, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """The server answers the gateway's User-Agent with a 155-byte PNG and anyone else with a 20000x20000 one:
    the upstream receives the small PNG's bytes, exactly, and never asks the server."""
    server, media_url = media_stub
    upstream, upstream_url = stub
    small = png(8)
    server.files["switch.png"] = small
    server.others["switch.png"] = png(20000)
    with make_gateway(upstream_url, **options()) as (_, url):
        response = httpx.post(url + CHAT, content=chat_body(f"{media_url}/files/switch.png"))
    assert response.status_code == 200, response.text
    assert [hit.headers["user-agent"] for hit in server.hits] == [server.agent]  # the gateway's download only
    (forwarded,) = forwarded_urls(upstream)
    head, payload = forwarded.split(",", 1)
    assert head == "data:image/png;base64"
    assert base64.b64decode(payload) == small


def test_a_redirected_url_forwards_the_bytes_it_ended_at(
    media_stub: tuple[MediaStub, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    server, media_url = media_stub
    upstream, upstream_url = stub
    image = image_bytes(40, 30)
    server.files["final.jpg"] = image
    with make_gateway(upstream_url, **options()) as (_, url):
        response = httpx.post(url + CHAT, content=chat_body(f"{media_url}/redirect?to=/files/final.jpg"))
    assert response.status_code == 200, response.text
    assert [hit.path for hit in server.hits] == ["/redirect", "/files/final.jpg"]
    assert forwarded_urls(upstream) == ["data:image/jpeg;base64," + base64.b64encode(image).decode()]


def test_the_rest_of_the_body_goes_upstream_byte_for_byte(
    media_stub: tuple[MediaStub, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """Two downloads, an inline image, odd spacing and escapes: only the two URL literals change."""
    server, media_url = media_stub
    upstream, upstream_url = stub
    first, second, inline = image_bytes(16, 16, seed=1), image_bytes(24, 24, seed=2), image_bytes(8, 8, seed=3)
    server.files.update({"1.jpg": first, "2.jpg": second})
    inline_url = "data:image/jpeg;base64," + base64.b64encode(inline).decode()
    body = (
        '{"model": "m",  "messages": [{"role": "user", "content": [{"type": "text", "text": "caf\\u00e9 \\"x\\""},\n'
        f' {{"type": "image_url", "image_url": {{"url": "{media_url}/files/1.jpg"}}}},'
        f' {{"type": "image_url", "image_url": {{"url": "{inline_url}"}}}},'
        f' {{"type": "image_url", "image_url": "{media_url}\\/files\\/2.jpg"}}]}}], "stream": false}}'
    ).encode()
    with make_gateway(upstream_url, **options()) as (_, url):
        assert httpx.post(url + CHAT, content=body).status_code == 200
    expected = body.replace(
        f'"{media_url}/files/1.jpg"'.encode(),
        orjson.dumps("data:image/jpeg;base64," + base64.b64encode(first).decode()),
    ).replace(
        f'"{media_url}\\/files\\/2.jpg"'.encode(),
        orjson.dumps("data:image/jpeg;base64," + base64.b64encode(second).decode()),
    )
    assert upstream.state.requests[0].body == expected


def test_the_data_urls_are_counted_against_the_per_request_cap(
    media_stub: tuple[MediaStub, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """A WAV whose download and decode fit the cap, and whose base64 on top of them does not: 413, not forwarded."""
    server, media_url = media_stub
    upstream, upstream_url = stub
    wav = make_audio(seconds=0.5)  # 16 kHz mono float32 decoded: 32,000 bytes
    server.files["a.wav"] = wav
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": f"{media_url}/files/a.wav"}}]}
            ],
        }
    )
    cap = len(wav) + 32_000 + len(body) + len(wav)  # room for the download and the decode, not the base64 of it
    with make_gateway(upstream_url, **options(cap=cap)) as (_, url):
        refused = httpx.post(url + CHAT, content=body)
    assert refused.status_code == 413, refused.text
    assert refused.json()["message"].startswith("media forwarded as data URLs reached")
    assert upstream.state.requests == []


def test_with_forward_url_the_upstream_gets_the_url_as_sent(
    media_stub: tuple[MediaStub, str], stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    server, media_url = media_stub
    upstream, upstream_url = stub
    server.files["u.jpg"] = image_bytes(16, 16)
    body = chat_body(f"{media_url}/files/u.jpg")
    with make_gateway(upstream_url, **options("url")) as (_, url):
        assert httpx.post(url + CHAT, content=body).status_code == 200
    assert upstream.state.requests[0].body == body
