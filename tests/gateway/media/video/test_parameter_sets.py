"""`parameter_sets`: the frame size H.264 and HEVC SPSs declare, checked against what FFmpeg's decoder makes of the
same streams (encoded here by libx264 and libx265 at odd sizes, cropped, 4:4:4, 10-bit, interlaced), from the
codec's extradata (mp4, matroska) and from packets (AVI carries the SPS in-band)."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np
import pytest

from gateway.media.video.parameter_sets import (
    FrameSize,
    MalformedParameterSet,
    extradata_sizes,
    h264_sps_size,
    nal_length_size,
    packet_sizes,
)


def encode(codec: str, fmt: str, width: int, height: int, pixel_format: str, **options: str) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, pixel_format
        stream.codec_context.options = {"log-level": "error", **options} if codec == "libx265" else options
        for index in range(3):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), index * 60, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


CASES: list[tuple[str, str, int, int, str, dict[str, Any]]] = [
    ("libx264", "mp4", 1920, 1080, "yuv420p", {}),
    ("libx264", "mp4", 100, 50, "yuv420p", {}),
    ("libx264", "matroska", 322, 242, "yuv420p", {}),
    ("libx264", "avi", 640, 360, "yuv420p", {}),
    ("libx264", "mp4", 64, 64, "yuv444p", {}),
    ("libx264", "mp4", 176, 144, "yuv420p10le", {}),
    ("libx264", "mp4", 352, 288, "yuv420p", {"x264-params": "interlaced=1"}),
    ("libx265", "mp4", 1920, 1080, "yuv420p", {}),
    ("libx265", "matroska", 100, 50, "yuv420p", {}),
    ("libx265", "mp4", 176, 144, "yuv420p10le", {}),
]


@pytest.mark.parametrize(("encoder", "fmt", "width", "height", "pixel_format", "options"), CASES)
def test_the_sps_size_is_what_the_decoder_makes(
    encoder: str, fmt: str, width: int, height: int, pixel_format: str, options: dict[str, str]
) -> None:
    data = encode(encoder, fmt, width, height, pixel_format, **options)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context.codec.canonical_name
        extradata = stream.codec_context.extradata
        length_size = nal_length_size(codec, extradata)
        in_band = [
            size
            for packet in container.demux(stream)
            if packet.size
            for size in packet_sizes(codec, bytes(packet), length_size)
        ]
    with av.open(io.BytesIO(data)) as container:
        frame = next(container.decode(video=0))
    declared = extradata_sizes(codec, extradata)
    assert declared, "no SPS found in the extradata"
    for size in [*declared, *in_band]:
        assert (size.width, size.height) == (frame.width, frame.height) == (width, height)
        assert size.coded_width >= size.width
        assert size.coded_height >= size.height
        assert size.coded_width % (16 if codec == "h264" else 8) == 0
        assert size.pixel_format == frame.format.name == pixel_format
    # AVI carries the parameter sets in its packets as well; mp4 and matroska in the extradata only.
    assert bool(in_band) is (fmt == "avi")


def test_a_truncated_or_malformed_sps_is_refused_not_guessed() -> None:
    data = encode("libx264", "mp4", 64, 64, "yuv420p")
    with av.open(io.BytesIO(data)) as container:
        extradata = container.streams.video[0].codec_context.extradata
    assert extradata is not None
    sps = extradata[8 : 8 + int.from_bytes(extradata[6:8], "big")]
    assert h264_sps_size(sps) == FrameSize(64, 64, 64, 64)
    with pytest.raises(MalformedParameterSet, match="ends early"):
        h264_sps_size(sps[:5])
    with pytest.raises(MalformedParameterSet, match="exp-Golomb code is too long"):
        h264_sps_size(sps[:4] + b"\x00" * 8)


def test_other_codecs_and_streams_without_parameter_sets_declare_nothing() -> None:
    assert extradata_sizes("vp9", b"\x01\x02") == []
    assert extradata_sizes("h264", None) == []
    assert packet_sizes("mpeg4", b"\x00\x00\x01\xb0", None) == []
