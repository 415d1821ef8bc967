"""Videos: the container header first, the frames the model server samples predicted and charged before any
decode, then only those frames decoded, one at a time. The PyAV functions are gateway/media/video/decode.py's.

Refused from the header, with no frame decoded: an unreadable container, a container or codec not accepted
(400), frames over `limits.max_video_pixels`, a duration over `limits.max_video_seconds`, predicted bytes past the
per-request cap (413). The prediction is one RGB frame per sampled frame (what the model server's loader fills)
plus, with `media.processor`, the processed video tensors. The decode's per-frame charge draws from it, so a
container that holds more than it declares is stopped by the running count; the decode stops at the cap, when
its request is cancelled, and past `media.video.decode_timeout_s` (which bounds the header read too). A file that
delivers fewer of the sampled frames than it declares (cut short) is a 400 when more than one is missing.

In engine mode (`Keep.resize`) the sampled frames are resized to one size for the whole clip, the engine
model's (`video_frame_size`), and kept as one uint8 `[t, h, w, 3]` array filled frame by frame as they decode;
each full-size RGB frame is dropped once resized. What is charged is that clip and the larger of one frame's resize
and the clip's copy in the engine submit body, not the processed tensors (the engine makes those, padding the
frames to whole temporal patches itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from PIL import Image

from gateway.errors import BadRequest
from gateway.media.accounting import PrepaidCharge, RequestAccount
from gateway.media.base import ContainerLoader, ContainerRules, LoadedItem
from gateway.media.container import MemoryInput
from gateway.media.parts import Modality
from gateway.media.plan import Keep
from gateway.media.resize import ResizedPixels
from gateway.media.threads import DecodeControl, Worker
from gateway.media.video.decode import (
    VideoHeader,
    decode_sampled_frames,
    predicted_video_bytes,
    probe_video,
    sample_frame_indices,
    video_frame_size,
)
from gateway.metrics import GatewayMetrics
from gateway.processors import Processed, Processors, largest

# Pillow holds an RGB image at 4 bytes a pixel.
PIL_RGB_BYTES = 4


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """`media.video`: vLLM's rule with `num_frames` (`fps` caps it), Qwen's with `fps` alone."""

    num_frames: int | None = 32
    fps: float | None = None
    max_frames: int | None = None


@dataclass(frozen=True, slots=True)
class VideoProbe:
    """What the header says and what decoding it will cost."""

    header: VideoHeader
    indices: list[int]
    frame_bytes: int
    """The sampled frames as RGB, one at a time as the decode charges them."""
    processed: Processed | None
    """With `media.processor` (not in engine mode): what the model server's video processor makes of the sampled
    frames and holds."""
    clip: tuple[int, int] | None = None
    """Engine mode: the (height, width) every sampled frame is resized to."""
    clip_bytes: int = 0
    """Engine mode: the kept uint8 clip plus the larger of what is held with it: one frame's resize while it fills
    (Pillow's full-size and resized images and the resized array) or its copy in the engine submit body."""

    @property
    def predicted_bytes(self) -> int:
        processed = self.processed.peak if self.processed is not None else 0
        return self.frame_bytes + processed + self.clip_bytes


class ClipFiller:
    """Engine mode: the decode's `keep` that resizes each sampled frame (full-size RGB, dropped by the caller
    once this returns) into its slot of one preallocated uint8 `[t, h, w, 3]` clip; frames fill it in decode
    order. Resized with Pillow's BICUBIC on the uint8 image, as `resize_for_model` resizes images."""

    def __init__(self, frames: int, height: int, width: int) -> None:
        self.clip: npt.NDArray[np.uint8] = np.empty((frames, height, width, 3), dtype=np.uint8)
        self.filled = 0

    def __call__(self, frame: npt.NDArray[np.uint8]) -> None:
        _, height, width, _ = self.clip.shape
        if frame.shape[:2] == (height, width):
            self.clip[self.filled] = frame
        else:
            image = Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC)
            self.clip[self.filled] = np.asarray(image)
            del image
        self.filled += 1

    def kept(self) -> ResizedPixels:
        """The frames decoded (a view of the clip's first `filled` frames) and their hash (shape and pixels, as
        an image's)."""
        return ResizedPixels.of(self.clip[: self.filled])


