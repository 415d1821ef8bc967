"""Reading a submit: decode the request file, check every item against the engine's geometry, and process the
pixels into the encoder inputs of the whole request. Runs on a worker thread, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from encoder_scheduler import EncoderItem, EncoderRequest, RequestInputs
from engine_adapter.chat import check_item_parts
from engine_adapter.client.wire import SubmitRequest, WireFormatError, decode_submit
from engine_adapter.encoder import VisionEncoder
from engine_adapter.errors import BadRequest
from engine_adapter.processor import patchify
from processor_geometry import ProcessorGeometry

PIXEL_KEY = "pixel_values"
GRID_KEY = "grid_thw"
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """One item of an admitted request, as the hand-off backends need it."""

    modality: str
    locator: str
    grid_thw: tuple[int, int, int]
    rows: int
    """Embedding rows (t * h * w / merge**2)."""


@dataclass(frozen=True, slots=True)
class Intake:
    """A decoded, validated and processed submit."""

    request_id: str
    document: dict[str, Any]
    items: tuple[ItemInfo, ...]
    encoder_items: tuple[EncoderItem, ...]
    inputs: RequestInputs
    """Request-level `pixel_values` rows (uint8, not yet normalized) and `grid_thw`, items back to back."""
    input_bytes: int

    def encoder_request(self, job_id: str, width: int, dtype: torch.dtype) -> EncoderRequest:
        return EncoderRequest(job_id, width, dtype, self.encoder_items)


def read_submit(body: bytes, encoder: VisionEncoder) -> Intake:
    """Decode and validate a submit file and process its pixels; BadRequest naming the item and limit if not."""
    try:
        submit = decode_submit(body)
    except WireFormatError as exc:
        raise BadRequest(f"malformed submit file: {exc}", reason="malformed") from None
    _check_request(submit)
    geometry = encoder.geometry
    for index, item in enumerate(submit.items):
        _check_item(index, item.modality, item.locator, item.pixels, geometry)
    return _process(submit, encoder)


def _check_request(submit: SubmitRequest) -> None:
    request_id = submit.request_id
    if (
        not request_id
        or len(request_id) > MAX_REQUEST_ID_CHARS
        or not request_id.isascii()
        or not request_id.isprintable()
    ):
        raise BadRequest(
            f"mmgate.request_id must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters, got {request_id[:140]!r}",
            reason="malformed",
        )
    if not submit.items:
        raise BadRequest(f"request {request_id}: the submit file carries no media items", reason="malformed")
    try:
        check_item_parts(submit.document, len(submit.items))
    except ValueError as exc:
        raise BadRequest(f"request {request_id}: {exc}", reason="malformed") from None


def _check_item(
    index: int, modality: str, locator: str, pixels: npt.NDArray[np.uint8], geometry: ProcessorGeometry
) -> None:
    where = f"item {index} ({locator})"
    expected_ndim = {"image": 3, "video": 4}.get(modality)
    if expected_ndim is None:
        raise BadRequest(f"{where}: modality {modality!r} is not one of image, video", reason="geometry")
    if pixels.ndim != expected_ndim:
        shape = "[height, width, 3]" if modality == "image" else "[frames, height, width, 3]"
        raise BadRequest(f"{where}: {modality} pixels must be {shape}, got {list(pixels.shape)}", reason="geometry")
    if modality == "video" and pixels.shape[0] < 1:
        raise BadRequest(f"{where}: a video needs at least one frame", reason="geometry")
    height, width = int(pixels.shape[-3]), int(pixels.shape[-2])
    factor = geometry.factor
    if height < factor or width < factor or height % factor or width % factor:
        raise BadRequest(
            f"{where}: {width}x{height} pixels are not at a {geometry.name} size: both sides must be positive "
            f"multiples of patch_size*merge_size={factor} (resize with the engine's geometry first)",
            reason="geometry",
        )
    area = height * width
    if modality == "video":
        _check_clip(where, int(pixels.shape[0]), height, width, geometry)
        return
    if area > geometry.max_pixels:
        raise BadRequest(
            f"{where}: {width}x{height} = {area:,} pixels, over model.max_pixels={geometry.max_pixels:,}",
            reason="geometry",
        )
    if area < geometry.min_pixels:
        raise BadRequest(
            f"{where}: {width}x{height} = {area:,} pixels, under model.min_pixels={geometry.min_pixels:,}",
            reason="geometry",
        )


def _check_clip(where: str, frames: int, height: int, width: int, geometry: ProcessorGeometry) -> None:
    """A clip's size against the video processor's upper bound (`processor_geometry.video_smart_resize`
    keeps what it returns within it); the lower bound is not checked, as an upper bound may have taken the size
    under it."""
    limit = geometry.video_pixels[1]
    area = height * width
    if geometry.video_bounds == "frame":
        if area > limit:
            raise BadRequest(
                f"{where}: {width}x{height} = {area:,} pixels a frame, over model.video_max_pixels={limit:,}",
                reason="geometry",
            )
        return
    temporal = geometry.temporal_patch_size
    if frames < temporal:
        raise BadRequest(
            f"{where}: a clip of {frames} frame(s) is shorter than one temporal patch of {temporal} frames, which "
            f"the {geometry.name} video processor refuses",
            reason="geometry",
        )
    # Within the bound either as the frames rounded half to even to whole temporal patches (no scaling) or as
    # the frames themselves (scaled down to it).
    counted = min(frames, round(frames / temporal) * temporal)
    if counted * area > limit:
        raise BadRequest(
            f"{where}: {counted} frames x {width}x{height} = {counted * area:,} pixels, over "
            f"model.video_max_pixels={limit:,}",
            reason="geometry",
        )


def _process(submit: SubmitRequest, encoder: VisionEncoder) -> Intake:
    geometry = encoder.geometry
    merge_unit = encoder.merge_unit
    infos: list[ItemInfo] = []
    encoder_items: list[EncoderItem] = []
    for item in submit.items:
        grid = _grid(item.pixels, item.modality, geometry)
        tokens = grid[0] * grid[1] * grid[2]
        rows = tokens // merge_unit
        infos.append(ItemInfo(item.modality, item.locator, grid, rows))
        encoder_items.append(EncoderItem(item.modality, tokens, rows, item.content_hash or None))
    # One request-level tensor, filled item by item (no concatenation, so no second copy), so that a run of
    # adjacent items packs as one slice. The rows stay uint8 until the encoder thread normalizes them on the
    # device: a queued request holds a quarter of the float32 bytes.
    tokens_per_item = [item.num_tokens for item in encoder_items]
    pixel_values = torch.empty((sum(tokens_per_item), geometry.row_width), dtype=torch.uint8)
    start = 0
    for item, tokens in zip(submit.items, tokens_per_item, strict=True):
        frames = torch.from_numpy(item.pixels if item.modality == "video" else item.pixels[None])
        pixel_values[start : start + tokens] = patchify(frames.permute(0, 3, 1, 2), geometry)[0]
        start += tokens
    grid_thw = torch.tensor([info.grid_thw for info in infos], dtype=torch.int64)
    inputs = RequestInputs.from_item_rows(
        {PIXEL_KEY: pixel_values, GRID_KEY: grid_thw},
        {PIXEL_KEY: tokens_per_item, GRID_KEY: [1] * len(encoder_items)},
    )
    return Intake(
        request_id=submit.request_id,
        document=submit.document,
        items=tuple(infos),
        encoder_items=tuple(encoder_items),
        inputs=inputs,
        input_bytes=pixel_values.numel() * pixel_values.element_size(),
    )


def _grid(pixels: npt.NDArray[np.uint8], modality: str, geometry: ProcessorGeometry) -> tuple[int, int, int]:
    """The processor's (t, h, w) patch grid for pixels already at a valid size."""
    patch = geometry.patch_size
    frames = 1 if modality == "image" else int(pixels.shape[0])
    grid_t = -(-frames // geometry.temporal_patch_size)
    return grid_t, int(pixels.shape[-3]) // patch, int(pixels.shape[-2]) // patch
