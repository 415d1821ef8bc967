"""A video's header, the frames the model server samples from it, what they cost, and decoding only those.
Runs on worker threads; every function works on the encoded bytes already in memory (or a file object over
them: an inline item's base64, gateway/media/sources/inline.py).

`probe_video` reads the container's and stream's metadata without decoding a frame and refuses what the limits
forbid. `sample_frame_indices` picks the frames the model server would sample, `predicted_video_bytes` prices
them from the header, and `decode_sampled_frames` decodes those frames one at a time, charging each before its
RGB array exists. The frame count the header declares bounds every pass of the decoder, so a container that holds
more frames than it declares is refused by the running count, not by memory.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, cast

import av
import av.container
import av.video.stream
import numpy as np
import numpy.typing as npt

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.container import (
    MemoryInput,
    container_media_type,
    deadline_error,
    declared_durations,
    first_stream,
    open_container,
)
from gateway.media.threads import DeadlinePassed, DecodeControl
from gateway.media.video.parameter_sets import CODECS as PARAMETER_SET_CODECS
from gateway.media.video.parameter_sets import FrameSize, extradata_sizes, nal_length_size, packet_sizes
from gateway.media_defaults import DEFAULT_VIDEO_CODECS, QWEN_MAX_FRAMES, VLLM_NUM_FRAMES
from processor_geometry.qwen import FLOAT32_BYTES, ProcessorGeometry, video_smart_resize

__all__ = [
    "DecodedVideo",
    "VideoHeader",
    "decode_sampled_frames",
    "predicted_video_bytes",
    "probe_video",
    "processed_video_bytes",
    "rgb_frame_bytes",
    "sample_frame_indices",
    "video_frame_size",
]

TIMEOUT_SETTING = "media.video.decode_timeout_s"

# qwen-vl-utils' and transformers' Qwen video processors: at least this many frames with `fps` sampling, at
# most `QWEN_MAX_FRAMES`.
QWEN_MIN_FRAMES = 4

# Within one forward pass the decoder may emit this many frames past the declared count before the container
# counts as lying: a frame count estimated from duration x rate can be one short.
FRAME_COUNT_SLACK = 2


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What the container declares about its first video stream, read without decoding a frame."""

    format: str
    """FFmpeg demuxer name (`mov,mp4,m4a,3gp,3g2,mj2`, `matroska,webm`, `avi`)."""
    codec: str
    width: int
    height: int
    pixel_format: str | None
    frames: int
    """Frames the stream declares: its frame count when the container stores one, else duration x rate."""
    duration_s: float
    average_rate: Fraction
    """Frames per second (the stream's average rate, else its guessed rate)."""
    has_audio: bool
    start_s: float = 0.0
    frames_declared: bool = True
    """The container stores a frame count (mp4, avi); False when it is estimated from duration x rate."""
    decoder_pixels: int = 0
    """The most pixels a decoder may allocate a frame for (`decoder_pixels`); the decode refuses a larger frame
    before allocating it (0: unbounded)."""

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def media_type(self) -> str:
        return container_media_type("video", self.format)

    @property
    def rgb_frame_bytes(self) -> int:
        """Bytes of one decoded RGB frame as PyAV allocates it (rows padded, see `rgb_frame_bytes`)."""
        return rgb_frame_bytes(self.width, self.height)


