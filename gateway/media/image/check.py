"""Checking an image's structure at a fraction of a decode's cost (`media.decode: check`). Runs on worker threads.

What each format's check reads, after `open_image` has read and checked the header:

- JPEG: the scan count from the markers (`media.max_jpeg_scans`), then libjpeg's decode at 1/8 scale (DCT scaling,
  grey output where the file is colour) of the file's skeleton (`jpeg_markers.skeleton`): every marker segment
  without the entropy-coded data, so libjpeg checks each table, frame and scan header as a decode does and ends
  each scan at once. Where that data can change libjpeg's verdict (the file ends before EOI, a resync marker in a
  scan with restarts on) the file itself is decoded at 1/8 scale: a truncated or corrupt file fails as it fails a
  full decode.
- PNG: every chunk from the signature to IEND, its length within the data and its CRC (zlib.crc32), the IHDR
  fields; nothing is inflated.
- GIF: the blocks up to the end of the first image (the one Pillow decodes): each block and sub-block within the
  data, the first image's LZW code size; nothing is decompressed.
- WebP: the RIFF chunks, each within the RIFF size and the RIFF size within the data, and the first image's
  bitstream header (VP8 frame tag, start code and first partition, or VP8L signature and version), whose size must
  be the container's; nothing is decoded.
- BMP: uncompressed pixel data must lie within the data (what Pillow's raw decoder reads: a row stride times the
  rows, from the pixel data offset).

A format or coding the walk does not know (a run-length BMP, TIFF) is decoded fully, as `media.decode: full` does.
What the check reads is bounded by `DecodeControl` as a decode is: libjpeg reads through the controlled input, the
walks check the control every `_CHUNKS_PER_CHECK` chunks.

`check_here` runs the JPEG check on the calling thread (the event loop's) where its work is bounded from the file:
its bytes (the marker search and the check, about 0.5 ms for a noise JPEG of 925 KiB and 8 ms for 1 MiB of 0xFF
bytes, the worst: 256 KiB of them hold the loop about 2 ms), its marker segments
(each costs Python work) and its scans times its pixels (the 1/8-scale decode of the skeleton, about 0.1 us a
pixel a scan). Anything else is left to `check_opened` on a media thread.
"""

from __future__ import annotations

import warnings
import zlib

from gateway.errors import BadRequest
from gateway.media.image import jpeg_markers
from gateway.media.image.decode import (
    JPEG_READ_BYTES,
    ImageHeader,
    OpenedImage,
    decode_errors,
    decode_opened,
    refuse_scan_bombs,
)
from gateway.media.threads import DecodeControl
from processor_geometry.rgb import pixel_size

__all__ = [
    "HERE_MAX_BYTES",
    "HERE_MAX_SCAN_PIXELS",
    "HERE_MAX_SEGMENTS",
    "JPEG_CHECK_SCALE",
    "check_bytes",
    "check_here",
    "check_opened",
]

# libjpeg's smallest DCT scale: each 8x8 block becomes one output pixel.
JPEG_CHECK_SCALE = 8
# Bytes a 1/8-scale decode allocates besides its output and the coefficients (`decoder_bytes`): libjpeg's tables,
# Huffman state and per-row buffers, measured at most about 150 KiB for 2000x2000 images, and the skeleton.
_JPEG_CHECK_WORKING_BYTES = (256 << 10) + jpeg_markers.SKELETON_MAX_BYTES
# Walks check the control once every this many chunks, blocks or sub-blocks.
_CHUNKS_PER_CHECK = 1024
# A JPEG `check_here` checks: at most this many bytes, marker segments (a baseline file from a camera or an encoder
# has about 15; a progressive one about 40), and scans times pixels (one scan of a 1080p frame). Measured at the
# limits: a 1 MiB file of random pixels checks in about 0.5 ms, the skeleton of a 1080p frame decodes in about
# 0.2 ms; 1 MiB of nothing but 0xFF bytes takes the marker search about 10 ms, as it would on a media thread,
# where the search holds the interpreter's lock all the same.
HERE_MAX_BYTES = 256 << 10
HERE_MAX_SEGMENTS = 64
HERE_MAX_SCAN_PIXELS = 1920 * 1088


def _checked_as(header: ImageHeader) -> str:
    """How `check_opened` checks an image: "jpeg" (the 1/8-scale decode of its skeleton), "walk" (its format's
    walk) or "decode" (a full decode)."""
    if header.format in ("jpeg", "mpo"):
        return "jpeg"
    if header.format in ("png", "gif", "webp"):
        return "walk"
    if header.format == "bmp" and header.decoder_bytes == 0:  # not run-length coded (see `_decoder_bytes`)
        return "walk"
    return "decode"


