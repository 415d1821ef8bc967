"""Videos: the container header first, the frames the model server samples predicted and charged before any
decode, then only those frames decoded, one at a time. The PyAV functions are gateway/video_decode.py's.

Refused from the header, with no frame decoded: an unreadable container, a container or codec not accepted
(400), frames over `limits.max_video_pixels`, a duration over `limits.max_video_seconds`, predicted bytes past the
per-request cap (413). The prediction is one RGB frame per sampled frame (what the model server's loader fills)
plus, with `media.processor`, the processed video tensors. The decode's per-frame charge draws from it, so a
container that holds more than it declares is stopped by the running count; the decode stops at the cap, when
its request is cancelled, and past `media.video.decode_timeout_s` (which bounds the header read too).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection
from dataclasses import dataclass

from engine_adapter.client import ProcessorGeometry
from gateway.accounting import RequestAccount
from gateway.errors import BadRequest
from gateway.image_loader import DecodeControl
from gateway.media_parts import MediaRef, Modality
from gateway.metrics import GatewayMetrics
from gateway.modality_loader import Keep, LoadedItem, PrepaidCharge, Worker
from gateway.video_decode import (
    VideoHeader,
    decode_sampled_frames,
    predicted_video_bytes,
    probe_video,
    processed_video_bytes,
    sample_frame_indices,
)


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """`media.video`: vLLM's rule with `num_frames` (`fps` caps it), Qwen's with `fps` alone."""

    num_frames: int | None = 32
    fps: float | None = None
    max_frames: int | None = None


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """What the header says and what decoding it will cost."""

    header: VideoHeader
    indices: list[int]
    frame_bytes: int
    """The sampled frames as RGB, one at a time as the decode charges them."""
    processed_bytes: int

    @property
    def predicted_bytes(self) -> int:
        return self.frame_bytes + self.processed_bytes


class VideoLoader:
    modality = Modality.VIDEO

    def __init__(
        self,
        *,
        worker: Worker,
        metrics: GatewayMetrics,
        formats: Collection[str],
        codecs: Collection[str],
        max_pixels: int | None,
        max_seconds: float | None,
        sampling: VideoSampling,
        decode: bool,
        decode_timeout_s: float | None,
        geometry: ProcessorGeometry | None,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.formats = tuple(formats)
        self.codecs = tuple(codecs)
        self.max_pixels = max_pixels
        self.max_seconds = max_seconds
        self.sampling = sampling
        self.decode = decode
        self.decode_timeout_s = decode_timeout_s
        self.geometry = geometry
        self._frames_decoded = metrics.media_frames_decoded.labels(self.modality.value)

    async def probe(self, ref: MediaRef, keep: Keep | None = None) -> int:
        data = await self.worker.inline_bytes(ref)
        control = DecodeControl(self.decode_timeout_s)
        call = functools.partial(self.plan, data, ref.locator, control)
        plan = await self.worker.run(ref.locator, call, control=control)
        return plan.predicted_bytes

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, keep: Keep | None) -> None:
        locator = item.ref.locator
        control = DecodeControl(self.decode_timeout_s)
        plan = await self.worker.run(locator, functools.partial(self.plan, data, locator, control), control=control)
        item.header = plan.header
        item.sampled = plan.indices
        item.predicted_bytes = plan.predicted_bytes
        self.metrics.media_predicted_bytes.labels(self.modality.value).observe(plan.predicted_bytes)
        # Charged before the first frame is decoded: a video that would pass the cap is refused undecoded.
        account.charge(plan.frame_bytes, "decoded media")
        if self.geometry is not None:
            account.charge(plan.processed_bytes, f"processed tensors (media.processor={self.geometry.name})")
        if not self.decode:
            return
        charge = PrepaidCharge(account, plan.frame_bytes, "decoded media")
        decode = functools.partial(
            decode_sampled_frames,
            data,
            plan.header,
            plan.indices,
            charge=charge,
            control=control,
            locator=locator,
            on_frame=self._frames_decoded.inc,
        )
        started = time.perf_counter()
        result = await self.worker.run(locator, decode, control=control)
        self.metrics.media_decode_seconds.labels(self.modality.value).observe(time.perf_counter() - started)
        if plan.indices and not result.indices:
            raise BadRequest(f"{locator}: the video holds no decodable frame", reason="bad_media")
        item.decoded = len(result.indices)

    def plan(self, data: bytes, locator: str, control: DecodeControl | None = None) -> VideoPlan:
        """On a media thread: the header (refusals included), the sampled frames and what they cost."""
        header = probe_video(
            data,
            formats=self.formats,
            codecs=self.codecs,
            max_pixels=self.max_pixels,
            max_seconds=self.max_seconds,
            locator=locator,
            control=control,
        )
        sampling = self.sampling
        # Qwen's fps rule samples whole temporal patches of the processor.
        factor = self.geometry.temporal_patch_size if self.geometry is not None else 1
        try:
            indices = sample_frame_indices(
                header,
                num_frames=sampling.num_frames,
                fps=sampling.fps,
                max_frames=sampling.max_frames,
                frame_factor=factor,
            )
        except BadRequest as exc:
            raise BadRequest(f"{locator}: {exc}", reason=exc.reason) from None
        processed = 0
        if self.geometry is not None:
            try:
                processed = processed_video_bytes(len(indices), header.height, header.width, self.geometry)
            except ValueError as exc:  # AspectRatioError among them
                raise BadRequest(
                    f"{locator}: {exc} (media.processor={self.geometry.name})", reason="bad_media_geometry"
                ) from None
        return VideoPlan(header, indices, predicted_video_bytes(header, indices), processed)
