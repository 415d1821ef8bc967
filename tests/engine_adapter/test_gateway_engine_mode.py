"""Gateway -> engine -> stub LLM, all real servers on loopback, for both hand-off forms, with one image and with
several of different aspect ratios: per item, the grid the LLM places the rows with, the row count, and what it
decoded (embeddings equal to an independent encode of the gateway's resized pixels; for trtllm-serve's pixel
fallback, exactly those pixels). A video goes as one item of its sampled frames, resized once for the clip: the
reference responder reports its grid and rows and the checksum of an independent encode of those frames; the
`openai` hand-off refuses it at submit and the client gets that 400."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import av
import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest
import torch
from PIL import Image

from engine_adapter.encoder import VisionEncoder
from engine_adapter.processor import process_image, process_video
from engine_adapter.reference import embedding_sha256
from gateway.media.resize import ModelResize
from processor_geometry import QWEN2_VL
from tests.conftest import EngineFactory, GatewayFactory, engine_settings
from tests.engine_adapter.conftest import wait_idle
from tests.engine_adapter.stub_llm import Received, StubLLM
from tests.gateway.media.video.test_decode import make_video
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric
from tests.servers import ServerThread

# (width, height): portrait, landscape, a small square.
PORTRAIT, LANDSCAPE, SQUARE = (300, 500), (500, 300), (64, 64)
CASES = {"one-portrait": [PORTRAIT], "portrait-landscape-square": [PORTRAIT, LANDSCAPE, SQUARE]}


@pytest.fixture
def stub() -> Iterator[tuple[StubUpstream, str]]:
    """The gateway's plain upstream: media chat never reaches it in engine mode."""
    app = StubUpstream()
    with ServerThread(app) as server:
        yield app, server.url


Stack = Callable[..., AbstractContextManager[tuple[str, str]]]


@pytest.fixture
def stack(make_engine: EngineFactory, make_gateway: GatewayFactory, stub: tuple[StubUpstream, str]) -> Stack:
    """`with stack(media={...}, gateway={section: {...}}, **engine_sections) as (url, engine_url):` a real engine,
    and in front of it the gateway in engine mode (the Qwen2-VL processor, the stub as its plain upstream)."""

    @contextmanager
    def factory(
        *, media: dict[str, Any] | None = None, gateway: dict[str, Any] | None = None, **engine: Any
    ) -> Iterator[tuple[str, str]]:
        with make_engine(**engine) as (_, engine_url):
            sections = {
                "engine": {"url": engine_url},
                "media": {"processor": "qwen2_vl", **(media or {})},
                **(gateway or {}),
            }
            with make_gateway(stub[1], **sections) as (_, url):
                yield url, engine_url

    return factory