def probe_video(
    data: bytes | bytearray | memoryview | MemoryInput,
    *,
    formats: Collection[str],
    codecs: Collection[str] = DEFAULT_VIDEO_CODECS,
    max_pixels: int | None,
    max_seconds: float | None,
    locator: str,
    control: DecodeControl | None = None,
) -> VideoHeader:
    """Read the header of the first video stream from container and stream metadata only (nothing is decoded;
    FFmpeg's stream probe reads at most `container.PROBE_BYTES`). The frame size is the larger of what the
    container declares and what an H.264 / HEVC SPS in the codec's extradata declares: the decoder allocates the
    SPS's.

    Refuses with 400 an unreadable container, a container or codec not accepted, a stream that declares neither
    a frame count nor a duration; with 413 a frame of any video stream over `max_pixels` pixels (an upstream's
    own stream probe decodes a frame of each) or a duration over `max_seconds`. `data` may be a file object
    already (an inline item's `Base64Input`)."""
    source = data if isinstance(data, MemoryInput) else MemoryInput(data, control)
    with first_stream(source, kind="video", formats=formats, codecs=codecs, locator=locator, control=control) as (
        container,
        stream,
        demuxer,
        codec,
    ):
        header = _header(container, stream, demuxer, codec, locator)
        if max_pixels is not None:
            for other in container.streams.video[1:]:
                width, height, _ = frame_size(other)
                if width * height > max_pixels:
                    raise RequestTooLarge(
                        f"{locator}: video stream {other.index} declares {width}x{height} = {width * height:,} "
                        f"pixels a frame, over limits.max_video_pixels={max_pixels:,}",
                        reason="video_too_large",
                    )
    if max_pixels is not None and header.pixels > max_pixels:
        raise RequestTooLarge(
            f"{locator}: video frames are {header.width}x{header.height} = {header.pixels:,} pixels, "
            f"over limits.max_video_pixels={max_pixels:,}",
            reason="video_too_large",
        )
    if max_seconds is not None and header.duration_s > max_seconds:
        raise RequestTooLarge(
            f"{locator}: video lasts {header.duration_s:.1f} s, over limits.max_video_seconds={max_seconds:g}",
            reason="video_too_long",
        )
    return header


def _header(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    demuxer: str,
    codec: str,
    locator: str,
) -> VideoHeader:
    width, height, sps = frame_size(stream)
    if width <= 0 or height <= 0:
        raise BadRequest(f"{locator}: the video stream declares no frame size", reason="bad_media")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise BadRequest(f"{locator}: the video stream declares no frame rate", reason="bad_media")
    durations = declared_durations(container, stream)
    declared = stream.frames if stream.frames > 0 else 0
    if declared:
        durations.append(float(declared / rate))
    if not durations:
        raise BadRequest(f"{locator}: the video declares neither a frame count nor a duration", reason="bad_media")
    # The longest of what the container says is what the duration limit is checked against.
    duration = max(durations)
    frames = declared or max(1, round(duration * rate))
    start = 0.0
    if stream.start_time is not None and stream.time_base is not None:
        start = float(stream.start_time * stream.time_base)
    return VideoHeader(
        format=demuxer,
        codec=codec,
        width=width,
        height=height,
        pixel_format=sps.pixel_format if sps is not None else None,
        frames=frames,
        duration_s=duration,
        average_rate=Fraction(rate),
        has_audio=bool(container.streams.audio),
        start_s=start,
        frames_declared=bool(declared),
        decoder_pixels=decoder_pixels(
            max(width, sps.coded_width if sps else 0), max(height, sps.coded_height if sps else 0)
        ),
    )


def frame_size(stream: av.video.stream.VideoStream) -> tuple[int, int, FrameSize | None]:
    """(width, height) of a stream's frames: the larger of the container's and its extradata SPS's (H.264,
    HEVC), and that SPS."""
    context = stream.codec_context
    width, height = context.width, context.height
    sizes = extradata_sizes(context.codec.canonical_name, context.extradata)
    sps = max(sizes, key=lambda size: size.coded_pixels, default=None)
    if sps is not None and sps.width * sps.height > width * height:
        width, height = sps.width, sps.height
    return width, height, sps


