"""Reading a submit: the item checks against the engine's geometry and the encoder items a video becomes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

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
