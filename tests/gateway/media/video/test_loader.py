"""Videos through the real gateway and a stub upstream on loopback, with videos the tests encode with PyAV: the
header is read first and refusals come before any frame is decoded (observed through
`mmgate_media_frames_decoded_total`), only the sampled frames are decoded, and what the header predicts is what
is counted."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import numpy as np
import orjson
import pytest

from gateway.media.body import SKELETON_MIN_BODY_BYTES
from gateway.media.video.decode import rgb_frame_bytes
from tests.conftest import EngineFactory, GatewayFactory
from tests.gateway.media.video.test_decode import make_video
from tests.gateway.media_factory import data_url
from tests.gateway.media_stub import PUBLIC
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric
from tests.servers import ServerThread
from tests.stub_asgi import lifespan

CHAT = "/v1/chat/completions"
FRAME = rgb_frame_bytes(192, 96)


def video_body(*urls: str, text: str = "What happens?") -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "video_url", "video_url": {"url": url}} for url in urls]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def mp4_url(data: bytes) -> str:
    return data_url(data, "video/mp4")


def frames_decoded(url: str) -> float:
    return metric(url, "mmgate_media_frames_decoded_total", modality="video")


@pytest.fixture(scope="module")
def intra_mp4() -> bytes:
    """400 frames of 192x96 at 10 fps, every frame a keyframe: a seek lands on the sampled frame itself."""
    return make_video("mpeg4", "mp4", frames=400, gop=1)


@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_sampled_frames_only_are_decoded_and_the_prediction_is_what_is_counted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes, mode: str
) -> None:
    app, upstream = stub
    body = video_body(mp4_url(intra_mp4))
    limits = {"budget_mode": mode}
    with make_gateway(upstream, limits=limits, media={"video": {"num_frames": 8}}) as (gateway, url):
        response = httpx.post(url + CHAT, content=body)
        decoded = frames_decoded(url)
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
        counted = metric(url, "mmgate_media_counted_bytes_sum")
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="video")
        in_use = gateway.budget.in_use
    assert response.status_code == 200, response.text
    assert app.state.requests[0].body == body
    # Eight frames sampled 57 apart, each reached by a seek to itself: the decoder produced those eight.
    assert decoded == 8
    assert predicted == 8 * FRAME
    assert counted == len(body) + 8 * FRAME
    assert decodes == 1
    assert in_use == 0


def test_qwen_fps_sampling_and_processed_tensors_are_counted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    """`fps` alone: Qwen's rule, 40 s at 2 fps = 80 frames in whole temporal patches; with a processor the video
    processor's peak is charged too, predicted from the header."""
    from gateway.media.video.decode import processed_video_bytes
    from gateway.processors import load
    from processor_geometry import QWEN2_VL

    _, upstream = stub
    body = video_body(mp4_url(intra_mp4))
    media = {"video": {"num_frames": None, "fps": 2.0}, "processor": "qwen2_vl"}
    with make_gateway(upstream, media=media) as (_, url):
        response = httpx.post(url + CHAT, content=body)
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
        counted = metric(url, "mmgate_media_counted_bytes_sum")
    assert response.status_code == 200, response.text
    clip = load("qwen2_vl").video(80, 96, 192)
    assert clip.returned == processed_video_bytes(80, 96, 192, QWEN2_VL) + 24  # pixel_values_videos, the grid
    expected = 80 * FRAME + clip.peak
    assert predicted == expected
    assert counted == len(body) + expected