def decoder_pixels(width: int, height: int) -> int:
    """What FFmpeg's `max_pixels` must allow a decoder of `width` x `height` frames: the size rounded up to whole
    64-pixel blocks, plus 128 columns and 256 rows. Decoders check the buffers they allocate against it, frames
    padded at the edges among them, and MPEG-4 part 2 a scratch buffer of about 280 rows a frame's stride wide
    (measured: the smallest `max_pixels` each codec decodes a frame with, at sizes from 16x16 to 4000x32)."""
    return (-(-width // 64) * 64 + 128) * (-(-height // 64) * 64 + 256)


# --- sampling ------------------------------------------------------------------------------------------------


def sample_frame_indices(
    header: VideoHeader,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    min_frames: int = QWEN_MIN_FRAMES,
    frame_factor: int = 1,
    whole_patches: bool = True,
) -> list[int]:
    """Indices (in presentation order, 0-based) of the frames the model server samples from `header.frames`.

    With `num_frames` (-1: every frame), or with neither setting, vLLM's video loader rule: as many frames as
    `num_frames` (default 32) and, if `fps` is also given, at most duration x fps, at least one, spread evenly
    from the first to the last frame (NumPy linspace truncated to integers); all frames when that is every
    frame. `max_frames` caps the count (a gateway setting; vLLM has none).

    With `fps` alone, the Qwen rule (qwen-vl-utils `smart_nframes`): duration x fps frames, at least
    `min_frames` and at most `max_frames` (768) and the frame count, each bound and the result rounded down to
    `frame_factor` (the processor's temporal patch; 2 for the Qwen processors), spread evenly from the first
    to the last frame and rounded to the nearest frame. Fewer than `frame_factor` frames is a 400.

    With `fps` alone and `whole_patches` False, Qwen3-VL's rule (transformers' `Qwen3VLVideoProcessor.sample_frames`):
    duration x fps frames truncated to an integer, at least `min_frames` and at most `max_frames` (768) and the
    frame count, not rounded to temporal patches, spread and rounded as above.
    """
    total = header.frames
    if num_frames is not None or fps is None:
        return _vllm_indices(header, VLLM_NUM_FRAMES if num_frames is None else num_frames, fps, max_frames)
    if not whole_patches:
        wanted_frames = int(total / float(header.average_rate) * fps)
        limit = QWEN_MAX_FRAMES if max_frames is None else max_frames
        count = min(max(wanted_frames, min_frames), limit, total)
        if count <= 0:
            raise BadRequest(f"video of {total} frames cannot be sampled at {fps} fps", reason="bad_media")
        return [int(i) for i in np.rint(np.linspace(0, total - 1, count))]
    factor = max(1, frame_factor)
    low = math.ceil(min_frames / factor) * factor
    high = math.floor(min(QWEN_MAX_FRAMES if max_frames is None else max_frames, total) / factor) * factor
    wanted = total / float(header.average_rate) * fps
    count = math.floor(min(max(wanted, low), high, total) / factor) * factor
    if not factor <= count <= total or count <= 0:
        raise BadRequest(
            f"video of {total} frames cannot be sampled in whole temporal patches of {factor} frames",
            reason="bad_media",
        )
    return [int(i) for i in np.rint(np.linspace(0, total - 1, count))]


def _vllm_indices(header: VideoHeader, num_frames: int, fps: float | None, max_frames: int | None) -> list[int]:
    total = header.frames
    count = total
    if num_frames > 0:
        count = min(num_frames, total)
    if fps is not None and fps > 0:
        count = min(count, math.floor(total / float(header.average_rate) * fps))
    if max_frames is not None and max_frames > 0:
        count = min(count, max_frames)
    count = max(1, count)
    if count == total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, count, dtype=int)]


# --- predicted bytes -----------------------------------------------------------------------------------------

_rgb_align: int | None = None


