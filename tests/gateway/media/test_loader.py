"""The media loader: which items may run small work on the event loop's thread (their plans), and through the real
gateway: work stops with its request, no client bytes cause a 500, and an inline video is read through its base64
where an image is decoded."""

from __future__ import annotations

import base64
import contextlib
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest
from PIL import Image

import gateway.media.image.loader
from gateway.config import GatewaySettings
from gateway.media.body import LONG_STRING_BYTES, SKELETON_MIN_BODY_BYTES
from gateway.media.image.loader import ImagePlan
from gateway.media.loader import MediaLoader
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.sources.fetch import MediaFetcher
from gateway.metrics import GatewayMetrics
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media.video.test_decode import make_video
from tests.gateway.media_factory import chat_body, data_url, image_bytes, messages_body, responses_body, scan_bomb
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric


def test_only_a_requests_only_item_is_planned_to_run_work_on_the_event_loops_thread() -> None:
    """What one request runs on the event loop's thread is one item's bounded work: its only item's plan allows it,
    the items of a request with several are never opened there, and nothing of one request's plans carries over to
    the next request's."""
    settings = GatewaySettings()
    jpeg = MediaRef(Modality.IMAGE, Source.DATA_URL, "a", data_url(image_bytes(64, 64)))
    with ThreadPoolExecutor(1) as executor:
        loader = MediaLoader(
            settings=settings, metrics=GatewayMetrics(), fetcher=MediaFetcher(settings.media.fetch), executor=executor
        )
        [alone] = loader.plan([jpeg], loader.keep)
        pair = loader.plan([jpeg, replace(jpeg, locator="b")], loader.keep)
        [again] = loader.plan([jpeg], loader.keep)
    assert isinstance(alone, ImagePlan)
    assert (alone.sole, alone.on_loop) == (True, True)
    assert alone.head is not None
    assert [(plan.sole, plan.on_loop, plan.head) for plan in pair if isinstance(plan, ImagePlan)] == [
        (False, False, None),
        (False, False, None),
    ]
    assert again == alone


@pytest.mark.parametrize(("items", "mode"), [(6, "bytes"), (1, "bytes"), (1, "slots")])
def test_a_leaving_client_stops_its_decodes_before_its_budget_returns(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, items: int, mode: str
) -> None:
    """Several items load on the media workers; a request's only item loads in the request's own task: either
    way the client leaving stops the decodes."""
    _, upstream = stub
    body = chat_body(*[data_url(scan_bomb(2048, 5000))] * items)  # seconds of decoding each
    limits: dict[str, object] = {"budget_mode": mode}
    if items > 1:
        limits |= {"max_multimodal_cpu_bytes": 2 << 30, "max_multimodal_cpu_bytes_per_request": 1 << 30}
    media = {"load_workers": 2, "max_jpeg_scans": None, "decode_timeout_s": None}
    with make_gateway(upstream, limits=limits, media=media) as (gateway, url):
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up while its images decode
            httpx.post(url + "/v1/chat/completions", content=body, timeout=0.4)
        left = time.monotonic()
        while gateway.budget.in_use and time.monotonic() < left + 5:
            time.sleep(0.005)
        assert gateway.budget.in_use == 0
        # Nothing of the request runs once its budget is back: no decode burns CPU in this process.
        cpu = time.process_time()
        time.sleep(0.6)
        assert time.process_time() - cpu < 0.15
        started = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        finished = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    # Two workers: two of six items started and the four queued behind them never did; no decode ran to its end.
    assert started == min(items, 2)
    assert finished == 0


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", chat_body(data_url(image_bytes(2010, 10)))),
        ("/v1/messages", messages_body(image_bytes(2010, 10))),
        ("/v1/responses", responses_body(data_url(image_bytes(2010, 10)))),
    ],
)
def test_an_image_the_processor_refuses_is_a_400_naming_the_rule(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, route: str, body: bytes
) -> None:
    _, upstream = stub
    for mode in ("slots", "bytes"):
        with make_gateway(upstream, limits={"budget_mode": mode}, media={"processor": "qwen2_vl"}) as (_, url):
            response = httpx.post(url + route, content=body)
        assert response.status_code == 400, response.text
        assert "aspect ratio of 201.0" in response.text
        assert "accepts at most 200 (media.processor=qwen2_vl)" in response.text


@pytest.mark.parametrize(
    "error",
    [TypeError("t"), IndexError("i"), ZeroDivisionError(), struct.error("s"), MemoryError()],
)
def test_no_exception_a_decoder_raises_reaches_the_client_as_a_500(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    _, upstream = stub

    def decoder_fails(*args: object, **kwargs: object) -> Image.Image:
        raise error

    monkeypatch.setattr(gateway.media.image.loader, "decode_opened", decoder_fails)
    monkeypatch.setattr(gateway.media.image.loader, "check_opened", decoder_fails)
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(16, 16))))
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == (413 if isinstance(error, MemoryError) else 400), response.text
    assert "messages[0].content[1].image_url" in response.json()["message"]
    assert in_use == 0


def test_inline_images_are_decoded_whole_and_inline_videos_read_through_their_base64(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, full_decodes: list[int]
) -> None:
    """One body with an image and a video, both views of the body: Pillow gets the image's decoded bytes; the
    video is never decoded whole (its base64 is checked and read a piece at a time)."""
    app, upstream = stub
    image = image_bytes(512, 512)
    video = make_video("mpeg4", "mp4", frames=1500, gop=1)
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "words " * (SKELETON_MIN_BODY_BYTES // 6)},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
    ]
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    assert len(body) >= SKELETON_MIN_BODY_BYTES
    assert len(data_url(image)) >= LONG_STRING_BYTES
    with make_gateway(upstream, media={"video": {"num_frames": 4}}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        frames = metric(url, "mmgate_media_frames_decoded_total", modality="video")
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    assert full_decodes == [len(base64.b64encode(image))]
    assert frames == 4
