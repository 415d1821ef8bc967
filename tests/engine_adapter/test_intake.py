"""Reading a submit: the item checks against the engine's geometry and the encoder items a video becomes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch

from engine_adapter.client.wire import WireItem, encode_submit, item_part
from engine_adapter.encoder import VisionEncoder
from engine_adapter.errors import BadRequest
from engine_adapter.intake import read_submit
from tests.conftest import engine_settings
from tests.engine_adapter.conftest import pixels

# The model's pixel bounds raised so that a 56x56 frame is under its minimum (3,136 < 4,704).
MIN_PIXELS = 56 * 84


@pytest.fixture(scope="module")
def encoder() -> Iterator[VisionEncoder]:
    loaded = VisionEncoder(engine_settings(model={"min_pixels": MIN_PIXELS}).model)
    yield loaded
    loaded.close()


def body(modality: str, item: npt.NDArray[np.uint8]) -> bytes:
    document = {"model": "m", "messages": [{"role": "user", "content": [item_part(0)]}]}
    digest = hashlib.sha256(item.tobytes()).hexdigest()
    return encode_submit("r1", document, [WireItem(modality, "messages[0].content[0]", digest, item)])


def test_a_video_is_one_encoder_item_of_its_whole_grid(encoder: VisionEncoder) -> None:
    # 5 frames of 84x112: padded to 3 temporal patches of 6x8 patches = 144 tokens, 36 rows.
    clip = np.stack([pixels(84, 112, seed=i) for i in range(5)])
    intake = read_submit(body("video", clip), encoder)
    (info,) = intake.items
    assert (info.modality, info.grid_thw, info.rows) == ("video", (3, 6, 8), 36)
    (item,) = intake.encoder_items
    assert (item.modality, item.num_tokens) == ("video", 144)
    assert intake.input_bytes == 144 * encoder.geometry.row_width


def test_the_minimum_pixels_bound_images_not_video_frames(encoder: VisionEncoder) -> None:
    with pytest.raises(BadRequest, match=f"56x56 = 3,136 pixels, under model.min_pixels={MIN_PIXELS:,}"):
        read_submit(body("image", pixels(56, 56)), encoder)
    intake = read_submit(body("video", np.stack([pixels(56, 56), pixels(56, 56, seed=1)])), encoder)
    assert intake.items[0].grid_thw == (1, 4, 4)


@pytest.fixture(scope="module")
def qwen3_encoder() -> Iterator[VisionEncoder]:
    # 2 frames of 64x64 = 8,192 clip pixels; 3 frames count as 4 (rounded half to even), 5 as 4.
    loaded = VisionEncoder(engine_settings(model={"preset": "tiny-3", "video_max_pixels": 4 * 64 * 64}).model)
    yield loaded
    loaded.close()


def clip(frames: int, side: int) -> npt.NDArray[np.uint8]:
    return np.stack([pixels(side, side, seed=i) for i in range(frames)])


def test_a_qwen3_vl_clip_is_bounded_by_its_frames_times_pixels(qwen3_encoder: VisionEncoder) -> None:
    assert qwen3_encoder.geometry.video_bounds == "clip"
    for frames in (2, 3, 4, 5):
        assert read_submit(body("video", clip(frames, 64)), qwen3_encoder).items[0].grid_thw[0] == -(-frames // 2)
    with pytest.raises(BadRequest, match=r"6 frames x 64x64 = 24,576 pixels, over model.video_max_pixels=16,384"):
        read_submit(body("video", clip(6, 64)), qwen3_encoder)
    # One frame of 128x128 is over no image bound (16,384 < 16,777,216), but 2 of them are over the clip's.
    with pytest.raises(BadRequest, match=r"over model\.video_max_pixels"):
        read_submit(body("video", clip(2, 128)), qwen3_encoder)
    # Under the image minimum (65,536 pixels) a frame is accepted: the clip's bounds are its own.
    assert read_submit(body("video", clip(2, 32)), qwen3_encoder).items[0].grid_thw == (1, 2, 2)


def test_a_qwen3_vl_clip_of_one_frame_is_refused(qwen3_encoder: VisionEncoder) -> None:
    with pytest.raises(BadRequest, match=r"a clip of 1 frame\(s\) is shorter than one temporal patch of 2 frames"):
        read_submit(body("video", clip(1, 64)), qwen3_encoder)


def test_a_qwen2_vl_clip_is_bounded_per_frame() -> None:
    encoder = VisionEncoder(engine_settings(model={"video_max_pixels": 56 * 84}).model)
    try:
        assert (encoder.geometry.video_bounds, encoder.geometry.video_pixels[1]) == ("frame", 56 * 84)
        # Any number of frames of 56x84; one of 84x84 is over, though under the image bound.
        assert read_submit(body("video", clip(9, 56)), encoder).items[0].grid_thw == (5, 4, 4)
        assert read_submit(body("image", pixels(84, 84)), encoder).items[0].grid_thw == (1, 6, 6)
        with pytest.raises(BadRequest, match=r"84x84 = 7,056 pixels a frame, over model\.video_max_pixels=4,704"):
            read_submit(body("video", clip(2, 84)), encoder)
    finally:
        encoder.close()


@pytest.mark.parametrize("resize", ["pil", "torchvision"])
def test_the_encoder_normalizes_intake_rows_as_the_processor_does(resize: str) -> None:
    from engine_adapter.processor import process_video

    encoder = VisionEncoder(engine_settings(model={"preset": "tiny-3", "resize": resize}).model)
    try:
        frames = clip(3, 64)
        intake = read_submit(body("video", frames), encoder)
        rows = intake.inputs.tensors["pixel_values"]
        expected = process_video(frames, encoder.geometry).pixel_values
        assert torch.equal(encoder.normalize_rows(rows), expected)
    finally:
        encoder.close()
