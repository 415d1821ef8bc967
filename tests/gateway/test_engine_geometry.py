"""Engine mode follows the engine's own model geometry (read from its status), through real servers."""

from __future__ import annotations

import io
import re
import time
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image

from engine_adapter.__main__ import ENGINE
from engine_adapter.app import EngineApp
from gateway.engine_geometry import geometry_from_status
from processor_geometry import QWEN2_VL, smart_resize
from tests.conftest import EngineFactory, GatewayFactory, engine_settings
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric
from tests.servers import ServerThread, free_port
from tests.stub_asgi import lifespan

STATUS = {
    "processor": {
        "geometry": "qwen2_vl",
        "min_pixels": 3136,
        "max_pixels": 200_704,
        "factor": 28,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "channels": 3,
    }
}


def engine_mode(engine_url: str) -> dict[str, Any]:
    return {"engine": {"url": engine_url}, "media": {"processor": "qwen2_vl"}}


def llm_rows(height: int, width: int, max_pixels: int) -> int:
    h, w = smart_resize(height, width, 28, QWEN2_VL.min_pixels, max_pixels)
    return (h // 28) * (w // 28)


def test_status_geometry_keeps_the_presets_normalization_and_takes_the_engines_bounds() -> None:
    geometry = geometry_from_status(STATUS)
    assert geometry.max_pixels == 200_704
    assert geometry.min_pixels == 3136
    assert geometry.factor == 28
    assert (geometry.image_mean, geometry.image_std) == (QWEN2_VL.image_mean, QWEN2_VL.image_std)
    assert geometry.resize == "pil"  # an engine that names no resize resizes as Pillow does


def test_status_geometry_takes_the_engines_video_bounds() -> None:
    from processor_geometry import QWEN3_VL, video_smart_resize

    qwen3 = {**STATUS["processor"], "geometry": "qwen3_vl", "patch_size": 16, "factor": 32}
    preset = geometry_from_status({"processor": qwen3})  # an engine that reports no video bounds: the preset's
    assert (preset.video_bounds, preset.video_pixels) == ("clip", QWEN3_VL.video_pixels)
    status = {"processor": {**qwen3, "video_bounds": "clip", "video_min_pixels": 4096, "video_max_pixels": 1 << 20}}
    geometry = geometry_from_status(status)
    assert geometry.video_pixels == (4096, 1 << 20)
    # The engine's video bounds, not the preset's, fix a clip's resize: 8 frames of 640x480 under 1 Mi pixels.
    assert video_smart_resize(8, 480, 640, geometry) == (288, 416)
    assert video_smart_resize(8, 480, 640, preset) == (480, 640)
    qwen2 = geometry_from_status({"processor": {**STATUS["processor"], "video_max_pixels": 100_000}})
    assert (qwen2.video_bounds, qwen2.video_pixels) == ("frame", (3136, 100_000))
    assert geometry_from_status(STATUS).video_pixels == (3136, 200_704)  # per frame, the image bounds


def test_status_geometry_takes_the_engines_resize() -> None:
    status = {"processor": {**STATUS["processor"], "resize": "torchvision"}}
    assert geometry_from_status(status).resize == "torchvision"


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"processor": "qwen2_vl"},
        {"processor": {**STATUS["processor"], "geometry": None}},
        {"processor": {**STATUS["processor"], "max_pixels": "200704"}},
        {"processor": {**STATUS["processor"], "resize": "lanczos"}},
        {"processor": {**STATUS["processor"], "patch_size": True}},
        {"processor": {**STATUS["processor"], "video_max_pixels": "1000"}},
        {"processor": {**STATUS["processor"], "video_bounds": "frames"}},
        {"processor": {k: v for k, v in STATUS["processor"].items() if k != "merge_size"}},
    ],
)
def test_a_status_without_a_usable_geometry_is_refused(status: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="the engine's status"):
        geometry_from_status(status)


def test_images_are_resized_for_an_engine_configured_off_the_preset(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    engine_max = 200_704  # far below the qwen2_vl preset's: the engine refuses an image resized for the preset
    height, width = 900, 1200
    assert llm_rows(height, width, engine_max) != llm_rows(height, width, QWEN2_VL.max_pixels)
    with (
        make_engine(model={"max_pixels": engine_max}) as (_, engine_url),
        make_gateway(upstream_url, **engine_mode(engine_url)) as (gateway, url),
    ):
        response = httpx.post(
            url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(width, height))), timeout=60
        )
        assert gateway.engine is not None
        assert gateway.engine.geometry.geometry is not None
        assert gateway.engine.geometry.geometry.max_pixels == engine_max
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    rows = int(re.match(r"image 0: (\d+) rows", text)[1])  # type: ignore[index]
    assert rows == llm_rows(height, width, engine_max)


