"""Qwen3-VL on a real vLLM, both modes: a tiny random Qwen3-VL checkpoint (tests/e2e/make_checkpoint.py
`--family qwen3_vl`: 3 vision blocks, DeepStack mergers after blocks 1 and 2) served by a vLLM of its own.

- Proxy mode: the gateway (`media.processor: qwen3_vl`) in front of it; images and a video answer as vLLM answers
  them directly, and the video's frames and geometry are what vLLM's Qwen3-VL loader and video processor made of it.
- Engine mode: the engine builds the checkpoint's tower (DeepStack mergers included) and hands vLLM `image_embeds`
  rows of 128 x (1 + 2 DeepStack layers) = 384, which vLLM's Qwen3-VL splits into the visual features and the
  DeepStack features it adds to the text model's first two layers. Two targets: this vLLM, and one that takes images
  as embeddings only (`--limit-mm-per-prompt '{"image": 0, "video": 1}'`). The greedy text is vLLM's own encoding
  the image itself, every top logprob within LOGPROB_TOLERANCE.

Not the fully embeddings-only vLLM the Qwen2-VL tests use (every limit 0): vLLM 0.32.0 then builds no vision tower
and turns DeepStack off with it (vllm/model_executor/models/qwen3_vl.py, `Qwen3VLForConditionalGeneration.__init__`:
`use_deepstack = hasattr(config.vision_config, "deepstack_visual_indexes") and not isinstance(self.visual,
StageMissingLayer)`), so the first 384-wide `image_embeds` meets `_merge_multimodal_embeddings` with 128-wide input
embeddings ("shape mismatch: value tensor of shape [256, 384] cannot be broadcast to indexing result of shape
[256, 128]") and its engine core dies (EngineDeadError: every later request fails). A video limit of 1 keeps the
tower, and DeepStack, loaded; images are still embeddings only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import LOOPBACK_FETCH, VLLMFactory, proxy_gateway
from tests.e2e.support import (
    QWEN3_MODEL,
    QWEN_VIDEO_SAMPLING,
    Answer,
    MediaServer,
    VLLMServer,
    assert_answers_alike,
    data_url,
    gateway_video_plan,
    image_chat,
    pattern_jpeg,
    post,
    special_token_id,
    token_ids,
    video_chat,
    video_clip,
)
from tests.e2e.test_vllm_engine_mode import embeds_only_modalities, engine_mode

pytestmark = pytest.mark.timeout(600)

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "seed": 1234, "logprobs": True, "top_logprobs": 5}

# 512 x 512 is on Qwen3-VL's 32-pixel grid (no resize); the others are resized, 224 x 224 up to its 65,536-pixel
# minimum.
CASES: dict[str, list[tuple[int, int, int]]] = {
    "square 512x512": [(512, 512, 31)],
    "portrait 300x500": [(300, 500, 32)],
    "landscape 500x300": [(500, 300, 33)],
    "resized 1000x700": [(1000, 700, 34)],
    "three images 300x500, 500x300, 224x224": [(300, 500, 35), (500, 300, 36), (224, 224, 37)],
}
TARGETS = ("qwen3 vllm", "image-embeds-only qwen3 vllm")
# Images as embeddings only, the tower (and with it DeepStack) kept for videos.
IMAGE_EMBEDS_ONLY_LIMITS = {"image": 0, "video": 1}
# (width, height, frames, rate): 2.5 s and 6 s at 2 frames a second (5 and 12 frames: Qwen3-VL's processor does not
# round to whole temporal patches, it pads the last one).
CLIPS: dict[str, tuple[int, int, int, int]] = {
    "mp4 160x128, 20 frames at 8 fps": (160, 128, 20, 8),
    "mp4 320x240, 36 frames at 6 fps": (320, 240, 36, 6),
}


@pytest.fixture(scope="module")
def qwen3_vllm(start_vllm: VLLMFactory, qwen3_checkpoint: Path) -> Iterator[VLLMServer]:
    """vLLM serving the Qwen3-VL checkpoint with its own tower, taking image embeddings too."""
    with start_vllm("vllm-qwen3-vl", checkpoint=qwen3_checkpoint, served_name=QWEN3_MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def qwen3_embeds_only(start_vllm: VLLMFactory, qwen3_checkpoint: Path) -> Iterator[VLLMServer]:
    """vLLM serving the Qwen3-VL checkpoint that takes images as embeddings only."""
    with start_vllm(
        "vllm-qwen3-vl-image-embeds-only",
        IMAGE_EMBEDS_ONLY_LIMITS,
        checkpoint=qwen3_checkpoint,
        served_name=QWEN3_MODEL,
    ) as server:
        yield server


def test_the_image_embeds_only_vllm_takes_images_as_embeddings_only(qwen3_embeds_only: VLLMServer) -> None:
    assert embeds_only_modalities(qwen3_embeds_only) == {"image"}, qwen3_embeds_only.log
    refused = post(qwen3_embeds_only.url, image_chat(pattern_jpeg(256, 256, 0), model=QWEN3_MODEL, **GREEDY))
    assert refused.status_code == 400, refused.text
    assert "At most 0 image(s)" in refused.json()["error"]["message"]


@pytest.fixture(scope="module")
def qwen3_gateway(qwen3_vllm: VLLMServer) -> Iterator[str]:
    media = {"processor": "qwen3_vl", "video": QWEN_VIDEO_SAMPLING, "fetch": LOOPBACK_FETCH}
    with proxy_gateway(qwen3_vllm.url, media) as url:
        yield url


@pytest.fixture(scope="module")
def bodies() -> dict[str, dict[str, Any]]:
    return {
        case: image_chat(*(pattern_jpeg(w, h, seed) for w, h, seed in images), model=QWEN3_MODEL, **GREEDY)
        for case, images in CASES.items()
    }


@pytest.fixture(scope="module")
def direct(qwen3_vllm: VLLMServer, bodies: dict[str, dict[str, Any]]) -> dict[str, Answer]:
    """vLLM's answer to each case when it is sent the images and encodes them itself."""
    return {case: Answer.of(post(qwen3_vllm.url, body)) for case, body in bodies.items()}