def check_bytes(header: ImageHeader) -> int:
    """Peak bytes the opened image and `check_opened` hold, at most `header.decode_bytes`: a JPEG's coefficients
    (kept whole for a file of several scans, at any scale) and its 1/8-scale output; a WebP, the decoder libwebp
    made when the file was opened (its canvases and its copy of the file: `decoder_bytes` counts them); the other
    walks, nothing that grows with the pixels; a full decode, what it allocates."""
    how = _checked_as(header)
    if how == "decode":
        return header.decode_bytes
    if how == "walk":
        return header.decoder_bytes if header.format == "webp" else 0
    scaled = -(-header.width // JPEG_CHECK_SCALE) * -(-header.height // JPEG_CHECK_SCALE)
    return min(
        header.decode_bytes,
        header.decoder_bytes + scaled * pixel_size(_jpeg_check_mode(header.mode)) + _JPEG_CHECK_WORKING_BYTES,
    )


def check_opened(
    opened: OpenedImage, *, locator: str, control: DecodeControl | None = None, max_jpeg_scans: int | None = None
) -> None:
    """Check the image's structure as the module's docstring says (a truncated or corrupt file is a 400 naming the
    item, a JPEG over `max_jpeg_scans` a 413); `opened` is closed. `control` stops the check as it stops a decode.
    """
    with opened:
        how = _checked_as(opened.header)
        if how == "decode":
            decode_opened(opened, locator=locator, control=control, max_jpeg_scans=max_jpeg_scans)
            return
        if how == "jpeg":
            _check_jpeg(opened, jpeg_markers.skeleton(opened.data), locator, control, max_jpeg_scans)
            return
        fmt = opened.header.format
        with decode_errors(locator, "checking"):
            if fmt == "png":
                _walk_png(opened.data, locator, control)
            elif fmt == "gif":
                _walk_gif(opened.data, locator, control)
            elif fmt == "webp":
                _walk_webp(opened.data, opened.header, locator)
            else:
                _check_bmp(opened, locator)


def check_here(opened: OpenedImage, *, locator: str, max_jpeg_scans: int | None = None) -> bool:
    """`check_opened` for a JPEG within the `HERE_MAX_*` bounds (see the module's docstring), with no control: the
    work is bounded, and there is no other thread to stop it. True once checked, `opened` closed; False for any
    other image, with nothing read but markers and `opened` open for `check_opened`."""
    header = opened.header
    pixels = header.width * header.height
    # Pixels alone past the bound (a scan at least): declined before the walk, which check_opened would repeat.
    if _checked_as(header) != "jpeg" or len(opened.data) > HERE_MAX_BYTES or pixels > HERE_MAX_SCAN_PIXELS:
        return False
    try:
        skeleton = jpeg_markers.skeleton(opened.data, max_segments=HERE_MAX_SEGMENTS)
    except jpeg_markers.TooManySegments:
        return False
    # No skeleton: the file itself is decoded, its entropy-coded data included.
    if skeleton is None or jpeg_markers.count_scans(skeleton) * pixels > HERE_MAX_SCAN_PIXELS:
        return False
    with opened:
        _check_jpeg(opened, skeleton, locator, None, max_jpeg_scans)
    return True


def _refuse(locator: str, what: str) -> BadRequest:
    return BadRequest(f"{locator}: image structure cannot be trusted ({what})", reason="bad_media")


def _every(count: int, control: DecodeControl | None) -> None:
    if control is not None and count % _CHUNKS_PER_CHECK == 0:
        control.check()


# --- JPEG -------------------------------------------------------------------------------------------------------


def _jpeg_check_mode(mode: str) -> str:
    """The mode of the 1/8-scale output: grey for a colour JPEG (libjpeg then skips the chroma's inverse DCT,
    upsampling and colour conversion; it still reads every component's coefficients), the file's own otherwise."""
    return "L" if mode == "RGB" else mode


def _check_jpeg(
    opened: OpenedImage,
    skeleton: bytes | None,
    locator: str,
    control: DecodeControl | None,
    max_jpeg_scans: int | None,
) -> None:
    """The scan count, then the 1/8-scale decode of the skeleton, or of the file where it has none."""
    refuse_scan_bombs(opened, locator=locator, max_jpeg_scans=max_jpeg_scans, segments_of=skeleton)
    if skeleton is not None:
        opened.read_instead(skeleton)
    with decode_errors(locator, "checking"):
        _jpeg_scaled_decode(opened, control)


def _jpeg_scaled_decode(opened: OpenedImage, control: DecodeControl | None) -> None:
    image = opened.take()
    opened.source.control = control
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # libjpeg's warnings: a full decode ignores them too
        try:
            size = (max(1, image.width // JPEG_CHECK_SCALE), max(1, image.height // JPEG_CHECK_SCALE))
            image.draft(_jpeg_check_mode(image.mode), size)
            image.decodermaxblock = JPEG_READ_BYTES
            image.load()
        finally:
            image.close()
    if control is not None:
        control.check()


# --- PNG --------------------------------------------------------------------------------------------------------

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MAX_LENGTH = (1 << 31) - 1
# IHDR: (colour type -> the bit depths it allows).
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}


def _walk_png(data: bytes, locator: str, control: DecodeControl | None) -> None:
    if data[:8] != _PNG_SIGNATURE:
        raise _refuse(locator, "no PNG signature")
    view = memoryview(data)
    position, count, idat = 8, 0, False
    while True:
        count += 1
        _every(count, control)
        if position + 8 > len(data):
            raise _refuse(locator, f"PNG ends at byte {len(data):,} without its IEND chunk")
        length = int.from_bytes(data[position : position + 4], "big")
        kind = bytes(data[position + 4 : position + 8])
        name = kind.decode("latin-1")
        end = position + 12 + length
        if length > _PNG_MAX_LENGTH or end > len(data):
            raise _refuse(
                locator, f"PNG chunk {name!r} at byte {position:,} runs past the end of the data ({len(data):,} bytes)"
            )
        if not kind.isalpha() or not kind.isascii():
            raise _refuse(locator, f"PNG chunk type {kind!r} at byte {position:,}")
        stored = int.from_bytes(data[end - 4 : end], "big")
        if zlib.crc32(view[position + 4 : end - 4]) != stored:
            raise _refuse(locator, f"PNG chunk {name!r} at byte {position:,} fails its CRC")
        if count == 1:
            if kind != b"IHDR" or length != 13:
                raise _refuse(locator, "PNG does not start with a 13-byte IHDR chunk")
            _check_ihdr(data[position + 8 : position + 21], locator)
        idat = idat or kind == b"IDAT"
        if kind == b"IEND":
            if not idat:
                raise _refuse(locator, "PNG has no IDAT chunk")
            return
        position = end


def _check_ihdr(fields: bytes, locator: str) -> None:
    width, height = int.from_bytes(fields[0:4], "big"), int.from_bytes(fields[4:8], "big")
    depth, colour, compression, filtering, interlace = fields[8:13]
    if not (0 < width <= _PNG_MAX_LENGTH and 0 < height <= _PNG_MAX_LENGTH):
        raise _refuse(locator, f"PNG IHDR size {width}x{height}")
    if depth not in _PNG_DEPTHS.get(colour, ()):
        raise _refuse(locator, f"PNG IHDR colour type {colour} with bit depth {depth}")
    if compression != 0 or filtering != 0 or interlace > 1:
        raise _refuse(locator, f"PNG IHDR compression {compression}, filter method {filtering}, interlace {interlace}")


# --- GIF --------------------------------------------------------------------------------------------------------

_GIF_EXTENSION, _GIF_IMAGE, _GIF_TRAILER = 0x21, 0x2C, 0x3B


def _walk_gif(data: bytes, locator: str, control: DecodeControl | None) -> None:
    """The blocks Pillow reads to decode the first image, as it reads them: bytes between blocks that start no
    block are skipped (Pillow skips them too)."""
    if len(data) < 13:
        raise _refuse(locator, "GIF ends inside its logical screen descriptor")
    flags = data[10]
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    count = 0
    while True:
        count += 1
        _every(count, control)
        if position >= len(data):
            raise _refuse(locator, f"GIF ends at byte {len(data):,} before its first image")
        block = data[position]
        if block == _GIF_EXTENSION:
            position = _gif_sub_blocks(data, position + 2, locator, control)
        elif block == _GIF_IMAGE:
            if position + 10 > len(data):
                raise _refuse(locator, f"GIF image descriptor at byte {position:,} runs past the end of the data")
            local = data[position + 9]
            position += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            if position >= len(data):
                raise _refuse(locator, "GIF ends before its first image's data")
            code_size = data[position]
            if not 1 <= code_size <= 11:  # Pillow's LZW decoder takes 1 to 11 bits
                raise _refuse(locator, f"GIF LZW code size {code_size}")
            _gif_sub_blocks(data, position + 1, locator, control)
            return
        elif block == _GIF_TRAILER:
            raise _refuse(locator, "GIF has no image")
        else:
            position += 1


def _gif_sub_blocks(data: bytes, position: int, locator: str, control: DecodeControl | None) -> int:
    """Walk a sequence of sub-blocks from `position` to its zero-length terminator; returns the byte after it."""
    count = 0
    while True:
        count += 1
        _every(count, control)
        if position >= len(data):
            raise _refuse(locator, f"GIF data block runs past the end of the data ({len(data):,} bytes)")
        size = data[position]
        position += 1 + size
        if size == 0:
            return position


# --- WebP -------------------------------------------------------------------------------------------------------


def _walk_webp(data: bytes, header: ImageHeader, locator: str) -> None:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        raise _refuse(locator, "no RIFF WEBP header")
    riff_end = 8 + int.from_bytes(data[4:8], "little")
    if riff_end > len(data):
        raise _refuse(locator, f"RIFF size {riff_end - 8:,} runs past the end of the data ({len(data):,} bytes)")
    position, first, animated = 12, None, False
    while position < riff_end:
        if position + 8 > riff_end:
            raise _refuse(locator, f"WebP chunk header at byte {position:,} runs past the RIFF size")
        fourcc = data[position : position + 4]
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        end = position + 8 + size + (size & 1)
        if position + 8 + size > riff_end:
            name = fourcc.decode("latin-1")
            raise _refuse(locator, f"WebP chunk {name!r} at byte {position:,} runs past the RIFF size")
        if fourcc == b"ANMF":
            animated = True
            if first is None:
                first = _webp_frame_image(data, position + 8 + 16, position + 8 + size, locator)
        elif fourcc in (b"VP8 ", b"VP8L") and first is None:
            first = (fourcc, position + 8, position + 8 + size)
        position = end
    if first is None:
        raise _refuse(locator, "WebP has no image chunk")
    width, height = _webp_bitstream_size(data, *first, locator)
    if not animated and (width, height) != (header.width, header.height):
        raise _refuse(locator, f"WebP container says {header.width}x{header.height}, its bitstream {width}x{height}")


def _webp_frame_image(data: bytes, position: int, frame_end: int, locator: str) -> tuple[bytes, int, int]:
    """The VP8 or VP8L chunk of an animation frame, whose chunks follow its 16-byte frame header."""
    while position + 8 <= frame_end:
        fourcc = data[position : position + 4]
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        if position + 8 + size > frame_end:
            raise _refuse(locator, f"WebP frame chunk at byte {position:,} runs past its frame")
        if fourcc in (b"VP8 ", b"VP8L"):
            return fourcc, position + 8, position + 8 + size
        position += 8 + size + (size & 1)
    raise _refuse(locator, "WebP animation frame has no image chunk")


def _webp_bitstream_size(data: bytes, fourcc: bytes, start: int, end: int, locator: str) -> tuple[int, int]:
    """The size a VP8 key frame's or a VP8L image's own header gives, after checking that header."""
    if fourcc == b"VP8L":
        if end - start < 5 or data[start] != 0x2F:
            raise _refuse(locator, "VP8L chunk without its signature")
        bits = int.from_bytes(data[start + 1 : start + 5], "little")
        if bits >> 29:
            raise _refuse(locator, f"VP8L version {bits >> 29}")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if end - start < 10:
        raise _refuse(locator, "VP8 chunk shorter than its frame header")
    tag = int.from_bytes(data[start : start + 3], "little")
    key_frame, version, shown, first_partition = not tag & 1, (tag >> 1) & 7, (tag >> 4) & 1, tag >> 5
    if not key_frame or version > 3 or not shown or data[start + 3 : start + 6] != b"\x9d\x01\x2a":
        raise _refuse(locator, "VP8 chunk does not start with a shown key frame")
    if start + 10 + first_partition > end:
        raise _refuse(locator, f"VP8 first partition ({first_partition:,} bytes) runs past its chunk")
    width = int.from_bytes(data[start + 6 : start + 8], "little") & 0x3FFF
    height = int.from_bytes(data[start + 8 : start + 10], "little") & 0x3FFF
    return width, height


# --- BMP --------------------------------------------------------------------------------------------------------


def _check_bmp(opened: OpenedImage, locator: str) -> None:
    """The pixel data Pillow's raw decoder reads: from the tile's offset, a row stride for every row but the last,
    whose padding it does not read."""
    data = opened.data
    image = opened.take()
    try:
        tiles = image.tile
        palette = 0
        if image.palette is not None:  # raw entries of `rawmode`'s bands, a byte each (BGRX: 4)
            palette = len(image.palette.palette) // len(image.palette.rawmode or image.palette.mode)
    finally:
        image.close()
    if palette > 256:  # Pillow's decode refuses it (`putpalette`)
        raise _refuse(locator, f"BMP palette of {palette:,} colours")
    info_size = int.from_bytes(data[14:18], "little")
    bits = int.from_bytes(data[24:26] if info_size == 12 else data[28:30], "little")
    for tile in tiles:
        if tile.codec_name != "raw" or not isinstance(tile.args, tuple) or len(tile.args) < 2 or not tile.extents:
            raise _refuse(locator, f"BMP pixel coding {tile.codec_name!r}")
        x0, y0, x1, y1 = tile.extents
        stride = int(tile.args[1])
        needed = tile.offset + stride * (y1 - y0 - 1) + -(-(x1 - x0) * bits // 8)
        if needed > len(data):
            raise _refuse(locator, f"BMP pixel data needs {needed:,} bytes, the data has {len(data):,}")