def test_until_the_engine_reports_its_geometry_media_requests_get_503_undecoded(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    port = free_port()
    body = chat_body(data_url(image_bytes(64, 64)))
    with make_gateway(upstream_url, **engine_mode(f"http://127.0.0.1:{port}")) as (_, url):
        early = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
        started = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        settings = engine_settings()
        app = EngineApp(settings)
        with ServerThread(app, config=ENGINE.server_config(app, settings), bind=("127.0.0.1", port)):
            deadline = time.monotonic() + 10
            while True:  # the gateway retries the engine's status every second until it answers
                late = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
                if late.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    assert early.status_code == 503
    assert "has not reported its model's image geometry yet" in early.json()["message"]
    assert started == 0
    assert late.status_code == 200, late.text


def test_a_phone_photo_passes_the_demo_limits_charged_as_resized_pixels(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream_url = stub
    ramp = np.linspace(0, 255, 4000, dtype=np.float32)
    pixels = np.broadcast_to(ramp[None, :, None], (3000, 4000, 3)).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    photo = out.getvalue()  # 12 MP
    limits = {"max_multimodal_cpu_bytes": 1 << 30, "max_multimodal_cpu_bytes_per_request": 256 << 20}
    with (
        make_engine(model={"max_pixels": 200_704}) as (_, engine_url),
        make_gateway(upstream_url, limits=limits, **engine_mode(engine_url)) as (gateway, url),
    ):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(photo)), timeout=120)
        counted = metric(url, "mmgate_media_counted_bytes_sum")
        geometry = gateway.engine.geometry.geometry if gateway.engine else None
    assert response.status_code == 200, response.text
    assert geometry is not None
    h, w = smart_resize(3000, 4000, geometry.factor, geometry.min_pixels, geometry.max_pixels)
    decoded = 4000 * 3000 * 4  # Pillow's RGB
    # The raw body, the decode and the resized pixels: no float32 processor tensors in engine mode.
    assert decoded + h * w * 7 < counted < decoded + h * w * 7 + len(chat_body(data_url(photo))) + 4096


class SlowEngine:
    """An engine that answers `/healthz` at once and reports its geometry only once `ready` is set."""

    def __init__(self) -> None:
        self.ready = False
        self.status_calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] == "/internal/v1/status":
            self.status_calls += 1
            status, body = (200, orjson.dumps(STATUS)) if self.ready else (503, b'{"error":"loading"}')
        else:
            status, body = 200, b'{"status":"ok"}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def test_ready_only_once_the_engine_has_reported_its_geometry(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """A rollout's readiness probe passes only when image requests can be served: the probe itself asks the engine
    for its geometry, so readiness does not wait for the background refresh either."""
    _, upstream = stub
    engine = SlowEngine()
    with (
        ServerThread(engine) as served,
        make_gateway(upstream, upstream={"ready_cache_s": 0}, **engine_mode(served.url)) as (gateway, url),
    ):
        not_ready = httpx.get(url + "/readyz")
        refused = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(64, 64))))
        engine.ready = True
        ready = httpx.get(url + "/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["engine"] == "answers, but has not reported its model's geometry"
    assert refused.status_code == 503
    assert refused.json()["message"].startswith("the engine has not reported its model's image geometry yet")
    assert served.url not in refused.text  # no internal address for the client
    assert ready.status_code == 200, ready.text
    assert gateway.engine is not None
    assert gateway.engine.geometry.geometry is not None


def test_a_qwen3_vl_engine_gets_images_and_video_resized_with_its_factor_32_and_video_rule(
    make_engine: EngineFactory, stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """A Qwen3-VL tower (`tiny-3`): its status names `qwen3_vl`, the gateway resizes an image with factor 32 and the
    image bounds (a 500x300 image: 512x288; Qwen2-VL's factor 28 would make it 504x308), and a clip with the video
    rule, which bounds frames x pixels: 8 frames of 192x96 stay 192x96 (the image rule's 65,536-pixel minimum would
    scale each frame up). The engine accepts both; the reference reports their rows. A one-frame clip, which
    Qwen3-VL's video processor refuses, is a 400."""
    from processor_geometry import QWEN3_VL, image_geometry
    from tests.gateway.media.video.test_decode import make_video

    _, upstream_url = stub
    video = make_video("mpeg4", "mp4", frames=60, gop=1)  # 192x96 at 10 fps
    single = make_video("mpeg4", "mp4", frames=1, gop=1)
    text = {"type": "text", "text": "what happens"}
    image_part = {"type": "image_url", "image_url": {"url": data_url(image_bytes(500, 300))}}

    def video_part(data: bytes) -> dict[str, Any]:
        return {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}

    def chat(*content: dict[str, Any]) -> bytes:
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": list(content)}]})

    body, short = chat(text, image_part, video_part(video)), chat(text, video_part(single))
    media = {"processor": "qwen3_vl", "video": {"num_frames": 8}}
    with make_engine(model={"preset": "tiny-3"}) as (_, engine_url):
        status = httpx.get(engine_url + "/internal/v1/status", timeout=10).json()
        with make_gateway(upstream_url, engine={"url": engine_url}, media=media) as (gateway, url):
            response = httpx.post(url + "/v1/chat/completions", content=body, timeout=120)
            refused = httpx.post(url + "/v1/chat/completions", content=short, timeout=60)
            assert gateway.engine is not None
            geometry = gateway.engine.geometry.geometry
    assert status["processor"]["geometry"] == "qwen3_vl"
    assert geometry is not None
    assert (geometry.name, geometry.factor) == ("qwen3_vl", 32)
    assert (geometry.min_pixels, geometry.max_pixels) == (QWEN3_VL.min_pixels, QWEN3_VL.max_pixels)
    assert response.status_code == 200, response.text
    lines = response.json()["choices"][0]["message"]["content"].splitlines()
    image = image_geometry(300, 500, QWEN3_VL)
    assert (image.height, image.width) == (288, 512)
    assert image.llm_tokens == 18 * 32 // 4 == 144
    layout = "384 (128 + 2 DeepStack layers x 128)"
    assert lines[0].startswith(f"image 0: {image.llm_tokens} rows x {layout}, sha256 ")
    # 8 frames = 4 temporal patches, 96 / 16 = 6 by 192 / 16 = 12 patches: 288 tokens, 72 rows.
    assert lines[1].startswith(f"video 1: 72 rows x {layout} (grid 4x6x12), sha256 ")
    assert refused.status_code == 400, refused.text
    assert "a clip of 1 frame(s) is shorter than one temporal patch" in refused.json()["message"]