def test_the_cases_give_different_texts(direct: dict[str, Answer]) -> None:
    texts = {case: answer.text for case, answer in direct.items()}
    print(f"\nvLLM's own greedy answers (Qwen3-VL): {texts}")
    assert len(set(texts.values())) == len(texts), f"two cases gave the same text, so identity shows less: {texts}"


# --- proxy mode -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_proxy_mode_answers_as_vllm_directly(
    case: str, qwen3_gateway: str, bodies: dict[str, dict[str, Any]], direct: dict[str, Answer]
) -> None:
    got = Answer.of(post(qwen3_gateway, bodies[case]))
    assert got == direct[case], f"through the gateway {got.text!r}, directly {direct[case].text!r}"


@pytest.mark.parametrize("name", list(CLIPS))
def test_a_video_through_the_gateway_answers_as_vllm_directly(
    name: str, qwen3_vllm: VLLMServer, qwen3_gateway: str, qwen3_checkpoint: Path
) -> None:
    width, height, count, rate = CLIPS[name]
    clip = video_clip(width, height, count, rate=rate, seed=width)
    body = video_chat(data_url(clip, "video/mp4"), model=QWEN3_MODEL, **GREEDY)
    want = Answer.of(post(qwen3_vllm.url, body))
    got = Answer.of(post(qwen3_gateway, body))
    plan = gateway_video_plan(clip, "qwen3_vl")
    tokens = token_ids(qwen3_vllm.url, body).count(special_token_id(qwen3_checkpoint, "<|video_pad|>"))
    print(f"\n{name}: gateway {plan}; vLLM's prompt has {tokens} video tokens; {want.text!r}")
    assert got == want
    assert tokens == plan.rows


def test_an_image_url_through_the_gateway_answers_as_its_bytes_inline(
    qwen3_vllm: VLLMServer, qwen3_gateway: str, bodies: dict[str, dict[str, Any]], direct: dict[str, Answer]
) -> None:
    jpeg = pattern_jpeg(300, 500, 32)  # the portrait case's image
    with MediaServer() as media:
        url = media.serve("/portrait", jpeg)
        body = image_chat(jpeg, model=QWEN3_MODEL, **GREEDY)
        body["messages"][0]["content"][0]["image_url"]["url"] = url
        got = Answer.of(post(qwen3_gateway, body))
        downloads = media.gets["/portrait"]
    assert downloads == 1
    assert got == direct["portrait 300x500"]


# --- engine mode ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def through(qwen3_vllm: VLLMServer, qwen3_embeds_only: VLLMServer, qwen3_checkpoint: Path) -> Iterator[dict[str, str]]:
    """The gateway URL of engine mode (the Qwen3-VL tower, `media.processor: qwen3_vl`) for each hand-off target."""
    with (
        engine_mode(qwen3_vllm, qwen3_checkpoint, processor="qwen3_vl") as to_vllm,
        engine_mode(qwen3_embeds_only, qwen3_checkpoint, processor="qwen3_vl") as to_embeds_only,
    ):
        yield {"qwen3 vllm": to_vllm, "image-embeds-only qwen3 vllm": to_embeds_only}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_engine_mode_answers_as_vllm_encoding_the_image_itself(
    case: str, target: str, through: dict[str, str], bodies: dict[str, dict[str, Any]], direct: dict[str, Answer]
) -> None:
    got = Answer.of(post(through[target], bodies[case]))
    diff = assert_answers_alike(got, direct[case], "the engine's embeddings or DeepStack rows are not vLLM's own")
    print(f"\n{case} via {target}: max |logprob difference| {diff:.3g}, text {got.text!r}")
