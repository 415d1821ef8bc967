"""Engine mode in front of a real vLLM: the gateway resizes each image, the engine encodes it with the checkpoint's
own vision tower and hands the embeddings to vLLM (`--enable-mm-embeds`), and the client gets what vLLM answers
when it is sent the image itself.

Two hand-off targets: the session's vLLM, which also has its tower, and one started here in embeddings-only mode
(`--limit-mm-per-prompt '{"image": 0, "video": 0}'`: no tower run, no encoder profiled). The direct answers always
come from the session's vLLM encoding the image itself.
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.__main__ import ENGINE
from engine_adapter.app import EngineApp
from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import GatewaySettings
from tests.conftest import engine_settings
from tests.e2e.conftest import VLLMFactory
from tests.e2e.support import (
    EMBEDS_ONLY_LIMITS,
    EMBEDS_ONLY_LOG_LINE,
    Answer,
    VLLMServer,
    assert_answers_alike,
    encoded,
    image_chat,
    pattern_jpeg,
    post,
    sse_events,
    streamed_text_and_usage,
)
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(600)

# Greedy and seeded, with each generated token's top-5 logprobs: the same prompt gets the same tokens on every path.
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "seed": 1234, "logprobs": True, "top_logprobs": 5}
# (width, height) of each image of a case, and the seed of its pattern. 448 x 448 is on Qwen2-VL's 28-pixel grid
# (no resize); the others are resized by the gateway (and by vLLM's processor when it gets the image itself).
CASES: dict[str, list[tuple[int, int, int]]] = {
    "square 448x448": [(448, 448, 1)],
    "portrait 300x500": [(300, 500, 2)],
    "landscape 500x300": [(500, 300, 3)],
    "resized 1000x700": [(1000, 700, 4)],
    "three images 300x500, 500x300, 224x224": [(300, 500, 5), (500, 300, 6), (224, 224, 7)],
}
TARGETS = ("vllm", "embeds-only vllm")


@pytest.fixture(scope="module")
def embeds_only_vllm(start_vllm: VLLMFactory) -> Iterator[VLLMServer]:
    """A second vLLM that takes image embeddings only: every media limit 0 with --enable-mm-embeds."""
    with start_vllm("vllm-embeds-only", mm_limits=EMBEDS_ONLY_LIMITS) as server:
        yield server


def embedding_width(checkpoint: Path) -> int:
    """The width of the embedding rows vLLM takes for the checkpoint's images: the text model's hidden size, times
    1 + the DeepStack layers for Qwen3-VL (its visual features, then each DeepStack merger's)."""
    config = json.loads((checkpoint / "config.json").read_text())
    deepstack = config["vision_config"].get("deepstack_visual_indexes") or []
    return int(config["text_config"]["hidden_size"]) * (1 + len(deepstack))


@contextmanager
def engine_mode(
    target: VLLMServer, checkpoint: Path, resize: str = "torchvision", processor: str = "qwen2_vl"
) -> Iterator[str]:
    """The engine (the checkpoint's vision tower, float32 on the CPU, handing off in vLLM's form to `target`) and the
    gateway in engine mode in front of it, `target` its plain upstream, `processor` its `media.processor`; yields
    the gateway's URL."""
    settings = engine_settings(
        model={"preset": None, "checkpoint": str(checkpoint), "resize": resize},
        handoff={
            "backend": "openai",
            "format": "vllm",
            "url": target.url,
            "expected_hidden_size": embedding_width(checkpoint),
            "expected_dtype": "float32",
        },
        server={"access_log": False},
    )
    engine = EngineApp(settings)
    with ServerThread(engine, config=ENGINE.server_config(engine, settings)) as engine_server:
        gateway_settings = GatewaySettings(
            upstream={"url": target.url},
            engine={"url": engine_server.url},
            server={"access_log": False, "log_level": "warning"},
            media={"processor": processor},
        )
        gateway = Gateway(gateway_settings)
        with ServerThread(gateway, config=GATEWAY.server_config(gateway, gateway_settings)) as server:
            yield server.url


@pytest.fixture(scope="module")
def through(vllm: VLLMServer, embeds_only_vllm: VLLMServer, vllm_checkpoint: Path) -> Iterator[dict[str, str]]:
    """The gateway URL of engine mode for each hand-off target."""
    with (
        engine_mode(vllm, vllm_checkpoint) as to_vllm,
        engine_mode(embeds_only_vllm, vllm_checkpoint) as to_embeds_only,
    ):
        yield {"vllm": to_vllm, "embeds-only vllm": to_embeds_only}


@pytest.fixture(scope="module")
def bodies() -> dict[str, bytes]:
    return {
        case: encoded(image_chat(*(pattern_jpeg(w, h, seed) for w, h, seed in images), **GREEDY))
        for case, images in CASES.items()
    }


@pytest.fixture(scope="module")
def direct(vllm: VLLMServer, bodies: dict[str, bytes]) -> dict[str, Answer]:
    """vLLM's answer to each case when it is sent the images and encodes them itself."""
    return {case: Answer.of(post(vllm.url, body)) for case, body in bodies.items()}


def embeds_only_modalities(server: VLLMServer) -> set[str]:
    """The modalities vLLM's log says it takes as embeddings only (vllm/multimodal/encoder_budget.py)."""
    named: set[str] = set()
    for line in server.log_text().splitlines():
        if EMBEDS_ONLY_LOG_LINE in line:
            named |= set(ast.literal_eval(line.split(EMBEDS_ONLY_LOG_LINE, 1)[1].strip()))
    return named


def test_the_embeds_only_vllm_has_no_encoder_of_its_own(vllm: VLLMServer, embeds_only_vllm: VLLMServer) -> None:
    print(f"\nembeds-only: {embeds_only_modalities(embeds_only_vllm)} there, {embeds_only_modalities(vllm)} in vllm")
    assert embeds_only_modalities(embeds_only_vllm) == {"image", "video"}, embeds_only_vllm.log
    # The session's vLLM takes videos too (its limit is VIDEO_LIMIT): no modality is embeddings-only there.
    assert embeds_only_modalities(vllm) == set(), vllm.log
    # It refuses an image it would have to encode itself.
    refused = post(embeds_only_vllm.url, encoded(image_chat(pattern_jpeg(224, 224, 0), **GREEDY)))
    print(f"an image sent to it directly: {refused.status_code} {refused.text}")
    assert refused.status_code == 400, refused.text
    assert "At most 0 image(s)" in refused.json()["error"]["message"]


def test_the_cases_give_different_texts(direct: dict[str, Answer]) -> None:
    texts = {case: answer.text for case, answer in direct.items()}
    print(f"\nvLLM's own greedy answers: {texts}")
    assert len(set(texts.values())) == len(texts), f"two cases gave the same text, so identity shows less: {texts}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_engine_mode_answers_as_vllm_encoding_the_image_itself(
    case: str, target: str, through: dict[str, str], bodies: dict[str, bytes], direct: dict[str, Answer]
) -> None:
    began = time.monotonic()
    got = Answer.of(post(through[target], bodies[case]))
    took = time.monotonic() - began
    diff = assert_answers_alike(got, direct[case], "the engine got other pixels or ran another tower than vLLM's")
    print(f"\n{case} via {target}: {took:.2f} s, max |logprob difference| {diff:.3g}, text {got.text!r}")