class VideoLoader(ContainerLoader[VideoProbe]):
    modality = Modality.VIDEO

    def __init__(
        self,
        worker: Worker,
        metrics: GatewayMetrics,
        rules: ContainerRules,
        *,
        max_pixels: int | None,
        sampling: VideoSampling,
        processors: Processors,
    ) -> None:
        super().__init__(worker, metrics, rules)
        self.max_pixels = max_pixels
        self.sampling = sampling
        self.processors = processors

    def predicted_bytes(self, probe: VideoProbe) -> int:
        return probe.predicted_bytes

    async def charge_and_decode(
        self,
        item: LoadedItem,
        probe: VideoProbe,
        open_input: Callable[[], MemoryInput],
        account: RequestAccount,
        control: DecodeControl,
        keep: Keep,
    ) -> None:
        locator = item.ref.locator
        item.header = probe.header
        item.sampled = probe.indices
        # Charged before the first frame is decoded: a video that would pass the cap is refused undecoded.
        account.charge(probe.frame_bytes, "decoded media")
        if keep.geometry is not None:
            account.charge(probe.clip_bytes, f"resized frames (the engine's {keep.geometry.name} geometry)")
        elif probe.processed is not None:
            account.charge_processed(probe.processed, f"processed tensors ({self.processors.label})")
        if not (self.rules.decode or keep.resize is not None):
            return
        filler = None
        if probe.clip is not None:
            filler = ClipFiller(len(set(probe.indices)), *probe.clip)
            # The clip is what `clip_bytes` was charged for; its storage is counted as seen.
            account.settle(probe.clip_bytes, filler.clip)
        charge = PrepaidCharge(account, probe.frame_bytes, "decoded media")
        decode = functools.partial(
            decode_sampled_frames,
            open_input(),
            probe.header,
            probe.indices,
            charge=charge,
            control=control,
            keep=filler,
            locator=locator,
            on_frame=self._frames_decoded.inc,
        )
        result = await self.timed_decode(locator, decode, control)
        sampled = len(set(probe.indices))
        decoded = len(result.indices)
        if sampled and not decoded:
            raise BadRequest(f"{locator}: the video holds no decodable frame", reason="bad_media")
        # One frame of slack: a last frame the demuxer reports but cannot deliver.
        if result.covered < sampled - 1:
            raise BadRequest(
                f"{locator}: {result.covered} of the {sampled} sampled frames decoded (the file ends early or is "
                "damaged); at most one may be missing",
                reason="bad_media",
            )
        item.decoded = decoded
        if filler is not None:
            item.resized = await self.worker.run(locator, filler.kept)

    def probe(self, source: MemoryInput, locator: str, control: DecodeControl | None, keep: Keep) -> VideoProbe:
        """The header, the sampled frames and what they cost."""
        resize = keep.geometry
        header = probe_video(
            source,
            formats=self.rules.formats,
            codecs=self.rules.codecs,
            max_pixels=self.max_pixels,
            max_seconds=self.rules.max_seconds,
            locator=locator,
            control=control,
        )
        sampling = self.sampling
        families = self.processors.candidates if resize is None else ()
        # Qwen's fps rule samples whole temporal patches of the processor; Qwen3-VL's and GLM's video processors do
        # not.
        if resize is not None:
            factor, whole = resize.temporal_patch_size, resize.video_bounds == "frame"
        else:
            factor = max((family.frame_factor for family in families), default=1)
            whole = not families or any(family.whole_patches for family in families)
        try:
            indices = sample_frame_indices(
                header,
                num_frames=sampling.num_frames,
                fps=sampling.fps,
                max_frames=sampling.max_frames,
                frame_factor=factor,
                whole_patches=whole,
            )
        except BadRequest as exc:
            raise BadRequest(f"{locator}: {exc}", reason=exc.reason) from None
        frame_bytes = predicted_video_bytes(header, indices)
        frames = len(set(indices))
        if resize is None:
            processed = largest(
                families,
                lambda family: family.video(frames, header.height, header.width),
                locator,
                self.processors.label,
            )
            return VideoProbe(header, indices, frame_bytes, processed)
        try:
            height, width = video_frame_size(frames, header.height, header.width, resize)
        except ValueError as exc:  # AspectRatioError among them
            raise BadRequest(
                f"{locator}: {exc} (the engine's {resize.name} geometry)", reason="bad_media_geometry"
            ) from None
        resized = height * width
        clip = frames * resized * 3
        # Held with the clip: while it fills, one frame's resize; once sent, its copy in the submit body.
        resize_peak = PIL_RGB_BYTES * (header.pixels + resized) + resized * 3
        clip_bytes = clip + max(resize_peak, clip)
        return VideoProbe(header, indices, frame_bytes, None, (height, width), clip_bytes)