def test_qwen3_vl_fps_sampling_and_its_video_processors_tensors_are_counted(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    """`media.processor: qwen3_vl` with `fps` alone: Qwen3-VL's video processor's rule, 40 s at 1.28 fps = 51
    frames (Qwen2-VL's rule would round to 50), and the bytes of the pixel_values_videos transformers' Qwen3-VL
    video processor makes of them."""
    from tests.gateway.media.qwen3_vl_oracle import process_video

    _, upstream = stub
    body = video_body(mp4_url(intra_mp4))
    media = {"video": {"num_frames": None, "fps": 1.28}, "processor": "qwen3_vl"}
    with make_gateway(upstream, media=media) as (_, url):
        response = httpx.post(url + CHAT, content=body)
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
        decoded = frames_decoded(url)
    assert response.status_code == 200, response.text
    assert decoded == 51
    processed = process_video(np.zeros((51, 96, 192, 3), dtype=np.uint8))
    assert processed["video_grid_thw"].tolist() == [[26, 6, 12]]
    from gateway.processors import load

    clip = load("qwen3_vl").video(51, 96, 192)
    assert clip.returned == processed["pixel_values_videos"].nbytes + processed["video_grid_thw"].nbytes
    assert predicted == 51 * FRAME + clip.peak


@pytest.mark.parametrize(
    ("options", "status", "message"),
    [
        ({"limits": {"max_video_pixels": 10_000}}, 413, "192x96 = 18,432 pixels, over limits.max_video_pixels=10,000"),
        ({"limits": {"max_video_seconds": 30}}, 413, "lasts 40.0 s, over limits.max_video_seconds=30"),
        ({"media": {"video_codecs": ["vp9"]}}, 400, "video codec 'mpeg4' is not accepted (media.video_codecs: vp9)"),
        ({"media": {"video_formats": ["webm"]}}, 400, "is not accepted (media.video_formats: webm)"),
        (
            {"limits": {"max_multimodal_cpu_bytes_per_request": 1 << 20, "budget_mode": "slots"}},
            413,
            "decoded media reached",
        ),
        (
            {"limits": {"max_multimodal_cpu_bytes_per_request": 1 << 20, "budget_mode": "bytes"}},
            413,
            "media predicted from the headers reach",
        ),
    ],
)
def test_header_refusals_decode_no_frame(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    intra_mp4: bytes,
    options: dict[str, Any],
    status: int,
    message: str,
) -> None:
    app, upstream = stub
    with make_gateway(upstream, **options) as (gateway, url):
        response = httpx.post(url + CHAT, content=video_body(mp4_url(intra_mp4)))
        decoded = frames_decoded(url)
        in_use = gateway.budget.in_use
    assert response.status_code == status, response.text
    assert message in response.json()["message"]
    assert (
        "messages[0].content[1].video_url" in response.json()["message"]
        or "predicted" in message
        or ("decoded media" in message)
    )
    assert decoded == 0
    assert in_use == 0
    assert app.state.requests == []


def test_decode_header_mode_counts_the_prediction_and_decodes_nothing(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    _, upstream = stub
    body = video_body(mp4_url(intra_mp4))
    with make_gateway(upstream, media={"decode": "header"}) as (_, url):
        response = httpx.post(url + CHAT, content=body)
        decoded = frames_decoded(url)
        counted = metric(url, "mmgate_media_counted_bytes_sum")
    assert response.status_code == 200
    assert decoded == 0
    assert counted == len(body) + 32 * FRAME


def test_per_modality_item_counts_are_413_naming_the_key(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    _, upstream = stub
    body = video_body(mp4_url(intra_mp4), mp4_url(intra_mp4))
    with make_gateway(upstream, limits={"max_items": {"video": 1}}) as (_, url):
        response = httpx.post(url + CHAT, content=body)
        decoded = frames_decoded(url)
        one = httpx.post(url + CHAT, content=video_body(mp4_url(intra_mp4)))
    assert response.status_code == 413
    assert response.json()["message"] == "request has 2 video items, over limits.max_items.video=1"
    assert decoded == 0
    assert one.status_code == 200


class SlowFiles:
    """Serves `body` at every path after `delay_s`, and counts the connections it got."""

    def __init__(self, body: bytes, delay_s: float) -> None:
        self.body = body
        self.delay_s = delay_s
        self.hits = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        self.hits += 1
        await asyncio.sleep(self.delay_s)
        headers = [(b"content-type", b"video/mp4"), (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


@pytest.fixture
def slow_files() -> Iterator[tuple[SlowFiles, str]]:
    app = SlowFiles(b"v" * (1 << 20), delay_s=0.3)
    with ServerThread(app, bind=(PUBLIC, 0)) as server:
        yield app, server.url


def test_passing_the_cap_stops_a_running_decode(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, slow_files: tuple[SlowFiles, str]
) -> None:
    """A 1,200-frame video decoding every frame while a second item's download passes the cap: the decode is
    stopped at its next frame, the request answers 413 at once, and nothing runs on after it."""
    files, files_url = slow_files
    _, upstream = stub
    long = make_video("mpeg4", "mp4", width=640, height=480, frames=1200, gop=30)
    body = video_body(mp4_url(long), files_url + "/big.mp4")
    frame = rgb_frame_bytes(640, 480)
    cap = len(body) + 768 * frame + (512 << 10)  # the video fits; the download's 1 MiB does not
    limits = {"max_multimodal_cpu_bytes_per_request": cap, "max_multimodal_cpu_bytes": cap, "budget_mode": "slots"}
    media = {"load_workers": 2, "video": {"num_frames": 768}, "fetch": {"allowed_networks": [f"{PUBLIC}/32"]}}
    with make_gateway(upstream, limits=limits, media=media) as (gateway, url):
        started = time.monotonic()
        response = httpx.post(url + CHAT, content=body, timeout=30)
        elapsed = time.monotonic() - started
        decoded = frames_decoded(url)
        in_use = gateway.budget.in_use
        time.sleep(0.3)
        cpu = time.process_time()
        time.sleep(0.5)
        idle = time.process_time() - cpu
        assert frames_decoded(url) == decoded
    assert response.status_code == 413, response.text
    assert "downloaded media reached" in response.json()["message"]
    assert files.hits == 1
    # Answered while the decode stood part-way through the video, which decoded nothing more after the answer: the
    # answer did not wait for the decode to run out. The time is a backstop, far below the 30 s timeouts.
    assert 0 < decoded < 1200
    assert elapsed < 10
    assert in_use == 0
    assert idle < 0.2


BLOCKED = [
    "http://169.254.169.254/latest/meta-data/v.mp4",
    "http://[::ffff:169.254.169.254]/v.mp4",
    "http://2852039166/v.mp4",  # 169.254.169.254 as one integer
    "http://10.0.0.1/v.mp4",
    "http://[::1]/v.mp4",
    "file:///etc/passwd",
    "ftp://example.com/v.mp4",
]


def test_every_ssrf_rule_applies_to_video_urls(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    urls = [*BLOCKED, f"http://127.0.0.1:{port}/v.mp4", f"http://localhost:{port}/v.mp4"]
    try:
        with make_gateway(upstream) as (_, url):
            responses = [httpx.post(url + CHAT, content=video_body(u)) for u in urls]
            decoded = frames_decoded(url)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected to the loopback listener
    finally:
        listener.close()
    assert [r.status_code for r in responses] == [400] * len(urls), [r.text for r in responses]
    for response in responses:
        assert "messages[0].content[1].video_url" in response.json()["message"]
    assert decoded == 0
    assert app.state.requests == []


# --- bombs and lies ------------------------------------------------------------------------------------------


def million_frame_avi() -> bytes:
    """An AVI of 20 real frames whose main and stream headers declare 1,000,000 frames (100,000 s at 10 fps)."""
    patched = bytearray(make_video("mpeg4", "avi", width=320, height=256, frames=20))
    avih = patched.find(b"avih")
    struct.pack_into("<I", patched, avih + 8 + 16, 1_000_000)  # dwTotalFrames
    strh = patched.find(b"strh")
    struct.pack_into("<I", patched, strh + 8 + 32, 1_000_000)  # dwLength
    return bytes(patched)


def huge_frames_avi() -> bytes:
    """An AVI whose main header and BITMAPINFOHEADER declare 65535x65535 frames, the codec's own header (the
    MPEG-4 VOL, the only place a decoder reads the size from) destroyed."""
    patched = bytearray(make_video("mpeg4", "avi", width=320, height=256, frames=20))
    strf = patched.find(b"strf")
    struct.pack_into("<ii", patched, strf + 8 + 4, 65535, 65535)
    avih = patched.find(b"avih")
    struct.pack_into("<II", patched, avih + 8 + 32, 65535, 65535)
    start = 0
    while (start := patched.find(b"\x00\x00\x01\x20", start)) >= 0:
        patched[start + 3] = 0xFF
        start += 4
    return bytes(patched)


def garbage_h264_mp4() -> bytes:
    """A valid MP4 header for H.264 whose sample data is random bytes."""
    patched = bytearray(make_video("libx264", "mp4", frames=60))
    mdat = patched.find(b"mdat")
    size = struct.unpack(">I", patched[mdat - 4 : mdat])[0]
    rng = np.random.default_rng(3)
    patched[mdat + 4 : mdat - 4 + size] = rng.integers(0, 256, size - 8, dtype=np.uint8).tobytes()
    return bytes(patched)


def fragmented_mp4(frames: int = 100) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}) as container:
        stream = container.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 192, 96, "yuv420p"
        stream.codec_context.gop_size = 10
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.zeros((96, 192, 3), np.uint8), "rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_a_declared_million_frames_is_refused_from_the_header_at_once(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    body = video_body(data_url(million_frame_avi(), "video/x-msvideo"))
    with make_gateway(upstream) as (_, url):
        httpx.post(url + CHAT, content=video_body(mp4_url(make_video(frames=5))))  # warm: PyAV loaded
        before = frames_decoded(url)
        elapsed = []
        with httpx.Client() as client:
            for _ in range(5):  # the fastest of five: the machine's other load is not the gateway's time
                started = time.perf_counter()
                response = client.post(url + CHAT, content=body)
                elapsed.append(time.perf_counter() - started)
        decoded = frames_decoded(url) - before
    assert response.status_code == 413, response.text
    assert "lasts 100000.0 s, over limits.max_video_seconds=3600" in response.json()["message"]
    assert decoded == 0  # what shows the refusal came from the header
    # A backstop against work that grows with the declared frames: each request takes a few ms; the fastest of
    # five stays far under this bound on a loaded machine.
    assert min(elapsed) < 0.5, elapsed


@pytest.mark.parametrize(
    ("name", "data", "status", "message"),
    [
        ("65535x65535", huge_frames_avi, 400, "declares no frame size"),
        ("truncated", lambda: make_video(frames=60)[:4000], 400, "not a readable video container"),
        ("garbage claiming H.264", garbage_h264_mp4, 400, "video"),
        ("random bytes as mp4", lambda: np.random.default_rng(5).bytes(2 << 20), 400, "not a readable video"),
    ],
)
def test_bombs_and_lies_are_4xx_before_memory_grows(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    name: str,
    data: Any,
    status: int,
    message: str,
) -> None:
    app, upstream = stub
    with make_gateway(upstream) as (gateway, url):
        response = httpx.post(url + CHAT, content=video_body(mp4_url(data())))
        in_use = gateway.budget.in_use
    assert response.status_code == status, (name, response.text)
    assert message in response.json()["message"], name
    assert "messages[0].content[1].video_url" in response.json()["message"]
    assert in_use == 0
    assert app.state.requests == []


def test_a_fragmented_mp4_is_read_from_its_fragments_and_bounded_like_any_other(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """A fragmented MP4 declares no frame count in its moov; its duration comes from the fragments, the sampled
    frames are predicted from it, and a too-long one is refused from that before decoding."""
    _, upstream = stub
    body = video_body(mp4_url(fragmented_mp4()))
    with make_gateway(upstream, media={"video": {"num_frames": 8}}) as (_, url):
        ok = httpx.post(url + CHAT, content=body)
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
    with make_gateway(upstream, limits={"max_video_seconds": 5}) as (_, url):
        long = httpx.post(url + CHAT, content=body)
        decoded = frames_decoded(url)
    assert ok.status_code == 200, ok.text
    assert predicted == 8 * FRAME
    assert long.status_code == 413, long.text
    assert "over limits.max_video_seconds=5" in long.json()["message"]
    assert decoded == 0


@pytest.mark.parametrize(("fraction", "status"), [(0.5, 400), (0.9, 200)])
def test_a_file_cut_short_is_a_400_when_more_than_one_sampled_frame_is_missing(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, fraction: float, status: int
) -> None:
    """An honest AVI of 100 frames cut at half its bytes delivers 4 of its 8 sampled frames; cut at 90%, 7 (the
    last is missing: one frame of slack)."""
    app, upstream = stub
    data = make_video("mpeg4", "avi", frames=100, gop=1)
    body = video_body(data_url(data[: int(len(data) * fraction)], "video/x-msvideo"))
    with make_gateway(upstream, media={"video": {"num_frames": 8}}) as (_, url):
        response = httpx.post(url + CHAT, content=body)
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == status, response.text
    if status == 400:
        message = response.json()["message"]
        assert message.startswith("messages[0].content[1].video_url: 4 of the 8 sampled frames decoded")
        assert app.state.requests == []
    else:
        assert app.state.requests[0].body == body
    assert in_use == 0


def engine_clip_bytes(frames: int, height: int, width: int) -> int:
    """What engine mode charges for a clip resized to height x width from 192x96 frames: the uint8 clip, plus the
    larger of one frame's resize (Pillow's full-size and resized images at 4 bytes a pixel, the resized array) and
    the clip's copy in the submit body."""
    clip = frames * height * width * 3
    return clip + max(4 * (192 * 96 + height * width) + height * width * 3, clip)


def test_engine_mode_charges_the_resized_clip_it_keeps_before_decoding(
    make_engine: EngineFactory, make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    body = video_body(mp4_url(intra_mp4))
    # 8 frames of 192x96 resized to 196x84 for Qwen2-VL; no processed tensors (the engine makes those).
    predicted = 8 * FRAME + engine_clip_bytes(8, 84, 196)
    options: dict[str, Any] = {"media": {"processor": "qwen2_vl", "video": {"num_frames": 8}}}
    with make_engine() as (_, engine_url):
        options["engine"] = {"url": engine_url}
        with make_gateway("http://127.0.0.1:9", **options) as (_, url):
            response = httpx.post(url + CHAT, content=body, timeout=60)
            seen_predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
            counted = metric(url, "mmgate_media_counted_bytes_sum")
            decoded = frames_decoded(url)
        cap = {"max_multimodal_cpu_bytes_per_request": len(body) + predicted - 1}
        with make_gateway("http://127.0.0.1:9", limits=cap, **options) as (_, url):
            refused = httpx.post(url + CHAT, content=body, timeout=60)
            decoded_over_cap = frames_decoded(url)
    assert response.status_code == 200, response.text
    assert "video 0: 84 rows x 128 (grid 4x6x14)" in response.text
    assert seen_predicted == predicted
    assert counted == len(body) + predicted
    assert decoded == 8
    assert refused.status_code == 413, refused.text
    assert "over limits.max_multimodal_cpu_bytes_per_request" in refused.json()["message"]
    assert decoded_over_cap == 0


def test_engine_mode_resizes_a_clip_within_the_video_bounds_the_engine_reports(
    make_engine: EngineFactory, make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    """A Qwen3-VL engine (`tiny-3`) with `model.video_max_pixels` = 65,536 reports it in its status, and the gateway
    resizes the clip within it: 8 frames of 192x96 (147,456 frames x pixels, inside the published bound) become 8 of
    128x64. With the published bound the clip would stay 192x96 and the engine would refuse it."""
    from processor_geometry import QWEN3_VL, video_smart_resize

    body = video_body(mp4_url(intra_mp4))
    options: dict[str, Any] = {"media": {"processor": "qwen3_vl", "video": {"num_frames": 8}}}
    assert video_smart_resize(8, 96, 192, QWEN3_VL) == (96, 192)
    assert video_smart_resize(8, 96, 192, QWEN3_VL.with_video_pixels(max_pixels=65_536)) == (64, 128)
    with make_engine(model={"preset": "tiny-3", "video_max_pixels": 65_536}) as (_, engine_url):
        options["engine"] = {"url": engine_url}
        with make_gateway("http://127.0.0.1:9", **options) as (gateway, url):
            response = httpx.post(url + CHAT, content=body, timeout=60)
            predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="video")
            assert gateway.engine is not None
            geometry = gateway.engine.geometry.geometry
    assert geometry is not None
    assert (geometry.video_bounds, geometry.video_pixels) == ("clip", (QWEN3_VL.video_pixels[0], 65_536))
    assert response.status_code == 200, response.text
    # 4 temporal patches of 64 / 16 = 4 by 128 / 16 = 8 patches: 128 patches, 32 merged rows.
    assert "video 0: 32 rows x 384 (128 + 2 DeepStack layers x 128) (grid 4x4x8)" in response.text
    assert predicted == 8 * FRAME + engine_clip_bytes(8, 64, 128)


def test_anthropic_has_no_video_block_and_responses_follow_the_chat_rules(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, intra_mp4: bytes
) -> None:
    """Anthropic Messages has no video block: a `video` block is not media and goes upstream as it came (the
    upstream refuses it). The Responses route loads a `video_url` part as the chat route does."""
    app, upstream = stub
    video = data_url(make_video(frames=5), "video/mp4")
    anthropic = orjson.dumps(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "video", "source": {"type": "url", "url": video}}]}],
        }
    )
    responses = orjson.dumps(
        {"model": "m", "input": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}}]}]}
    )
    with make_gateway(upstream, media={"video": {"num_frames": 4}}) as (_, url):
        passed = httpx.post(url + "/v1/messages", content=anthropic)
        after_anthropic = frames_decoded(url)
        loaded = httpx.post(url + "/v1/responses", content=responses)
        after_responses = frames_decoded(url)
    assert passed.status_code == 200
    assert after_anthropic == 0
    assert loaded.status_code == 200, loaded.text
    assert after_responses >= 4
    assert [seen.body for seen in app.state.requests] == [anthropic, responses]


