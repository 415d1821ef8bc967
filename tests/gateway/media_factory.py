"""Building test images and request bodies that carry them."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import av
import numpy as np
import orjson
from PIL import Image


def image_bytes(width: int, height: int, fmt: str = "JPEG", mode: str = "RGB", seed: int = 0, **save: Any) -> bytes:
    """Random pixels, so that JPEGs are as large as real photographs get."""
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, size=(height, width, bands), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if bands == 1 else pixels, mode=mode if bands > 1 else "L")
    if mode not in ("RGB", "RGBA", "L"):
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_body(*urls: str, text: str = "Describe the images.", **extra: Any) -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


def messages_body(*images: bytes, media_type: str = "image/jpeg") -> bytes:
    content: list[dict[str, Any]] = [
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": base64.b64encode(i).decode()}}
        for i in images
    ]
    content.append({"type": "text", "text": "What is this?"})
    return orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


def responses_body(*urls: str) -> bytes:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": "Describe."}]
    content += [{"type": "input_image", "image_url": url} for url in urls]
    return orjson.dumps({"model": "m", "input": [{"role": "user", "content": content}]})


def jpeg_header_claiming(width: int, height: int) -> bytes:
    """A JPEG whose SOF marker claims `width` x `height`, followed by too little data to decode anything."""
    real = image_bytes(16, 16)
    sof = real.find(b"\xff\xc0")
    patched = bytearray(real)
    patched[sof + 5 : sof + 7] = height.to_bytes(2, "big")
    patched[sof + 7 : sof + 9] = width.to_bytes(2, "big")
    return bytes(patched)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR (with a correct CRC) claims `width` x `height` over the pixels of an 8x8 image."""
    data = bytearray(image_bytes(8, 8, "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _scan_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan of a JPEG: its SOS segment and the entropy-coded data up to the next marker."""
    spans: list[tuple[int, int]] = []
    position = 2
    while True:
        marker = data[position + 1]
        if marker == 0xD9:
            return spans
        end = position + 2 + int.from_bytes(data[position + 2 : position + 4], "big")
        if marker == 0xDA:
            start = position
            while not (data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
            spans.append((start, end))
        position = end


def scan_bomb(side: int, copies: int) -> bytes:
    """A valid progressive JPEG whose smallest luma scan (about 16 bytes: a band of all-zero coefficients) is
    repeated `copies` times. libjpeg decodes each repeat as a pass over every luma block."""
    y, x = np.mgrid[0:side, 0:side]
    smooth = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(smooth).save(out, "JPEG", progressive=True, quality=90)
    data = out.getvalue()
    luma = [(start, end) for start, end in _scan_spans(data) if data[start + 4 : start + 6] == b"\x01\x01"]
    start, end = min(luma, key=lambda span: span[1] - span[0])
    return data[:end] + data[start:end] * copies + data[end:]


# --- videos whose decoders would allocate far more than the file's size --------------------------------------

_FAST_X264 = {"preset": "ultrafast", "tune": "zerolatency", "threads": "1"}


def _h264(fmt: str, width: int, height: int, frames: int = 1) -> bytes:
    """Blank H.264 frames in a container (cheap to encode at any size)."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=10)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = _FAST_X264
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame(width, height, "yuv420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def size_liar_mkv(side: int = 12288, claimed: int = 64) -> bytes:
    """A matroska file whose track header says `claimed` x `claimed` while its H.264 frame (and SPS) is
    `side` x `side`: matroska's PixelWidth / PixelHeight elements (ids B0, BA) rewritten in place."""
    data = bytearray(_h264("matroska", side, side))
    for element in (b"\xb0", b"\xba"):
        declared = element + b"\x82" + side.to_bytes(2, "big")
        at = data.find(declared)
        assert at >= 0, f"no {declared.hex()} in the track header"
        data[at : at + 4] = element + b"\x82" + claimed.to_bytes(2, "big")
    return bytes(data)


def hidden_tracks_mkv(tracks: int = 8, side: int = 8192) -> bytes:
    """A matroska file with one valid 64x64 video track and `tracks` more, each one `side` x `side` keyframe."""
    small = av.open(io.BytesIO(_h264("matroska", 64, 64, frames=10)))
    large = av.open(io.BytesIO(_h264("matroska", side, side)))
    out = io.BytesIO()
    with small, large, av.open(out, "w", format="matroska") as container:
        first = container.add_stream_from_template(small.streams.video[0])
        hidden = [container.add_stream_from_template(large.streams.video[0]) for _ in range(tracks)]
        keyframe = [packet for packet in large.demux() if packet.size]
        for packet in small.demux():
            if packet.size:
                packet.stream = first
                container.mux(packet)
        for stream in hidden:
            for packet in keyframe:
                packet.stream = stream
                container.mux(packet)
    return out.getvalue()


def large_h264_mp4(side: int = 8192) -> bytes:
    """An honest H.264 mp4 of one `side` x `side` frame."""
    return _h264("mp4", side, side)


VIDEO_BOMBS = {"size_liar.mkv": size_liar_mkv, "hidden_tracks.mkv": hidden_tracks_mkv, "large.mp4": large_h264_mp4}


def write_video_bombs(directory: str) -> None:
    """Each of `VIDEO_BOMBS` into `directory` (run in a process of its own: the encodes hold about 700 MiB)."""
    for name, make in VIDEO_BOMBS.items():
        with open(f"{directory}/{name}", "wb") as out:
            out.write(make())
