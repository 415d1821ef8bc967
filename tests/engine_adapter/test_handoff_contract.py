"""The `openai` hand-off against the receiving rules of the real servers (tests/engine_adapter/stub_llm.py): the
vLLM form that its parser accepts (and the `[1, 3]` grid it refused), trtllm-serve's row -> grid inference and the
pixel fallback where it would be wrong, and what the engine refuses at start-up."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from engine_adapter.config import EmbedsFormat, EngineSettings
from engine_adapter.handoff import Handoff, check_handoff
from engine_adapter.intake import ItemInfo
from engine_adapter.openai_backend import (
    build_payload,
    png_data_url,
    tensor_b64,
    trtllm_inferred_grid,
    trtllm_misplaced,
)
from serving.settings_loader import ConfigError
from tests.conftest import EngineFactory, engine_settings
from tests.engine_adapter.conftest import REQUESTS, admitted, metric_samples, pixels, status, submit_body, wait_idle
from tests.engine_adapter.stub_llm import Refusal, StubLLM, receive
from tests.engine_adapter.stub_llm import trtllm_inferred_grid as stub_inferred_grid

WIDTH = 128


def handoff_of(grids: list[tuple[int, int, int]], seed: int = 0) -> Handoff:
    """A hand-off of images with these grids and random rows."""
    rows = [t * h * w // 4 for t, h, w in grids]
    offsets = tuple(int(x) for x in np.cumsum([0, *rows]))
    items = tuple(ItemInfo("image", f"image-{i}", grid, n) for i, (grid, n) in enumerate(zip(grids, rows, strict=True)))
    content: list[Any] = [{"type": "text", "text": "look"}]
    content += [{"type": "mmgate_item", "index": i} for i in range(len(grids))]
    document = {"model": "m", "messages": [{"role": "user", "content": content}]}
    embeddings = torch.randn(offsets[-1], WIDTH, generator=torch.Generator().manual_seed(seed))
    return Handoff("job", "req", document, items, embeddings, offsets)


def old_vllm_payload(handoff: Handoff) -> dict[str, Any]:
    """What mmgate sent before: each part's grid an int64 tensor of shape [1, 3]."""
    document = orjson.loads(build_payload(handoff, EmbedsFormat.VLLM, None))
    parts = [p for p in document["messages"][0]["content"] if p["type"] == "image_embeds"]
    for part, item in zip(parts, handoff.items, strict=True):
        part["image_embeds"]["image_grid_thw"] = tensor_b64(torch.tensor([item.grid_thw], dtype=torch.int64))
    return dict(document)


GRIDS = [[(1, 4, 6)], [(1, 4, 6), (1, 6, 4), (1, 4, 4)]]


@pytest.mark.parametrize("grids", GRIDS, ids=["one", "three"])
def test_vllm_places_each_item_with_its_grid_and_rows(grids: list[tuple[int, int, int]]) -> None:
    handoff = handoff_of(grids)
    seen = receive(orjson.loads(build_payload(handoff, EmbedsFormat.VLLM, None)), "vllm", WIDTH)
    assert [tuple(grid.tolist()) for grid in seen.grids if grid is not None] == grids
    for index, placed in enumerate(seen.embeds):
        assert torch.equal(placed, handoff.rows(index))


@pytest.mark.parametrize("grids", GRIDS, ids=["one", "three"])
def test_vllm_refuses_the_old_one_by_three_grid(grids: list[tuple[int, int, int]]) -> None:
    """The bug: per-part `[1, 3]` grids stack to `[items, 1, 3]`, which vLLM refuses for every request."""
    with pytest.raises(Refusal) as refused:
        receive(old_vllm_payload(handoff_of(grids)), "vllm", WIDTH)
    assert refused.value.status == 400
    assert refused.value.message.startswith("size_per_item should be a 1-D tensor, but found shape")