@pytest.mark.parametrize("mode", ["slots", "bytes"])
def test_a_bad_base64_character_deep_inside_an_inline_video_is_a_400_before_any_frame(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, mode: str
) -> None:
    """The load reads an inline video through its base64, only the ranges the container asks for; a character
    outside base64 halfway through the frame data, between two sampled frames where no read goes, is still found
    (every character is checked before the header is read) and answered 400 naming the item."""
    app, upstream = stub
    data = make_video("mpeg4", "mp4", frames=1500, gop=1)
    text = bytearray(base64.b64encode(data))
    text[len(text) // 2] = ord("*")
    body = video_body("data:video/mp4;base64," + text.decode(), text="words " * (SKELETON_MIN_BODY_BYTES // 6))
    assert len(body) >= SKELETON_MIN_BODY_BYTES  # the base64 is a view of the body, read by range
    with make_gateway(upstream, limits={"budget_mode": mode}, media={"video": {"num_frames": 4}}) as (gateway, url):
        response = httpx.post(url + CHAT, content=body)
        decoded = frames_decoded(url)
        in_use = gateway.budget.in_use
    assert response.status_code == 400, response.text
    assert response.json()["message"].startswith("messages[0].content[1].video_url: invalid base64 data")
    assert decoded == 0
    assert in_use == 0
    assert app.state.requests == []
