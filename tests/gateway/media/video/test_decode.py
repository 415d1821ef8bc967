"""gateway.media.video.decode and gateway.media.container on videos the tests encode with PyAV."""

from __future__ import annotations

import base64
import dataclasses
import io
import threading
from fractions import Fraction
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import pytest
import torch

import gateway.media.video.decode
from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.container import MemoryInput
from gateway.media.sources.inline import Base64Input
from gateway.media.threads import DecodeCancelled, DecodeControl
from gateway.media.video.decode import (
    VideoHeader,
    decode_sampled_frames,
    decoder_pixels,
    predicted_video_bytes,
    probe_video,
    processed_video_bytes,
    rgb_frame_bytes,
    sample_frame_indices,
    video_frame_size,
)
from gateway.media_defaults import DEFAULT_VIDEO_FORMATS
from processor_geometry import QWEN2_VL, QWEN3_VL, video_geometry
from tests.gateway.media_factory import size_liar_mkv

FORMATS = DEFAULT_VIDEO_FORMATS


def _pattern(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
    """A frame whose index is written in ten 32x32 black or white blocks (survives lossy coding)."""
    frame = np.zeros((height, width, 3), np.uint8)
    for bit in range(10):
        if index >> bit & 1:
            y, x = bit // 5 * 32, bit % 5 * 32
            frame[y : y + 32, x : x + 32] = 255
    return frame


def _read_index(frame: npt.NDArray[np.uint8]) -> int:
    return sum(1 << bit for bit in range(10) if frame[bit // 5 * 32 + 16, bit % 5 * 32 + 16, 1] > 128)


def make_video(
    codec: str = "libx264",
    fmt: str = "mp4",
    *,
    width: int = 192,
    height: int = 96,
    frames: int = 60,
    rate: int = 10,
    gop: int = 10,
) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for index in range(frames):
            picture = av.VideoFrame.from_ndarray(_pattern(index, width, height), format="rgb24")
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video(frames=100)


def probe(data: bytes, *, max_pixels: int | None = None, max_seconds: float | None = None) -> VideoHeader:
    return probe_video(
        data, formats=FORMATS, max_pixels=max_pixels, max_seconds=max_seconds, locator="messages[0].content[1]"
    )


@pytest.mark.parametrize(
    ("encoder", "fmt", "codec", "declared"),
    [
        ("libx264", "mp4", "h264", True),
        ("mpeg4", "avi", "mpeg4", True),
        ("libvpx-vp9", "webm", "vp9", False),
        ("mpeg4", "matroska", "mpeg4", False),
    ],
)
def test_probe_reads_the_header_and_decodes_only_sampled_frames(
    encoder: str, fmt: str, codec: str, declared: bool
) -> None:
    data = make_video(encoder, fmt, width=200, frames=40)
    header = probe(data)
    assert (header.codec, header.width, header.height, header.frames) == (codec, 200, 96, 40)
    assert header.average_rate == 10
    assert header.duration_s == pytest.approx(4.0, abs=0.11)
    assert header.frames_declared is declared
    # The probe decodes nothing: the pixel format is what an H.264 / HEVC SPS declares, unknown for other codecs.
    assert header.pixel_format == ("yuv420p" if codec == "h264" else None)
    assert not header.has_audio
    indices = sample_frame_indices(header, num_frames=8)
    charged: list[int] = []
    result = decode_sampled_frames(data, header, indices, charge=charged.append, keep=_read_index)
    assert result.kept == result.indices == indices
    assert sum(charged) == result.bytes_charged == predicted_video_bytes(header, indices)


def test_probe_decodes_nothing_and_reads_a_bounded_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe never asks for a frame: decoding is counted at PyAV's `decode` entry points."""
    long = make_video(frames=600, gop=50)
    decoded = 0
    original = av.container.InputContainer.decode

    def counting(self: av.container.InputContainer, *args: object, **kwargs: object) -> object:
        nonlocal decoded
        decoded += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(av.container.InputContainer, "decode", counting)
    header = probe(long)
    assert decoded == 0
    assert header.frames == 600


def test_unreadable_and_unaccepted_containers_are_400_naming_the_item(mp4: bytes) -> None:
    random = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    with pytest.raises(BadRequest, match=r"messages\[0\]\.content\[1\]: not a readable video") as bad:
        probe(random)
    assert bad.value.status_code == 400
    with pytest.raises(BadRequest, match="video container 'avi' is not accepted"):
        probe_video(
            make_video("mpeg4", "avi", frames=5), formats=("mp4",), max_pixels=None, max_seconds=None, locator="x"
        )
    with pytest.raises(BadRequest, match="video codec 'h264' is not accepted"):
        probe_video(mp4, formats=FORMATS, codecs=("vp9",), max_pixels=None, max_seconds=None, locator="x")
    with pytest.raises(BadRequest, match="not a readable video"):
        probe(mp4[: len(mp4) // 3] if mp4[4:8] != b"ftyp" else mp4[:40])


def test_too_many_pixels_or_seconds_are_413_naming_the_key(mp4: bytes) -> None:
    with pytest.raises(RequestTooLarge, match=r"192x96 = 18,432 pixels, over limits\.max_video_pixels=10,000") as big:
        probe(mp4, max_pixels=10_000)
    assert big.value.status_code == 413
    with pytest.raises(RequestTooLarge, match=r"lasts 10\.0 s, over limits.max_video_seconds=5"):
        probe(mp4, max_seconds=5)
    assert probe(mp4, max_pixels=18_432, max_seconds=10).frames == 100


def _header(frames: int, rate: int = 30) -> VideoHeader:
    return VideoHeader("mp4", "h264", 640, 480, "yuv420p", frames, frames / rate, Fraction(rate), False)


def test_vllm_sampling() -> None:
    """vLLM `vllm/multimodal/video.py` `OpenCVVideoBackend.load_bytes`: num_frames (32) or all frames when the
    video has fewer, at most floor(duration x fps) with fps, at least one, `np.linspace(0, total - 1, n,
    dtype=int)`."""
    assert sample_frame_indices(_header(300)) == [int(i) for i in np.linspace(0, 299, 32, dtype=int)]
    assert sample_frame_indices(_header(20)) == list(range(20))
    assert sample_frame_indices(_header(300), num_frames=-1) == list(range(300))
    assert sample_frame_indices(_header(300), num_frames=32, fps=1.0) == [0, 33, 66, 99, 132, 166, 199, 232, 265, 299]
    assert sample_frame_indices(_header(5), num_frames=32, fps=0.1) == [0]


def test_qwen_sampling() -> None:
    """qwen-vl-utils `qwen_vl_utils/vision_process.py` `smart_nframes` with the decord/torchcodec readers'
    `linspace(0, total - 1, n).round()`: duration x fps, within [ceil2(min_frames=4), floor2(min(max_frames=768,
    total))] and total, rounded down to FRAME_FACTOR (the temporal patch, 2)."""
    assert sample_frame_indices(_header(300), fps=2.0, frame_factor=2) == [
        int(i) for i in np.rint(np.linspace(0, 299, 20))
    ]
    # 1.5 s at 2 fps is 3 frames: raised to min_frames 4.
    assert len(sample_frame_indices(_header(45), fps=2.0, frame_factor=2)) == 4
    # max_frames caps, rounded down to the temporal patch; 9 -> 8.
    assert len(sample_frame_indices(_header(3000), fps=2.0, max_frames=9, frame_factor=2)) == 8
    # 10 minutes at 30 fps: 1200 frames wanted, 768 at most.
    assert len(sample_frame_indices(_header(18000), fps=2.0, frame_factor=2)) == 768
    with pytest.raises(BadRequest, match="whole temporal patches"):
        sample_frame_indices(_header(1), fps=2.0, frame_factor=2)


def test_predicted_bytes_formulas() -> None:
    header = _header(300)
    indices = sample_frame_indices(header)
    assert rgb_frame_bytes(640, 480) == 640 * 480 * 3
    assert rgb_frame_bytes(330, 10) == 336 * 3 * 10
    assert predicted_video_bytes(header, indices) == 32 * 640 * 480 * 3
    # Qwen2-VL: each frame smart-resized to 644x476 (the checkpoint's pixel bounds), 32 frames = 16 temporal
    # patches, 16 x 34 x 46 rows of 3 x 2 x 14 x 14 float32.
    assert video_geometry(32, 480, 640, QWEN2_VL).grid_thw == (16, 34, 46)
    assert predicted_video_bytes(header, indices, QWEN2_VL) == 32 * 640 * 480 * 3 + 16 * 34 * 46 * 1176 * 4
    # An odd count is padded to a whole temporal patch.
    assert processed_video_bytes(3, 480, 640, QWEN2_VL) == processed_video_bytes(4, 480, 640, QWEN2_VL)
    # Qwen3-VL bounds frames x pixels by 25,165,824: 32 frames of 640x480 fit (9,830,400), 768 do not.
    assert processed_video_bytes(32, 480, 640, QWEN3_VL) == 16 * 30 * 40 * 1536 * 4
    assert processed_video_bytes(768, 480, 640, QWEN3_VL) < 768 // 2 * 30 * 40 * 1536 * 4


# (frames, height, width): odd and even frame counts, sides under the factor, elongated frames, clips at both
# of Qwen3-VL's video bounds (4,096 and 25,165,824 frames x pixels), half-way roundings.
QWEN3_CLIPS = [
    (frames, height, width)
    for frames in (2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 64, 127, 768)
    for height, width in (
        (480, 640), (1080, 1920), (2160, 3840), (96, 192), (100, 130), (33, 33), (31, 500), (10, 10), (1, 40),
        (16, 3000), (720, 1280), (48, 48), (4000, 25), (335, 17), (2, 399), (5000, 5000),
    )
]  # fmt: skip


@pytest.mark.parametrize(("frames", "height", "width"), QWEN3_CLIPS)
def test_qwen3_vl_clip_size_is_transformers_video_smart_resize(frames: int, height: int, width: int) -> None:
    from tests.gateway.media.qwen3_vl_oracle import video_smart_resize

    try:
        expected: tuple[int, int] | type[ValueError] = video_smart_resize(frames, height, width)
    except ValueError:
        expected = ValueError
    if expected is ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            video_frame_size(frames, height, width, QWEN3_VL)
    else:
        assert video_frame_size(frames, height, width, QWEN3_VL) == expected


def test_qwen3_vl_refuses_a_clip_shorter_than_a_temporal_patch_as_transformers_does() -> None:
    from tests.gateway.media.qwen3_vl_oracle import video_smart_resize

    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        video_smart_resize(1, 480, 640)
    with pytest.raises(ValueError, match="a clip of 1 frame"):
        video_frame_size(1, 480, 640, QWEN3_VL)
    with pytest.raises(ValueError, match="a clip of 1 frame"):
        processed_video_bytes(1, 480, 640, QWEN3_VL)


@pytest.mark.parametrize(
    ("frames", "height", "width"),
    [(2, 480, 640), (5, 100, 130), (3, 10, 10), (9, 31, 500), (4, 96, 192), (7, 335, 17), (33, 48, 48)],
)
def test_qwen3_vl_processed_video_bytes_are_transformers_video_processor_output(
    frames: int, height: int, width: int
) -> None:
    from tests.gateway.media.qwen3_vl_oracle import process_video

    clip = np.random.default_rng(frames).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    out = process_video(clip)
    t, h, w = out["video_grid_thw"].tolist()[0]
    resized = video_frame_size(frames, height, width, QWEN3_VL)
    assert (t, h * QWEN3_VL.patch_size, w * QWEN3_VL.patch_size) == (-(-frames // 2), *resized)
    assert out["pixel_values_videos"].dtype == torch.float32
    assert out["pixel_values_videos"].shape[1] == QWEN3_VL.row_width == 3 * 2 * 16 * 16
    assert processed_video_bytes(frames, height, width, QWEN3_VL) == out["pixel_values_videos"].nbytes


@pytest.mark.parametrize(
    ("total", "rate", "fps"),
    [
        (400, 10, 2.0),
        (60, 30, 2.0),
        (7, 30, 2.0),
        (3, 30, 2.0),
        (1, 30, 2.0),
        (9000, 30, 2.0),
        (301, 25, 1.5),
        (100, 24, 0.5),
        (75, 29.97, 2.0),
        (33, 10, 3.0),
        (2000, 60, 4.0),
    ],
)
def test_qwen3_vl_fps_sampling_is_transformers_sample_frames(total: int, rate: float, fps: float) -> None:
    from tests.gateway.media.qwen3_vl_oracle import sample_frames

    header = VideoHeader("mp4", "h264", 640, 480, "yuv420p", total, total / rate, Fraction(rate), False)
    ours = sample_frame_indices(header, num_frames=None, fps=fps, frame_factor=2, whole_patches=False)
    assert ours == sample_frames(total, float(Fraction(rate)), fps)


def test_the_frame_size_of_a_clip_is_the_models_video_resize() -> None:
    # Qwen2-VL resizes each frame with smart_resize and the checkpoint's bounds, whatever the frame count.
    assert video_frame_size(8, 96, 192, QWEN2_VL) == (84, 196)
    assert video_frame_size(1, 480, 640, QWEN2_VL) == video_frame_size(64, 480, 640, QWEN2_VL) == (476, 644)
    # Qwen3-VL bounds frames x height x width: more frames, smaller frames.
    assert video_frame_size(32, 480, 640, QWEN3_VL) == (480, 640)
    assert video_frame_size(768, 480, 640, QWEN3_VL)[0] < 480


@pytest.mark.parametrize(("fraction", "decoded"), [(0.5, [0, 14, 28, 42]), (0.9, [0, 14, 28, 42, 56, 70, 84])])
def test_a_file_cut_short_ends_the_decode_at_the_cut(fraction: float, decoded: list[int]) -> None:
    """An AVI cut at `fraction` of its bytes still declares 100 frames; the decode stops where the data ends (at
    the end of the input, or in a packet cut in two) and says how many sampled frames it reached."""
    data = make_video("mpeg4", "avi", frames=100, gop=1)
    cut = data[: int(len(data) * fraction)]
    header = probe(cut)
    indices = sample_frame_indices(header, num_frames=8)
    result = decode_sampled_frames(cut, header, indices, charge=lambda n: None, keep=_read_index)
    assert header.frames == 100
    assert result.indices == result.kept == decoded
    assert result.covered == len(decoded)


def test_only_sampled_frames_are_converted_and_seeking_skips_work() -> None:
    data = make_video(frames=300, gop=10)
    header = probe(data)
    converted = 0
    original = av.VideoFrame.reformat

    def counting(self: av.VideoFrame, *args: Any, **kwargs: Any) -> av.VideoFrame:
        nonlocal converted
        converted += 1
        return original(self, *args, **kwargs)

    indices = sample_frame_indices(header, num_frames=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(av.VideoFrame, "reformat", counting)
        result = decode_sampled_frames(data, header, indices, charge=lambda n: None, keep=_read_index)
    assert result.kept == indices == [0, 99, 199, 299]
    assert converted == 4
    # Seeking to the keyframe before each sampled frame decodes at most a GOP per frame, not all 300.
    assert result.frames_decoded <= 4 * 10


def test_charge_raising_stops_the_decode(mp4: bytes) -> None:
    header = probe(mp4)
    indices = sample_frame_indices(header, num_frames=10)
    seen: list[int] = []
    charged: list[int] = []

    def charge(nbytes: int) -> None:
        if len(charged) == 3:
            raise RequestTooLarge("over the cap")
        charged.append(nbytes)

    with pytest.raises(RequestTooLarge, match="over the cap"):
        decode_sampled_frames(mp4, header, indices, charge=charge, keep=lambda f: seen.append(_read_index(f)))
    assert seen == indices[:3]


def _patch_box_durations(data: bytes, seconds: int) -> bytes:
    """Rewrite the mvhd and every mdhd (version 0) duration to `seconds` of their own timescale."""
    patched = bytearray(data)
    for box in (b"mvhd", b"mdhd"):
        start = 0
        while (found := patched.find(box, start)) >= 0:
            assert patched[found + 4] == 0
            timescale = int.from_bytes(patched[found + 16 : found + 20], "big")
            patched[found + 20 : found + 24] = (timescale * seconds).to_bytes(4, "big")
            start = found + 4
    return bytes(patched)


def test_a_container_lying_about_its_duration_is_refused_from_its_frame_count() -> None:
    """mp4 of 10 s whose mvhd/mdhd claim 1 s: its sample table still holds 100 frames at 10 fps, and the
    longest duration the header implies is what limits.max_video_seconds is checked against."""
    data = _patch_box_durations(make_video(frames=100, gop=100), 1)
    with av.open(io.BytesIO(data), "r") as container:
        assert container.duration == pytest.approx(1_000_000, rel=0.01)
    with pytest.raises(RequestTooLarge, match=r"lasts 10\.0 s, over limits.max_video_seconds=5"):
        probe(data, max_seconds=5)


def test_more_frames_than_declared_are_refused_by_the_running_count() -> None:
    """A header whose frame count and rate place the sampled frames beyond what the stream's timestamps reach
    (declares 10 frames at 0.1 fps, holds 100 at 10 fps): the decoder's pass passes the declared count and is
    refused before all of it is decoded."""
    data = make_video(frames=100, gop=100)
    honest = probe(data)
    liar = dataclasses.replace(honest, frames=10, average_rate=Fraction(1, 10), duration_s=100.0)
    decoded: list[int] = []
    with pytest.raises(BadRequest, match="holds more than the 10 frames its header declares"):
        decode_sampled_frames(data, liar, [0, 9], charge=lambda n: None, keep=lambda f: decoded.append(1))
    assert decoded == [1]  # frame 0 only


def test_an_sps_larger_than_the_header_is_refused_before_the_decoder_sees_it() -> None:
    """An AVI carries H.264's SPS in its packets: one that declares more than the header is refused before the
    packet reaches the decoder, which never allocates a frame of that size."""
    data = make_video("libx264", "avi", width=640, height=360, frames=10)
    header = dataclasses.replace(probe(data), width=64, height=64, decoder_pixels=decoder_pixels(64, 64))
    frames: list[int] = []
    with pytest.raises(BadRequest, match="parameter sets declare 640x360 frames, larger than the 64x64"):
        decode_sampled_frames(data, header, [0], charge=lambda n: None, on_frame=lambda: frames.append(1))
    assert frames == []


def test_the_decoder_allocates_no_frame_larger_than_the_header_allows() -> None:
    """mp4 keeps the SPS in the codec's extradata, which the decoder reads when it opens: FFmpeg's `max_pixels`
    refuses the frame size there, before a frame is allocated."""
    data = make_video(width=640, height=360, frames=10)
    header = dataclasses.replace(probe(data), width=64, height=64, decoder_pixels=decoder_pixels(64, 64))
    frames: list[int] = []
    with pytest.raises(BadRequest, match="video cannot be decoded"):
        decode_sampled_frames(data, header, [0], charge=lambda n: None, on_frame=lambda: frames.append(1))
    assert frames == []


def test_the_frame_size_is_the_larger_of_the_containers_and_the_sps() -> None:
    """A matroska header that says 64x64 over an SPS of 1024x1024: the header read reports what the decoder
    will allocate, so limits and charges apply to it."""
    header = probe(size_liar_mkv(side=1024))
    assert (header.width, header.height) == (1024, 1024)
    assert header.decoder_pixels >= 1024 * 1024
    with pytest.raises(RequestTooLarge, match="video frames are 1024x1024 = 1,048,576 pixels"):
        probe(size_liar_mkv(side=1024), max_pixels=64 * 64)


def test_larger_frames_than_declared_are_refused(mp4: bytes) -> None:
    header = dataclasses.replace(probe(mp4), width=96, height=48)
    with pytest.raises(BadRequest, match="larger than the 96x48 its header declares"):
        decode_sampled_frames(mp4, header, [0], charge=lambda n: None)


def test_cancel_and_deadline_stop_a_decode(mp4: bytes) -> None:
    header = probe(mp4)
    indices = list(range(header.frames))
    control = DecodeControl(timeout_s=None)
    seen: list[int] = []

    def keep(frame: npt.NDArray[np.uint8]) -> None:
        seen.append(1)
        if len(seen) == 5:
            threading.Thread(target=control.cancel).start()

    with pytest.raises(DecodeCancelled):
        decode_sampled_frames(mp4, header, indices, charge=lambda n: None, control=control, keep=keep)
    assert 5 <= len(seen) < 10
    cancelled_before = DecodeControl(timeout_s=None)
    cancelled_before.cancel()
    with pytest.raises(DecodeCancelled):
        probe_video(mp4, formats=FORMATS, max_pixels=None, max_seconds=None, locator="x", control=cancelled_before)
    deadline = DecodeControl(timeout_s=0.05)
    deadline.check()
    slow = threading.Event()

    def stall(frame: npt.NDArray[np.uint8]) -> None:
        slow.wait(0.1)

    with pytest.raises(RequestTooLarge, match=r"media\.video\.decode_timeout_s=0\.05") as late:
        decode_sampled_frames(mp4, header, indices, charge=lambda n: None, control=deadline, keep=stall)
    assert late.value.reason == "decode_timeout"


def _record_decoded(patch: pytest.MonkeyPatch, rate: int) -> list[int]:
    """Records the index (pts x rate) of every frame the decoder yields to the sampling loop."""
    seen: list[int] = []
    original = gateway.media.video.decode._checked_frames

    def recording(*args: Any, **kwargs: Any) -> Any:
        for frame in original(*args, **kwargs):
            assert frame.pts is not None
            assert frame.time_base is not None
            seen.append(round(frame.pts * frame.time_base * rate))
            yield frame

    patch.setattr(gateway.media.video.decode, "_checked_frames", recording)
    return seen


@pytest.mark.parametrize(
    ("encoder", "fmt"), [("libx264", "mp4"), ("mpeg4", "avi"), ("mpeg4", "mp4"), ("libvpx-vp9", "webm")]
)
@pytest.mark.parametrize(("frames", "gop"), [(300, 30), (600, 60)])
def test_sampled_frames_closer_than_a_gop_decode_each_frame_at_most_once(
    encoder: str, fmt: str, frames: int, gop: int
) -> None:
    """32 frames sampled from 300 (or 600) with a keyframe every 30 (or 60): sampled frames are closer than a
    keyframe interval, so the decoder seeks only when the next sampled frame's keyframe lies past the frames
    already decoded, and decodes forward otherwise; no frame is decoded twice, at most every frame once."""
    data = make_video(encoder, fmt, frames=frames, gop=gop)
    header = probe(data)
    indices = sample_frame_indices(header, num_frames=32)
    with pytest.MonkeyPatch.context() as patch:
        seen = _record_decoded(patch, 10)
        result = decode_sampled_frames(data, header, indices, charge=lambda n: None, keep=_read_index)
    assert result.kept == result.indices == indices
    assert result.frames_decoded == len(seen) <= frames
    assert len(set(seen)) == len(seen), "a frame was decoded twice"
    assert seen == sorted(seen)


def test_sparse_samples_seek_past_whole_gops() -> None:
    """4 frames sampled from 600 with a keyframe every 30: each is reached by seeking to its own keyframe,
    so at most a GOP is decoded per sampled frame and no frame twice."""
    data = make_video(frames=600, gop=30)
    header = probe(data)
    indices = sample_frame_indices(header, num_frames=4)
    with pytest.MonkeyPatch.context() as patch:
        seen = _record_decoded(patch, 10)
        result = decode_sampled_frames(data, header, indices, charge=lambda n: None, keep=_read_index)
    assert result.kept == indices
    assert len(seen) <= 4 * 30
    assert len(set(seen)) == len(seen)


@pytest.mark.parametrize(("encoder", "fmt", "gop"), [("mpeg4", "mp4", 1), ("libx264", "mp4", 10), ("mpeg4", "avi", 5)])
def test_a_base64_input_decodes_the_frames_the_bytes_do_reading_only_what_it_needs(
    encoder: str, fmt: str, gop: int
) -> None:
    """The decode reads an inline item through its base64 as it reads the bytes: the same header, the same sampled
    frames, and the same reads of the same sizes (each decoding its own range only)."""
    data = make_video(encoder, fmt, frames=600, gop=gop)
    text = memoryview(base64.b64encode(data))
    header = probe(data)
    assert (
        probe_video(Base64Input(text, "v"), formats=FORMATS, max_pixels=None, max_seconds=None, locator="v") == header
    )
    indices = sample_frame_indices(header, num_frames=8)
    plain = MemoryInput(data)
    from_bytes = decode_sampled_frames(plain, header, indices, charge=lambda n: None, keep=_read_index)
    source = Base64Input(text, "v")
    from_text = decode_sampled_frames(source, header, indices, charge=lambda n: None, keep=_read_index)
    assert from_text.kept == from_bytes.kept == indices
    assert from_text.frames_decoded == from_bytes.frames_decoded
    assert (source.reads, source.bytes_read) == (plain.reads, plain.bytes_read)
