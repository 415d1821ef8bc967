"""Gateway -> engine -> stub LLM, all real servers on loopback, for both hand-off forms, with one image and with
several of different aspect ratios: per item, the grid the LLM places the rows with, the row count, and what it
decoded (embeddings equal to an independent encode of the gateway's resized pixels; for trtllm-serve's pixel
fallback, exactly those pixels)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import torch
from PIL import Image

from engine_adapter.client import QWEN2_VL
from engine_adapter.encoder import VisionEncoder
from engine_adapter.processor import process_image
from gateway.engine_mode import pixel_preparer
from tests.conftest import EngineFactory, GatewayFactory, engine_settings
from tests.engine_adapter.conftest import wait_idle
from tests.engine_adapter.stub_llm import StubLLM
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
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
        return pixel_preparer(QWEN2_VL)(image.convert("RGB"))[0]


def through_the_gateway(
    make_engine: EngineFactory,
    make_gateway: GatewayFactory,
    upstream_url: str,
    stub_url: str,
    fmt: str,
    images: list[bytes],
) -> httpx.Response:
    body = chat_body(*(data_url(image, "image/png") for image in images), text="compare them")
    handoff = {"backend": "openai", "url": stub_url, "format": fmt}
    gateway = {"engine": {"url": ""}, "media": {"processor": "qwen2_vl"}}
    with make_engine(handoff=handoff) as (_, engine_url):
        gateway["engine"]["url"] = engine_url
        with make_gateway(upstream_url, **gateway) as (_, url):
            response = httpx.post(url + "/v1/chat/completions", content=body, timeout=60)
        wait_idle(engine_url)
    return response


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_places_every_item_with_its_grid_and_its_rows(
    case: str,
    encoder: VisionEncoder,
    make_engine: EngineFactory,
    make_gateway: GatewayFactory,
    stub_llm: tuple[StubLLM, str],
    stub: tuple[StubUpstream, str],
) -> None:
    llm, llm_url = stub_llm
    llm.state.server = "vllm"
    images = [png(size, seed) for seed, size in enumerate(CASES[case])]
    response = through_the_gateway(make_engine, make_gateway, stub[1], llm_url, "vllm", images)
    assert response.status_code == 200, response.text
    assert llm.state.refused == []
    (seen,) = llm.state.received
    assert len(seen.embeds) == len(images)
    for index, data in enumerate(images):
        pixels = resized(data)
        height, width = pixels.shape[:2]
        grid = [1, height // 14, width // 14]
        grid_tensor = seen.grids[index]
        assert grid_tensor is not None
        assert grid_tensor.tolist() == grid, f"item {index}"
        assert seen.embeds[index].shape == (grid[1] * grid[2] // 4, 128), f"item {index}"
        processed = process_image(pixels, encoder.geometry)
        expected = encoder.forward(processed.pixel_values, processed.grid_thw)
        torch.testing.assert_close(seen.embeds[index], expected, rtol=1e-4, atol=1e-5, msg=f"item {index}")


@pytest.mark.parametrize("case", list(CASES))
def test_trtllm_gets_pixels_when_it_would_misplace_a_portrait(
    case: str,
    make_engine: EngineFactory,
    make_gateway: GatewayFactory,
    stub_llm: tuple[StubLLM, str],
    stub: tuple[StubUpstream, str],
) -> None:
    llm, llm_url = stub_llm
    llm.state.server = "trtllm"
    images = [png(size, seed) for seed, size in enumerate(CASES[case])]
    response = through_the_gateway(make_engine, make_gateway, stub[1], llm_url, "trtllm", images)
    assert response.status_code == 200, response.text
    assert llm.state.refused == []
    (seen,) = llm.state.received
    # A portrait's grid is never the one trtllm-serve infers: the whole request went as pixels, none as rows.
    assert seen.embeds == []
    assert len(seen.images) == len(images)
    for index, data in enumerate(images):
        assert np.array_equal(seen.images[index], resized(data)), f"item {index}"


def test_trtllm_gets_embeddings_when_it_infers_every_grid_right(
    make_engine: EngineFactory,
    make_gateway: GatewayFactory,
    stub_llm: tuple[StubLLM, str],
    stub: tuple[StubUpstream, str],
) -> None:
    llm, llm_url = stub_llm
    llm.state.server = "trtllm"
    images = [png(LANDSCAPE, 0), png(SQUARE, 1)]
    response = through_the_gateway(make_engine, make_gateway, stub[1], llm_url, "trtllm", images)
    assert response.status_code == 200, response.text
    (seen,) = llm.state.received
    assert seen.images == []
    truth = []
    for data in images:
        height, width = resized(data).shape[:2]
        truth.append([1, height // 14, width // 14])
    assert [grid.tolist() for grid in seen.grids if grid is not None] == truth == [[1, 22, 36], [1, 4, 4]]
    assert [e.shape[0] for e in seen.embeds] == [198, 4]