def test_vllm_refuses_rows_of_another_width_and_a_missing_grid() -> None:
    document = orjson.loads(build_payload(handoff_of([(1, 4, 4)]), EmbedsFormat.VLLM, None))
    with pytest.raises(Refusal, match="the LLM's hidden size"):
        receive(document, "vllm", 3584)
    del document["messages"][0]["content"][1]["image_embeds"]["image_grid_thw"]
    with pytest.raises(Refusal, match="image_grid_thw"):
        receive(document, "vllm", WIDTH)


@pytest.mark.parametrize(
    ("grid", "inferred"),
    [((1, 6, 4), (1, 4, 6)), ((1, 24, 40), (1, 30, 32)), ((1, 4, 6), (1, 4, 6)), ((1, 22, 36), (1, 22, 36))],
)
def test_trtllm_infers_the_grid_from_the_row_count(grid: tuple[int, int, int], inferred: tuple[int, int, int]) -> None:
    rows = grid[0] * grid[1] * grid[2] // 4
    assert trtllm_inferred_grid(rows) == inferred
    assert stub_inferred_grid(rows) == inferred
    assert trtllm_misplaced([ItemInfo("image", "x", grid, rows)]) == ([] if grid == inferred else [0])


def test_the_engines_inference_is_the_stubs() -> None:
    for rows in range(1, 3000):
        assert trtllm_inferred_grid(rows) == stub_inferred_grid(rows), rows


def test_trtllm_refuses_embeddings_mixed_with_media() -> None:
    document = orjson.loads(build_payload(handoff_of([(1, 4, 6)]), EmbedsFormat.TRTLLM, None))
    url = png_data_url(pixels(28, 28))
    document["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": url}})
    with pytest.raises(Refusal, match="Mixing"):
        receive(document, "trtllm", WIDTH)