def test_a_streamed_engine_mode_chat_is_the_unstreamed_text(
    through: dict[str, str], bodies: dict[str, bytes], direct: dict[str, Answer]
) -> None:
    case = "portrait 300x500"
    request = json.loads(bodies[case])
    streamed = post(
        through["embeds-only vllm"],
        encoded({**request, "stream": True, "stream_options": {"include_usage": True}}),
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert sse_events(streamed.content)[-1] == "[DONE]"
    assert streamed.content.rstrip(b"\n").endswith(b"data: [DONE]")
    text, usage = streamed_text_and_usage(streamed.content)
    unstreamed = Answer.of(post(through["embeds-only vllm"], bodies[case]))
    print(f"\nstreamed via the embeds-only vLLM: {len(sse_events(streamed.content))} events, {text!r}")
    assert text == unstreamed.text == direct[case].text
    assert usage == unstreamed.usage


ERRORS: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {
    # vLLM's 404 for a model it does not serve (the engine sends the client's model name: handoff.model is null).
    "unknown model": (lambda: image_chat(pattern_jpeg(224, 224, 0), **{**GREEDY, "model": "no-such-model"}), 404),
    # vLLM's 400 for a max_tokens it does not take.
    "max_tokens 0": (lambda: image_chat(pattern_jpeg(224, 224, 0), **{**GREEDY, "max_tokens": 0}), 400),
    # vLLM's 400 for a prompt past its context (--max-model-len 4096), found only once the images (or their
    # embeddings) are placed in the prompt: four 1008 x 1008 images are 4 x 1296 tokens.
    "a prompt past the context": (
        lambda: image_chat(*(pattern_jpeg(1008, 1008, seed) for seed in range(4)), **GREEDY),
        400,
    ),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(ERRORS))
def test_vllms_errors_come_back_as_vllm_sent_them(
    case: str, target: str, vllm: VLLMServer, through: dict[str, str]
) -> None:
    build, status = ERRORS[case]
    body = encoded(build())
    want, got = post(vllm.url, body), post(through[target], body)
    print(f"\n{case} via {target}: vLLM answers {want.status_code} {want.text}")
    assert want.status_code == status, want.text
    assert got.status_code == want.status_code, f"status differs: engine mode {got.text}, vLLM {want.text}"
    assert "x-mmgate-engine-error" not in got.headers, f"marked as the engine's own refusal: {got.text}"
    assert got.headers["content-type"] == want.headers["content-type"]
    assert got.content == want.content, f"body differs:\n engine mode {got.content!r}\n vLLM        {want.content!r}"