def chat(url: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def encoder() -> Iterator[VisionEncoder]:
    """The engine's tower (tiny, seed 0, float32 on the CPU), loaded on its own."""
    loaded = VisionEncoder(engine_settings().model)
    yield loaded
    loaded.close()


def png(size: tuple[int, int], seed: int) -> bytes:
    return image_bytes(*size, fmt="PNG", seed=seed)


def resized(data: bytes) -> npt.NDArray[np.uint8]:
    """The pixels the gateway sends the engine for this image."""
    with Image.open(io.BytesIO(data)) as image:
        return ModelResize(QWEN2_VL).image(image.convert("RGB")).pixels


def grid_of(data: bytes) -> list[int]:
    """The grid of this image as the gateway resizes it: one temporal patch of 14 x 14 pixel patches."""
    height, width = resized(data).shape[:2]
    return [1, height // 14, width // 14]


def what_the_llm_got(stack: Stack, stub_llm: tuple[StubLLM, str], server: str, images: list[bytes]) -> Received:
    """A chat with these images through the gateway and the engine, which hands it off in `server`'s form to the
    stub LLM answering as `server`: the chat is answered 200, and the stub took the one request it received."""
    llm, llm_url = stub_llm
    llm.state.server = server
    body = chat_body(*(data_url(image, "image/png") for image in images), text="compare them")
    with stack(handoff={"backend": "openai", "url": llm_url, "format": server}) as (url, engine_url):
        response = chat(url, body)
        wait_idle(engine_url)
    assert response.status_code == 200, response.text
    assert llm.state.refused == []
    (seen,) = llm.state.received
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_places_every_item_with_its_grid_and_its_rows(
    case: str, encoder: VisionEncoder, stack: Stack, stub_llm: tuple[StubLLM, str]
) -> None:
    images = [png(size, seed) for seed, size in enumerate(CASES[case])]
    seen = what_the_llm_got(stack, stub_llm, "vllm", images)
    assert len(seen.embeds) == len(images)
    for index, data in enumerate(images):
        pixels, grid = resized(data), grid_of(data)
        grid_tensor = seen.grids[index]
        assert grid_tensor is not None
        assert grid_tensor.tolist() == grid, f"item {index}"
        assert seen.embeds[index].shape == (grid[1] * grid[2] // 4, 128), f"item {index}"
        processed = process_image(pixels, encoder.geometry)
        expected = encoder.forward(processed.pixel_values, processed.grid_thw)
        torch.testing.assert_close(seen.embeds[index], expected, rtol=1e-4, atol=1e-5, msg=f"item {index}")


@pytest.mark.parametrize("case", list(CASES))
def test_trtllm_gets_pixels_when_it_would_misplace_a_portrait(
    case: str, stack: Stack, stub_llm: tuple[StubLLM, str]
) -> None:
    images = [png(size, seed) for seed, size in enumerate(CASES[case])]
    seen = what_the_llm_got(stack, stub_llm, "trtllm", images)
    # A portrait's grid is never the one trtllm-serve infers: the whole request went as pixels, none as rows.
    assert seen.embeds == []
    assert len(seen.images) == len(images)
    for index, data in enumerate(images):
        assert np.array_equal(seen.images[index], resized(data)), f"item {index}"


def test_trtllm_gets_embeddings_when_it_infers_every_grid_right(stack: Stack, stub_llm: tuple[StubLLM, str]) -> None:
    images = [png(LANDSCAPE, 0), png(SQUARE, 1)]
    seen = what_the_llm_got(stack, stub_llm, "trtllm", images)
    assert seen.images == []
    truth = [grid_of(data) for data in images]
    assert [grid.tolist() for grid in seen.grids if grid is not None] == truth == [[1, 22, 36], [1, 4, 4]]
    assert [e.shape[0] for e in seen.embeds] == [198, 4]


# 60 frames of 192x96 at 10 fps, each a keyframe; 8 sampled (vLLM's rule), resized to 196x84 for Qwen2-VL: a grid
# of 4 temporal patches x 6 x 14 patches = 336 encoder tokens, 84 embedding rows.
VIDEO_FRAMES, SAMPLED, CLIP = 60, 8, (84, 196)


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video("mpeg4", "mp4", frames=VIDEO_FRAMES, gop=1)


def expected_clip(data: bytes) -> npt.NDArray[np.uint8]:
    """The sampled frames as the engine should get them, decoded and resized here independently."""
    wanted = set(np.linspace(0, VIDEO_FRAMES - 1, SAMPLED, dtype=int).tolist())
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(video=0)) if i in wanted]
    height, width = CLIP
    resized_frames = [
        np.asarray(Image.fromarray(f).resize((width, height), resample=Image.Resampling.BICUBIC)) for f in frames
    ]
    return np.stack(resized_frames)


def video_chat(data: bytes, image: bytes | None = None) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": "what happens"}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": data_url(image, "image/png")}})
    content.append({"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}})
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


@pytest.mark.parametrize("max_num_tokens", [8192, 64])
def test_a_video_is_one_item_of_its_resized_sampled_frames_and_the_reference_reports_it(
    max_num_tokens: int, mp4: bytes, encoder: VisionEncoder, stack: Stack
) -> None:
    """With encoder.max_num_tokens=64 the video's 336 tokens pass the per-iteration budget: the scheduler runs the
    atomic item alone under a raised budget (and the image in another iteration), so the request completes."""
    video = {"video": {"num_frames": SAMPLED}}
    with stack(media=video, encoder={"max_num_tokens": max_num_tokens}) as (url, engine_url):
        response = chat(url, video_chat(mp4, png(SQUARE, 1)))
        decoded = metric(url, "mmgate_media_frames_decoded_total", modality="video")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
        idle = wait_idle(engine_url)
    assert response.status_code == 200, response.text
    lines = response.json()["choices"][0]["message"]["content"].splitlines()
    clip = expected_clip(mp4)
    assert clip.shape == (SAMPLED, *CLIP, 3)
    processed = process_video(clip, encoder.geometry)
    assert processed.grid_thw.tolist() == [[4, 6, 14]]
    digest = embedding_sha256(encoder.forward(processed.pixel_values, processed.grid_thw))
    assert lines[0].startswith("image 0: 4 rows x 128, sha256 ")
    assert lines[1] == f"video 1: 84 rows x 128 (grid 4x6x14), sha256 {digest}"
    assert lines[2].startswith("reference reply: 2 item(s), 88 embedding row(s)")
    assert decoded == SAMPLED
    assert in_use == 0
    assert idle["budgets"]["effective_max_num_tokens"] == max(max_num_tokens, 336)


@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
def test_the_openai_handoff_refuses_a_video_at_submit_and_the_client_gets_the_400(
    fmt: str, mp4: bytes, stack: Stack, stub_llm: tuple[StubLLM, str]
) -> None:
    llm, llm_url = stub_llm
    handoff = {"backend": "openai", "url": llm_url, "format": fmt}
    with stack(media={"video": {"num_frames": SAMPLED}}, handoff=handoff) as (url, engine_url):
        response = chat(url, video_chat(mp4))
        in_use = metric(url, "mmgate_budget_in_use_bytes")
        idle = wait_idle(engine_url)
        encoded = metric(engine_url, "mmgate_engine_items_encoded_total")
        refused = metric(engine_url, "mmgate_engine_admission_rejections_total", reason="unsupported")
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    assert "item 0 (messages[0].content[1].video_url) is a video" in message
    assert f"handoff.backend=openai with handoff.format={fmt} forwards image embeddings only" in message
    assert response.json()["type"] == "BadRequestError"
    assert encoded == 0
    assert refused == 1
    assert in_use == 0
    assert idle["resident_bytes"] == 0
    assert llm.state.received == []
    assert llm.state.refused == []


def test_every_engine_call_of_a_request_carries_the_clients_request_id(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine logs the submit and the response claim under the request id the client sent, so one id finds a
    request in both processes' logs."""
    body = chat_body(data_url(png(SQUARE, 2), "image/png"), text="what is it")
    caplog.set_level("INFO", logger="mmgate.access")
    with stack(server={"access_log": True}) as (url, engine_url):
        response = chat(url, body, **{"X-Request-ID": "trace-me-42"})
        wait_idle(engine_url)
    assert response.status_code == 200, response.text
    engine_calls = [
        line
        for line in (orjson.loads(record.getMessage()) for record in caplog.records if record.name == "mmgate.access")
        if line["path"].startswith("/internal/v1/requests")
    ]
    assert [(line["method"], line["path"].rsplit("/", 1)[-1] == "response") for line in engine_calls] == [
        ("POST", False),
        ("GET", True),
    ]
    assert {line["request_id"] for line in engine_calls} == {"trace-me-42"}


@pytest.mark.parametrize("status", [400, 404])
def test_the_llm_servers_own_errors_reach_the_client_as_it_sent_them(
    status: int, stack: Stack, stub_llm: tuple[StubLLM, str], caplog: pytest.LogCaptureFixture
) -> None:
    """An error answer of the LLM server (vLLM's 404 for an unknown model, its 400s) is the client's answer: the
    engine relays it and the gateway passes it through, neither taking it for an engine refusal."""
    llm, llm_url = stub_llm
    llm.state.server = "vllm"
    body = chat_body(data_url(png(SQUARE, 3), "image/png"), model=f"status-{status}")
    caplog.set_level("INFO", logger="mmgate.access")
    handoff = {"backend": "openai", "url": llm_url}
    with stack(handoff=handoff, gateway={"server": {"access_log": True}}) as (url, engine_url):
        response = chat(url, body)
        wait_idle(engine_url)
    assert response.status_code == status
    assert response.content == b'{"detail":"the stub refuses"}'
    assert "x-mmgate-engine-error" not in response.headers
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    (chat_line,) = [line for line in lines if line["path"] == "/v1/chat/completions"]
    assert chat_line["status"] == status
    assert "client_disconnected" not in chat_line  # the client stayed for its whole answer


def test_the_llm_server_refusing_the_engines_credentials_is_a_502_naming_handoff_api_key(
    stack: Stack, stub_llm: tuple[StubLLM, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A 401 from the LLM server is the engine's configuration (handoff.api_key), not the client's key: the client
    gets a 502, and the logs name the key to fix, not the gateway's engine.auth_token."""
    llm, llm_url = stub_llm
    llm.state.server = "vllm"
    body = chat_body(data_url(png(SQUARE, 4), "image/png"), model="status-401")
    caplog.set_level("INFO")
    handoff = {"backend": "openai", "url": llm_url}
    with stack(handoff=handoff, gateway={"server": {"access_log": True}}) as (url, engine_url):
        response = chat(url, body)
        wait_idle(engine_url)
    assert response.status_code == 502, response.text
    assert response.json()["message"].startswith("the upstream model server is unreachable or failed; request id")
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "refused the engine's credentials with 401 (handoff.api_key: none was configured)" in logged
    assert "engine.auth_token" not in logged
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]
    (chat_line,) = [line for line in lines if line["path"] == "/v1/chat/completions"]
    assert chat_line["status"] == 502
    assert "client_disconnected" not in chat_line


def torch_resized(data: bytes) -> npt.NDArray[np.uint8]:
    """This image resized as transformers' torchvision processor does on the CPU: torch's antialiased bicubic
    uint8 kernel, to the smart_resize size."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.array(image.convert("RGB"))  # writable: torch.from_numpy warns on a read-only array
    height, width = resized(data).shape[:2]
    tensor = torch.from_numpy(rgb).permute(2, 0, 1)[None].contiguous()
    out = torch.nn.functional.interpolate(tensor, size=(height, width), mode="bicubic", antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def test_with_model_resize_torchvision_the_gateway_resizes_as_torchvision_does(
    stack: Stack, stub_llm: tuple[StubLLM, str]
) -> None:
    """The engine's `model.resize` reaches the gateway through its status, and the pixels the LLM server gets
    are exactly torch's resize of the image, not Pillow's."""
    llm, llm_url = stub_llm
    llm.state.server = "trtllm"
    images = [png(PORTRAIT, 5), png(LANDSCAPE, 6)]
    body = chat_body(*(data_url(image, "image/png") for image in images), text="compare them")
    handoff = {"backend": "openai", "url": llm_url, "format": "trtllm"}
    with stack(handoff=handoff, model={"resize": "torchvision"}) as (url, engine_url):
        status = httpx.get(engine_url + "/internal/v1/status", timeout=10).json()
        response = chat(url, body)
        wait_idle(engine_url)
    assert status["processor"]["resize"] == "torchvision"
    assert response.status_code == 200, response.text
    (seen,) = llm.state.received
    assert len(seen.images) == len(images)  # a portrait: sent as pixels
    for index, data in enumerate(images):
        expected = torch_resized(data)
        assert np.array_equal(seen.images[index], expected), f"item {index}"
        assert not np.array_equal(expected, resized(data)), f"item {index}: Pillow's resize is not torch's"
