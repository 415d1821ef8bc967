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


# --- images whose metadata a loader would inflate or copy ----------------------------------------------------


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: its length, type, payload and CRC."""
    return len(payload).to_bytes(4, "big") + kind + payload + zlib.crc32(kind + payload).to_bytes(4, "big")


def png_with_chunks(chunks: list[bytes], *, before_idat: bool, side: int = 16) -> bytes:
    """A Pillow-made `side` x `side` RGB PNG with `chunks` inserted before its first IDAT or before its IEND."""
    data = image_bytes(side, side, "PNG")
    at = data.index(b"IDAT") - 4 if before_idat else len(data) - 12
    return data[:at] + b"".join(chunks) + data[at:]


def ztxt(key: str, text: bytes) -> bytes:
    """A zTXt chunk: `text` deflated."""
    return png_chunk(b"zTXt", key.encode("latin-1") + b"\0\0" + zlib.compress(text, 9))


def itxt(key: str, text: str, *, compressed: bool = True) -> bytes:
    """An iTXt chunk (no language, no translated keyword): `text` as UTF-8, deflated when `compressed`."""
    value = text.encode("utf-8")
    flag = b"\1\0" if compressed else b"\0\0"
    body = zlib.compress(value, 9) if compressed else value
    return png_chunk(b"iTXt", key.encode("latin-1") + b"\0" + flag + b"\0\0" + body)


# Pillow's PngImagePlugin.MAX_TEXT_CHUNK (ImageFile.SAFEBLOCK, 1 MiB): a text chunk inflating past it is refused.
PNG_TEXT_CHUNK_LIMIT = 1 << 20


def png_text_bomb(chunks: int, *, before_idat: bool, inflated: int = PNG_TEXT_CHUNK_LIMIT - 4096) -> bytes:
    """A small PNG with `chunks` zTXt chunks under distinct keys, each `inflated` bytes of text deflated to about a
    thousandth of that: Pillow keeps every one of them as a `str` in the image's `info` and `text`."""
    text = b"a" * inflated
    return png_with_chunks([ztxt(f"k{index}", text) for index in range(chunks)], before_idat=before_idat)


def jpeg_segment(marker: int, payload: bytes) -> bytes:
    """One JPEG marker segment: 0xFF, the marker, the length (the payload's and its own 2 bytes), the payload."""
    return bytes((0xFF, marker)) + (len(payload) + 2).to_bytes(2, "big") + payload


def jpeg_with_segments(segments: list[bytes], side: int = 16) -> bytes:
    """A Pillow-made `side` x `side` JPEG with `segments` right after its SOI marker."""
    data = image_bytes(side, side, "JPEG")
    return data[:2] + b"".join(segments) + data[2:]


def exif_segment_payload(entries: int) -> bytes:
    """An APP1 EXIF payload: a little-endian TIFF structure whose first IFD has `entries` SHORT tags."""
    tags = b"".join(struct.pack("<HHLL", 0x9000 + index, 3, 1, 1000 + index) for index in range(entries))
    return b"Exif\0\0II*\0" + (8).to_bytes(4, "little") + entries.to_bytes(2, "little") + tags + bytes(4)


def mpf_segment_payload(images: int) -> bytes:
    """An APP2 MPF payload (as cameras write for stereo or depth images) listing `images` images."""
    entries_at = 8 + 2 + 3 * 12 + 4  # after the TIFF header and an IFD of 3 tags
    ifd = (3).to_bytes(2, "little") + struct.pack("<HHL4s", 0xB000, 7, 4, b"0100")
    ifd += struct.pack("<HHLL", 0xB001, 4, 1, images) + struct.pack("<HHLL", 0xB002, 7, 16 * images, entries_at)
    entries = b"".join(struct.pack("<LLLHH", 0x030000 if i == 0 else 0x020002, 1000, 0, 0, 0) for i in range(images))
    return b"MPF\0II*\0" + (8).to_bytes(4, "little") + ifd + bytes(4) + entries


def photoshop_segment_payload(resources: int) -> bytes:
    """An APP13 Photoshop payload of `resources` empty image resources with distinct ids."""
    return b"Photoshop 3.0\0" + b"".join(
        b"8BIM" + (0x0400 + index).to_bytes(2, "big") + bytes(6) for index in range(resources)
    )


def gif_with_comment(sub_blocks: list[bytes], side: int = 16) -> bytes:
    """A Pillow-made GIF with a comment extension of `sub_blocks` right after its global palette."""
    data = image_bytes(side, side, "GIF")
    flags = data[10]
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    comment = b"\x21\xfe" + b"".join(bytes((len(block),)) + block for block in sub_blocks) + b"\0"
    return data[:at] + comment + data[at:]


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