def rgb_frame_bytes(width: int, height: int) -> int:
    """Bytes PyAV allocates for one RGB24 frame: FFmpeg pads each row to its buffer alignment (the smallest
    power-of-two pixel alignment whose row length is a multiple of the CPU's alignment), so a 330-pixel row
    holds 336 pixels. The alignment is measured once from a 1x1 frame."""
    global _rgb_align
    if _rgb_align is None:
        _rgb_align = av.VideoFrame(1, 1, "yuv420p").reformat(format="rgb24").planes[0].line_size // 3 * 3
    align = _rgb_align
    step = 1
    while step <= align:
        padded = -(-width // step) * step * 3
        if padded % align == 0:
            return padded * height
        step *= 2
    return -(-width * 3 // align) * align * height


def video_frame_size(
    frames: int, height: int, width: int, geometry: ProcessorGeometry, pixels: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The (height, width) the model's video processor resizes every frame of a clip of `frames` frames to:
    `processor_geometry.video_smart_resize` with `geometry`'s video pixel bounds (`ProcessorGeometry.video_pixels`:
    each frame's for Qwen2-VL and Qwen2.5-VL, the clip's frames x height x width for Qwen3-VL, which also refuses a
    clip shorter than one temporal patch). In engine mode `geometry` is the engine's, its video bounds those its
    status reports. `pixels` overrides (min, max). Raises ValueError (AspectRatioError among them)."""
    if pixels is not None:
        geometry = geometry.with_video_pixels(*pixels)
    return video_smart_resize(frames, height, width, geometry)


def processed_video_bytes(
    frames: int, height: int, width: int, geometry: ProcessorGeometry, pixels: tuple[int, int] | None = None
) -> int:
    """Bytes of the float32 `pixel_values_videos` the model's video processor materializes for `frames`
    frames resized to `video_frame_size`: frames padded up to whole temporal patches, rows x (channels x
    temporal_patch x patch^2) x 4."""
    h, w = video_frame_size(frames, height, width, geometry, pixels)
    grid_t = -(-frames // geometry.temporal_patch_size)
    rows = grid_t * (h // geometry.patch_size) * (w // geometry.patch_size)
    return rows * geometry.row_width * FLOAT32_BYTES


def predicted_video_bytes(
    header: VideoHeader,
    indices: Collection[int],
    geometry: ProcessorGeometry | None = None,
    *,
    pixels: tuple[int, int] | None = None,
) -> int:
    """Bytes the sampled frames materialize, from the header alone: one RGB frame per sampled index (what
    `decode_sampled_frames` charges, and the uint8 frames array a model server's loader fills), plus, with a
    processor geometry, the processed video tensors (`processed_video_bytes`)."""
    total = len(indices) * header.rgb_frame_bytes
    if geometry is not None and indices:
        total += processed_video_bytes(len(indices), header.height, header.width, geometry, pixels)
    return total


# --- decoding the sampled frames -----------------------------------------------------------------------------


@dataclass(slots=True)
class DecodedVideo:
    """What `decode_sampled_frames` produced and counted."""

    indices: list[int] = field(default_factory=list)
    """Sampled indices that were decoded, in order (fewer than asked when the stream ends early)."""
    covered: int = 0
    """Sampled indices (distinct) the decode reached: each decoded, or passed over by a decoded frame whose
    timestamp lies past it. Fewer than sampled when the stream ends early."""
    kept: list[Any] = field(default_factory=list)
    """What `keep` returned for each decoded frame (empty without `keep`)."""
    frames_decoded: int = 0
    """Frames the decoder produced, sampled or skipped, across all passes."""
    bytes_charged: int = 0


def decode_sampled_frames(
    data: bytes | bytearray | memoryview | MemoryInput,
    header: VideoHeader,
    indices: Collection[int],
    *,
    charge: Callable[[int], None],
    control: DecodeControl | None = None,
    keep: Callable[[npt.NDArray[np.uint8]], Any] | None = None,
    locator: str = "video",
    on_frame: Callable[[], object] | None = None,
) -> DecodedVideo:
    """Decode the frames at `indices` (from `sample_frame_indices`) one at a time.

    A frame's index is its presentation time x the header's rate. A sampled frame whose keyframe (in the
    demuxer's index) lies past the frames already decoded is reached by seeking to that keyframe; otherwise the
    decoder goes forward, so no frame is decoded twice. Frames between are decoded and dropped unconverted.
    Before a sampled frame is converted to RGB its bytes are charged (`charge` raises at the cap, which stops
    the decode); the RGB array is handed to `keep` and dropped. `control` is checked at every read of input
    and every frame. A frame larger than the header declares, or a decoder pass that yields more frames than
    the header declares, is refused (400) before another frame is converted. `on_frame` is called for every
    frame the decoder produces (sampled or skipped), as it is produced. An input that ends early (or whose last
    packet is cut short) ends the decode there: `DecodedVideo.covered` says how many sampled frames it reached.
    `data` may be a file object already (an inline item's `Base64Input`), read from its start.
    """
    targets = sorted(set(indices))
    result = DecodedVideo()
    if not targets:
        return result
    if targets[0] < 0 or targets[-1] >= header.frames:
        raise ValueError(f"sampled indices must lie in [0, {header.frames}), got {targets[0]}..{targets[-1]}")
    source = data if isinstance(data, MemoryInput) else MemoryInput(data, control)
    container = open_container(source, kind="video", locator=locator, setting=TIMEOUT_SETTING, control=control)
    try:
        _decode(container, header, targets, result, charge, control, keep, locator, on_frame)
    except DeadlinePassed as passed:
        raise deadline_error(locator, "video", TIMEOUT_SETTING, passed.timeout_s) from None
    except av.FFmpegError as exc:
        raise BadRequest(f"{locator}: video cannot be decoded ({exc})", reason="bad_media") from None
    finally:
        container.close()
    return result


def _decode(
    container: av.container.InputContainer,
    header: VideoHeader,
    targets: list[int],
    result: DecodedVideo,
    charge: Callable[[int], None],
    control: DecodeControl | None,
    keep: Callable[[npt.NDArray[np.uint8]], Any] | None,
    locator: str,
    on_frame: Callable[[], object] | None,
) -> None:
    stream = container.streams.video[0]
    if header.decoder_pixels:
        # The decoder refuses a frame larger than this before allocating it (FFmpeg's `max_pixels`).
        stream.codec_context.options = {"max_pixels": str(header.decoder_pixels)}
    time_base = stream.time_base
    rate = header.average_rate
    start = stream.start_time or 0
    per_frame = header.rgb_frame_bytes
    keyframes = _KeyframeIndex(stream)
    position = -1  # index of the last frame the decoder produced

    def index_of(timestamp: int) -> int:
        assert time_base is not None
        return round((timestamp - start) * time_base * rate)

    def seek_to(target: int) -> int | None:
        """The timestamp to seek to for `target`: its keyframe's presentation time, when that keyframe lies past
        the frames already decoded (else decoding forward reaches the target, no frame decoded twice); else
        None."""
        if time_base is None:
            return None
        key = keyframes.at_or_before(start + int(Fraction(target) / rate / time_base))
        if key is None or index_of(key + keyframes.lead) <= position + 1:
            return None
        return key + keyframes.lead

    pending = 0  # next target
    while pending < len(targets):
        target = targets[pending]
        key = seek_to(target)
        if key is not None:
            # The decoder is flushed by the seek; it lands on the keyframe at `key`, past `position`.
            container.seek(key, stream=stream, backward=True)
        in_pass = 0
        reached = False
        try:
            for frame in _checked_frames(container, stream, header, locator):
                if control is not None:
                    control.check()
                result.frames_decoded += 1
                if on_frame is not None:
                    on_frame()
                in_pass += 1
                if in_pass > header.frames + FRAME_COUNT_SLACK:
                    raise BadRequest(
                        f"{locator}: the video holds more than the {header.frames} frames its header declares",
                        reason="bad_media",
                    )
                if frame.pts is not None and time_base is not None:
                    position = index_of(frame.pts)
                    if frame.key_frame:
                        keyframes.learn(frame.pts)
                else:
                    position += 1
                target = targets[pending]
                if position < target:
                    continue
                if frame.width * frame.height > header.pixels:
                    raise BadRequest(
                        f"{locator}: a frame is {frame.width}x{frame.height}, larger than the "
                        f"{header.width}x{header.height} its header declares",
                        reason="bad_media",
                    )
                charge(per_frame)
                result.bytes_charged += per_frame
                rgb = frame.reformat(format="rgb24")
                actual = rgb.planes[0].buffer_size
                if actual > per_frame:
                    charge(actual - per_frame)
                    result.bytes_charged += actual - per_frame
                array = cast("npt.NDArray[np.uint8]", rgb.to_ndarray())
                if keep is not None:
                    result.kept.append(keep(array))
                del array, rgb
                result.indices.append(target)
                # Frames between two sampled indices that the decoder skipped past count for each.
                pending += 1
                while pending < len(targets) and targets[pending] <= position:
                    pending += 1
                result.covered = pending
                reached = True
                if pending >= len(targets) or seek_to(targets[pending]) is not None:
                    break
        except (av.EOFError, av.InvalidDataError):
            # The input ends (the decoder was drained) or its last packet is cut short: no frame follows. The
            # caller compares the frames reached with those sampled.
            break
        if not reached:
            break  # the stream ended before the target


def _checked_frames(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, header: VideoHeader, locator: str
) -> Iterator[av.VideoFrame]:
    """`container.decode(stream)`, with the SPS of every H.264 / HEVC packet read before the decoder sees it: a
    frame size past the header's is refused (400) before any decoder allocates for it."""
    codec = header.codec
    scanned = codec in PARAMETER_SET_CODECS and header.decoder_pixels > 0
    length_size = nal_length_size(codec, stream.codec_context.extradata) if scanned else None
    for packet in container.demux(stream):
        if scanned and packet.size:
            for size in packet_sizes(codec, bytes(packet), length_size):
                if size.coded_pixels > header.decoder_pixels:
                    raise BadRequest(
                        f"{locator}: the stream's parameter sets declare {size.width}x{size.height} frames, larger "
                        f"than the {header.width}x{header.height} its header declares",
                        reason="bad_media",
                    )
        yield from packet.decode()


class _KeyframeIndex:
    """The keyframe timestamps of the demuxer's index for one stream (what a seek can land on), read again when
    the demuxer adds entries while reading. mp4's index holds decode times while its seek takes presentation
    times: `lead` is the smallest presentation time of a keyframe decoded so far minus its entry's, added to
    an entry to place its frame and to seek to it."""

    def __init__(self, stream: av.video.stream.VideoStream) -> None:
        self._stream = stream
        self._entries = -1
        self._timestamps: list[int] = []
        self.lead = 0
        self._learned = False

    def at_or_before(self, timestamp: int) -> int | None:
        """The latest keyframe timestamp whose frame is presented at or before `timestamp`; None when none is
        indexed."""
        return self._search(timestamp - self.lead)

    def learn(self, pts: int) -> None:
        """A keyframe presented at `pts` was decoded: its entry is the latest at or before `pts`."""
        entry = self._search(pts)
        if entry is not None:
            # The smallest: a sparse index (matroska cues) places some keyframes after their entry.
            self.lead = pts - entry if not self._learned else min(self.lead, pts - entry)
            self._learned = True

    def _search(self, timestamp: int) -> int | None:
        entries = self._stream.index_entries
        if len(entries) != self._entries:
            self._entries = len(entries)
            self._timestamps = sorted(entry.timestamp for entry in entries if entry.is_keyframe)
        found = bisect.bisect_right(self._timestamps, timestamp)
        return self._timestamps[found - 1] if found else None