def test_trtllm_request_with_a_misplaced_item_goes_as_pixels(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.server = "trtllm"
    handoff = {"backend": "openai", "url": stub_url, "format": "trtllm"}
    landscape, portrait = pixels(56, 84), pixels(84, 56, seed=1)
    with make_engine(handoff=handoff) as (_, url):
        # Landscape only: trtllm-serve infers [1, 4, 6] from 6 rows, which is right: embeddings.
        first = admitted(url, submit_body("landscape", [landscape]))
        assert httpx.get(f"{url}{REQUESTS}/{first}/response", timeout=30).status_code == 200
        # With a portrait ([1, 6, 4], inferred [1, 4, 6]) every item of the request goes as pixels.
        second = admitted(url, submit_body("mixed", [landscape, portrait]))
        response = httpx.get(f"{url}{REQUESTS}/{second}/response", timeout=30)
        assert response.status_code == 200
        assert response.json() == {"choices": [{"message": {"content": "stub saw 0 image embed(s) and 2 image(s)"}}]}
        idle = wait_idle(url)
        assert idle["handoff"]["pixel_fallbacks"] == 1
        assert metric_samples(url)["mmgate_engine_handoff_pixel_fallbacks_total"] == 1
    embeds = stub.state.by_request_id("landscape")
    assert [grid.tolist() for grid in embeds.grids if grid is not None] == [[1, 4, 6]]
    assert embeds.images == []
    seen = stub.state.by_request_id("mixed")
    assert seen.embeds == []
    assert [part["type"] for part in seen.document["messages"][0]["content"]] == ["text", "image_url", "image_url"]
    # Lossless: the server decodes exactly the pixels the engine got.
    assert [hashlib.sha256(image.tobytes()).hexdigest() for image in seen.images] == [
        hashlib.sha256(image.tobytes()).hexdigest() for image in (landscape, portrait)
    ]
    assert all(np.array_equal(got, sent) for got, sent in zip(seen.images, (landscape, portrait), strict=True))
    assert stub.state.refused == []


def test_a_server_refusal_reaches_the_caller_in_its_envelope(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.server = "vllm"
    stub.state.hidden_size = 3584  # an LLM whose hidden size is not the tiny tower's
    with make_engine(handoff={"backend": "openai", "url": stub_url, "format": "vllm"}) as (_, url):
        job_id = admitted(url, submit_body("wide", [pixels(56, 56)]))
        response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        wait_idle(url)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    assert "[n, 3584]" in response.json()["error"]["message"]


# Start-up: what every hand-off would get wrong is refused before the engine serves.


@pytest.mark.parametrize(
    ("handoff", "model", "key"),
    [
        ({"expected_hidden_size": 3584}, {}, "handoff.expected_hidden_size = 3584"),
        ({"expected_dtype": "bfloat16"}, {}, "handoff.expected_dtype = 'bfloat16'"),
    ],
)
def test_startup_refuses_a_width_or_dtype_the_llm_does_not_take(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str], handoff: dict[str, Any], model: dict[str, Any], key: str
) -> None:
    _, stub_url = stub_llm
    with pytest.raises(ConfigError) as refused, make_engine(handoff={"backend": "openai", "url": stub_url, **handoff}):
        pass
    assert str(refused.value).startswith(key)
    assert "tiny" in str(refused.value) or "float32" in str(refused.value)


def test_startup_refuses_trtllm_for_a_geometry_its_inference_is_not_known_for() -> None:
    settings = EngineSettings(handoff={"backend": "openai", "url": "http://127.0.0.1:9", "format": "trtllm"})
    with pytest.raises(ConfigError, match=r"handoff\.format = 'trtllm' with processor geometry 'qwen3_vl'"):
        check_handoff(settings.handoff, WIDTH, torch.float32, "qwen3_vl", "some-qwen3")
    check_handoff(settings.handoff, WIDTH, torch.float32, "qwen2_5_vl", "tiny-2.5")
    vllm = EngineSettings(handoff={"backend": "openai", "url": "http://127.0.0.1:9", "format": "vllm"})
    check_handoff(vllm.handoff, WIDTH, torch.float32, "qwen3_vl", "some-qwen3")


def test_status_reports_what_the_handoff_sends_and_the_geometry(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    _, stub_url = stub_llm
    handoff = {"backend": "openai", "url": stub_url, "expected_hidden_size": 128, "expected_dtype": "float32"}
    with make_engine(handoff=handoff, model={"max_pixels": 1003520}) as (_, url):
        seen = status(url)
    assert seen["handoff"] | {"url": None} == {
        "backend": "openai",
        "url": None,
        "format": "vllm",
        "max_concurrency": 8,
        "in_flight": 0,
        "embedding_width": 128,
        "embedding_dtype": "float32",
        "expected_hidden_size": 128,
        "expected_dtype": "float32",
        "pixel_fallbacks": 0,
    }
    assert seen["processor"] == {
        "geometry": "qwen2_vl",
        "min_pixels": 3136,
        "max_pixels": 1003520,
        "factor": 28,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "channels": 3,
        "resize": "pil",
        "video_bounds": "frame",
        "video_min_pixels": 3136,  # a Qwen2-VL video processor takes the image bounds, per frame
        "video_max_pixels": 1003520,
    }


def test_status_reports_a_qwen3_vl_engines_video_bounds(make_engine: EngineFactory) -> None:
    with make_engine(model={"preset": "tiny-3"}) as (_, url):
        preset = status(url)["processor"]
    with make_engine(model={"preset": "tiny-3", "video_max_pixels": 1 << 20}) as (_, url):
        configured = status(url)["processor"]
    assert (preset["geometry"], preset["video_bounds"]) == ("qwen3_vl", "clip")
    assert (preset["video_min_pixels"], preset["video_max_pixels"]) == (4096, 25165824)
    assert (preset["min_pixels"], preset["max_pixels"]) == (65536, 16777216)
    assert (configured["video_min_pixels"], configured["video_max_pixels"]) == (4096, 1 << 20)
    assert configured["max_pixels"] == 16777216


def test_engine_settings_refuse_an_unknown_expected_dtype() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        engine_settings(handoff={"expected_dtype": "int8"})
