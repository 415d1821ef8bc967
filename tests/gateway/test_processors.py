"""`media.processor`: `auto` (the default) charges what the processor of the upstream's served model holds, read
from the upstream's `GET /v1/models`; until it names a model of a known family (and for a model of none), the
largest of the known families' charges."""

from __future__ import annotations

import logging

import httpx
import pytest

from gateway.config import GatewaySettings
from gateway.processors import FAMILIES, Processors, all_families, family, load
from processor_geometry import QWEN3_VL, image_geometry
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream

CHAT = "/v1/chat/completions"
SIDE = (640, 480)
DECODED = SIDE[0] * SIDE[1] * 4  # Pillow's RGB, 4 bytes a pixel


@pytest.mark.parametrize(
    ("names", "processor"),
    [
        (["Qwen/Qwen2.5-VL-7B-Instruct"], "qwen2_5_vl"),
        (["my-model", "/models/Qwen3-VL-8B-Instruct"], "qwen3_vl"),  # a served name, the checkpoint as its root
        (["qwen2-vl-2b"], "qwen2_vl"),
        (["Qwen2_5_VL_3B"], "qwen2_5_vl"),
        (["llava-1.5-7b", "meta-llama/Llama-3.2-11B-Vision"], None),
        (["google/gemma-3-27b-it"], "gemma3"),
        (["google/gemma-3n-E4B-it"], None),  # Gemma 3n: another vision tower and processor
        (["meta-llama/Llama-4-Scout-17B-16E-Instruct-FP8"], "llama4"),
        (["OpenGVLab/InternVL3-8B-hf"], "internvl3"),
        (["mistralai/Mistral-Small-3.1-24B-Instruct-2503"], "mistral3"),
        (["mistral-community/pixtral-12b"], "pixtral"),
        (["microsoft/Phi-4-multimodal-instruct"], "phi4_multimodal"),
        (["llava-hf/llava-onevision-qwen2-7b-ov-hf"], "llava_onevision"),
        (["zai-org/GLM-4.5V-FP8"], "glm4v"),
        (["THUDM/GLM-4.1V-9B-Thinking"], "glm4v"),
        (["/models/GLM_4_1V_9B"], "glm4v"),
        (["QWEN2.5-VL-72B-INSTRUCT-AWQ"], "qwen2_5_vl"),
    ],
)
def test_the_family_comes_from_the_served_names(names: list[str], processor: str | None) -> None:
    assert family(names) == processor


def test_the_default_is_auto_and_null_turns_it_off() -> None:
    assert GatewaySettings().media.processor == "auto"
    assert GatewaySettings(media={"processor": None}).media.processor is None  # type: ignore[arg-type]
    assert Processors(None).candidates == ()
    assert [f.name for f in Processors("qwen3_vl").candidates] == ["qwen3_vl"]
    assert [f.name for f in Processors("auto").candidates] == list(FAMILIES)


def processed(name: str) -> int:
    return load(name).image(SIDE[1], SIDE[0]).peak


@pytest.mark.parametrize(
    ("models", "label", "processor"),
    [
        (
            [{"id": "Qwen/Qwen2.5-VL-7B-Instruct", "root": "Qwen/Qwen2.5-VL-7B-Instruct"}],
            "auto: qwen2_5_vl",
            "qwen2_5_vl",
        ),
        ([{"id": "some-other-model"}], "auto: the largest of the known families", None),
        (None, "auto: the largest of the known families", None),  # no model list at all
    ],
)
def test_auto_follows_the_upstreams_model_or_charges_the_largest(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    models: list[dict[str, str]] | None,
    label: str,
    processor: str | None,
) -> None:
    app, upstream = stub
    app.state.models = models
    largest = max(family.image(SIDE[1], SIDE[0]).peak for family in all_families())
    expected = processed(processor) if processor is not None else largest
    # A cap one byte short of what the charge needs: the 413 names the processor and the bytes (slots: the charge
    # made as the image loads; bytes mode refuses the same total from the headers, before the budget).
    body = chat_body(data_url(image_bytes(*SIDE)))
    cap = DECODED + expected + len(body) - 1
    limits = {"max_multimodal_cpu_bytes": cap, "budget_mode": "slots"}
    with make_gateway(upstream, media={"processor": "auto"}, limits=limits) as (_, url):
        ready = httpx.get(url + "/readyz").json()
        refused = httpx.post(url + CHAT, content=body, timeout=30)
    assert ready["processor"] == f"media.processor={label}"
    assert refused.status_code == 413, refused.text
    assert refused.json()["message"] == (
        f"processed tensors (media.processor={label}) reached {cap + 1:,} bytes (raw body {len(body):,} included), "
        f"over limits.max_multimodal_cpu_bytes_per_request={cap:,}"
    )


def test_auto_asks_again_at_readiness_until_the_upstream_names_its_model(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """An upstream that was not serving yet at start-up: the next readiness probe picks its model up."""
    app, upstream = stub
    with make_gateway(upstream, media={"processor": "auto"}, upstream={"ready_cache_s": 0}) as (gateway, url):
        assert gateway.processors.deciding
        app.state.models = [{"id": "Qwen/Qwen3-VL-2B-Instruct"}]
        assert httpx.get(url + "/readyz").json()["processor"] == "media.processor=auto: qwen3_vl"
        assert gateway.processors.chosen is not None
        assert gateway.processors.chosen.name == "qwen3_vl"
        app.state.models = [{"id": "Qwen/Qwen2.5-VL-7B-Instruct"}]
        httpx.get(url + "/readyz")
    # Once known it is kept: a restart with another model restarts it.
    assert gateway.processors.chosen.name == "qwen3_vl"


def test_an_unknown_model_warns_once_and_is_charged_the_largest(caplog: pytest.LogCaptureFixture) -> None:
    processors = Processors("auto")
    with caplog.at_level(logging.WARNING, logger="mmgate.gateway"):
        processors.choose({"data": [{"id": "acme/vision-9000", "root": "acme/vision-9000"}]})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "media.processor" in warnings[0]
    assert "acme/vision-9000" in warnings[0]
    assert not processors.deciding  # not asked again at every probe
    assert processors.label == "media.processor=auto: the largest of the known families"
    assert len(processors.candidates) == len(FAMILIES)


@pytest.mark.parametrize(
    ("height", "width"),
    [(480, 640), (300, 400), (1080, 1920), (50, 50), (31, 700), (2048, 1536), (333, 777), (17, 3000), (256, 255)],
)
def test_qwen3_vl_image_charge_is_transformers_qwen3_vl_image_processor_output(height: int, width: int) -> None:
    """pixel_values float32 [patches, 3 x 2 x 16 x 16] plus image_grid_thw int64 [1, 3], as transformers makes
    them for a Qwen3-VL checkpoint."""
    import numpy as np

    from tests.gateway.media.qwen3_vl_oracle import image_processor

    image = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = image_processor()(images=[image], return_tensors="pt")
    geometry = image_geometry(height, width, QWEN3_VL)
    assert out["pixel_values"].shape[1] == QWEN3_VL.row_width == 1536
    assert tuple(out["image_grid_thw"].tolist()[0]) == geometry.grid_thw
    assert geometry.processed_bytes == out["pixel_values"].nbytes
    assert geometry.llm_tokens == out["pixel_values"].shape[0] // 4
    assert out["image_grid_thw"].nbytes == 3 * 8  # not charged: the grid is 24 bytes an image
