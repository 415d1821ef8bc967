"""Reading an image's header, and decoding it to RGB the way the model servers do. Runs on worker threads.

What a decode allocates is known from the header (`ImageHeader.decode_bytes`), so it can be charged before the
decode starts; so is what the file's metadata costs the model server's loader (`image.metadata`), which the
gateway's own open and decode never read into memory. How long a decode runs is bounded by `DecodeControl`: Pillow
reads its input through a file object that checks the control at every chunk, and a JPEG's scans are counted from
its markers before decoding.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, ImageFile, UnidentifiedImageError

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.image import metadata as image_metadata
from gateway.media.image.jpeg_markers import SOS, count_scans, segments
from gateway.media.threads import DeadlinePassed, DecodeControl
from processor_geometry.rgb import conversion_bytes, pixel_size, to_rgb

__all__ = [
    "PIL_FORMATS",
    "ImageHeader",
    "OpenedImage",
    "decode_errors",
    "decode_opened",
    "decode_rgb",
    "open_image",
    "pil_formats",
    "read_header",
    "refuse_scan_bombs",
    "to_rgb",
]

# limits.max_image_pixels is checked against the header before any decode (for WebP before Pillow opens the
# file, see `read_header`); Pillow's own global check would otherwise apply a second, different threshold.
Image.MAX_IMAGE_PIXELS = None

# Pillow's plugin names for the formats media.formats may list.
PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF"}

# Bytes Pillow's decoders read at a time during `load`; each read checks the decode's control. What one chunk can
# cost is bounded by the format: PNG's and GIF's decompressors expand input by at most about a thousand and four
# thousand times, BMP's run-length coding by 255 pixels per two bytes, but one ~12-byte progressive JPEG scan costs
# a pass over every block of a component. 1 KiB of JPEG is about 85 such scans between checks; smaller chunks
# cost measurable time on ordinary files (Pillow copies the unconsumed input at every read).
DECODE_READ_BYTES = 16384
JPEG_READ_BYTES = 1024


@dataclass(frozen=True, slots=True)
class ImageHeader:
    format: str
    width: int
    height: int
    mode: str
    transparency: bool = False
    """The image has a `transparency` entry (a palette index or colour key): it is composited onto white."""
    decoder_bytes: int = 0
    """Bytes the format's decoder holds while it runs, besides the decoded image: a progressive JPEG's
    coefficients, WebP's canvases and its copy of the file, a BMP run-length decoder's buffers."""
    metadata_bytes: int = 0
    """Bytes the model server's loader allocates for the file's metadata (text, ICC profiles, EXIF:
    `image_metadata.measure`), which it holds through the decode."""

    @property
    def media_type(self) -> str:
        return "image/" + ("jpeg" if self.format == "mpo" else self.format)

    @property
    def rgb_bytes(self) -> int:
        """Bytes of the decoded RGB image the model server works from (3 per pixel)."""
        return self.width * self.height * 3

    @property
    def image_bytes(self) -> int:
        """Bytes Pillow holds for the decoded image in its own mode."""
        return self.width * self.height * pixel_size(self.mode)

    @property
    def decode_bytes(self) -> int:
        """Peak bytes a decode to RGB allocates: the decoded image, its decoder's own buffers and the conversion to
        RGB (the RGB image Pillow returns included), and the model server's loader's metadata (`metadata_bytes`;
        the gateway's own decode, which never reads it, allocates less).

        A JPEG's coefficient buffers come from the C heap, which may keep them in the process after they are
        freed, so the conversion's allocation can come on top of them: both are charged. WebP's canvases are
        freed (mapped memory, returned at once) before the conversion starts: the larger of the two is charged.
        """
        converting = conversion_bytes(self.mode, self.width, self.height, transparency=self.transparency)
        if self.format in ("jpeg", "mpo"):
            return self.image_bytes + self.decoder_bytes + converting + self.metadata_bytes
        return self.image_bytes + max(self.decoder_bytes, converting) + self.metadata_bytes


def pil_formats(formats: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [name for name in formats if name not in PIL_FORMATS]
    if unknown:
        raise ValueError(f"media.formats has unsupported formats {unknown}; known: {sorted(PIL_FORMATS)}")
    return tuple(PIL_FORMATS[name] for name in formats)


def read_header(
    data: bytes,
    *,
    formats: tuple[str, ...],
    max_pixels: int | None,
    locator: str,
    max_metadata_bytes: int | None = None,
    whole: image_metadata.Seekable | None = None,
) -> ImageHeader:
    """Identify the image from its header alone; refuse a disallowed format, too many pixels or too much metadata
    before decoding. `whole`: the whole file, where `data` is its first bytes (see `open_image`)."""
    with open_image(
        data,
        formats=formats,
        max_pixels=max_pixels,
        locator=locator,
        max_metadata_bytes=max_metadata_bytes,
        whole=whole,
    ) as opened:
        return opened.header


class OpenedImage:
    """An image whose header is read and checked (`open_image`), not decoded yet: `decode_opened` decodes it from
    the same file object, so the header is parsed once; `close` drops it undecoded. Either lets go of the opened
    image (and whatever its format's plugin holds: WebP's decoder and canvases)."""

    def __init__(self, image: ImageFile.ImageFile, source: _ControlledInput, header: ImageHeader, data: bytes) -> None:
        self._image: ImageFile.ImageFile | None = image
        self.source = source
        self.header = header
        self.data = data

    def take(self) -> ImageFile.ImageFile:
        """The opened image, for its decode; this object lets go of it."""
        image, self._image = self._image, None
        if image is None:
            raise RuntimeError("the image was already decoded or closed")
        return image

    def read_instead(self, data: bytes) -> None:
        """Have the decode read `data`, from its start, in place of the file: the header stays the file's."""
        if self._image is None:
            raise RuntimeError("the image was already decoded or closed")
        self.source = _ControlledInput(data, None)
        self._image.fp = self.source

    def extend_to(self, data: bytes) -> None:
        """For an image opened from the first bytes of `data` (a header that lies within them): the file is
        `data` from now on, for the decode and for what reads `self.data`."""
        if data[: len(self.data)] != self.data:
            raise ValueError("the opened bytes do not start the file")
        hidden = self.source.hidden
        self.read_instead(data)
        self.source.hidden = hidden  # the same file: its metadata lies where it did
        self.data = data

    def close(self) -> None:
        image, self._image = self._image, None
        if image is not None:
            image.close()

    def __enter__(self) -> OpenedImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_image(
    data: bytes,
    *,
    formats: tuple[str, ...],
    max_pixels: int | None,
    locator: str,
    max_metadata_bytes: int | None = None,
    whole: image_metadata.Seekable | None = None,
    control: DecodeControl | None = None,
) -> OpenedImage:
    """`read_header`, with the image left open for `decode_opened` (which closes it), or for the caller to close.

    The file's metadata is measured first (`image_metadata.measure`: a 413 past `max_metadata_bytes`), its cost
    kept in the header, and hidden from Pillow's open (and from a PNG's load). `whole`: the whole file where `data`
    is its first bytes, whose metadata (a PNG's chunks after its image data) counts too. `control` stops the walk.
    """
    webp = _webp_size(data) if "WEBP" in formats else None
    if webp is not None:
        # Opening a WebP creates libwebp's decoder, which allocates two canvases of the full size: the size is
        # checked first.
        _check_pixels(*webp, max_pixels, locator)
    metadata = image_metadata.measure(
        data, formats=formats, max_bytes=max_metadata_bytes, locator=locator, whole=whole, control=control
    )
    source = _ControlledInput(data, None, metadata.hidden)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(source, formats=formats)
        if not metadata.hide_during_load:
            source.hidden = None  # the decoder (libjpeg) reads the file as it is
    except UnidentifiedImageError:
        allowed = ", ".join(name.lower() for name in formats)
        raise BadRequest(
            f"{locator}: not an image in an accepted format (media.formats: {allowed})", reason="bad_media"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadRequest(f"{locator}: unreadable image header ({exc})", reason="bad_media") from None
    try:
        header = ImageHeader(
            format=(image.format or "").lower(),
            width=image.width,
            height=image.height,
            mode=image.mode,
            transparency=image.info.get("transparency") is not None,
            decoder_bytes=_decoder_bytes(image, data),
            metadata_bytes=metadata.nbytes,
        )
        _check_pixels(header.width, header.height, max_pixels, locator)
    except BaseException:
        image.close()
        raise
    return OpenedImage(image, source, header, data)


def _check_pixels(width: int, height: int, max_pixels: int | None, locator: str) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise RequestTooLarge(
            f"{locator}: image is {width}x{height} = {width * height:,} pixels, "
            f"over limits.max_image_pixels={max_pixels:,}",
            reason="image_too_large",
        )


# --- what each format's decoder holds ---------------------------------------------------------------------


def _decoder_bytes(image: Image.Image, data: bytes) -> int:
    pixels = image.width * image.height
    if image.format in ("JPEG", "MPO"):
        return _jpeg_coefficient_bytes(image, data)
    if image.format == "WEBP":
        # libwebp's animation decoder (Pillow's only WebP path) decodes into a 4-byte RGBA canvas and copies it
        # into a second one kept for the next frame's disposal; Pillow copies the canvas into a bytes object to
        # unpack it; the decoder holds its own copy of the file. Before those copies, the bitstream decoder has
        # its own buffers: a lossless one a 4-byte ARGB image, a lossy one with alpha the alpha plane and its
        # 8-bit lossless decode. They are freed first, but the larger allocations that follow reuse their pages
        # only in part: measured, they add to the peak about as much as their size (a lossy decode without
        # alpha, about a byte a pixel).
        lossless, alpha = _webp_bitstream(data)
        return 3 * pixels * 4 + len(data) + pixels * (4 if lossless else 3 if alpha else 1)
    if image.format == "BMP" and image.info.get("compression") in (_BMP_RLE8, _BMP_RLE4):
        # Pillow's run-length decoder is Python: it collects one byte a pixel in a bytearray (which grows by up
        # to an eighth over), then copies it into bytes to unpack.
        return pixels * 9 // 8 + pixels
    return 0


_BMP_RLE8 = 1
_BMP_RLE4 = 2
_JPEG_BLOCK_BYTES = 64 * 2  # 64 coefficients of 16 bits


def _jpeg_coefficient_bytes(image: Image.Image, data: bytes) -> int:
    """libjpeg keeps every block's coefficients for the whole image when the file has more than one scan: it
    decides so from the frame and the first scan's header (libjpeg-turbo jdinput.c `initial_setup`: progressive,
    or fewer components in the first scan than in the frame). Per component, its blocks rounded up to whole
    sampling factors."""
    layers: list[tuple[int, int, int, int]] = getattr(image, "layer", [])
    if not layers:
        return 0
    if not image.info.get("progressive"):
        first = next((segment for segment in segments(data) if segment.marker == SOS), None)
        # The first scan's header: its marker, its length, then its component count.
        if first is None or first.start + 4 >= len(data) or data[first.start + 4] >= len(layers):
            return 0
    h_max = max(layer[1] for layer in layers) or 1
    v_max = max(layer[2] for layer in layers) or 1
    total = 0
    for _, h, v, _ in layers:
        h, v = max(h, 1), max(v, 1)
        width_blocks = -(-image.width * h // (8 * h_max))
        height_blocks = -(-image.height * v // (8 * v_max))
        total += -(-width_blocks // h) * h * (-(-height_blocks // v) * v) * _JPEG_BLOCK_BYTES
    return total


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """A WebP's canvas size from its first RIFF chunk; None when `data` is not a WebP whose size can be read."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _webp_bitstream(data: bytes) -> tuple[bool, bool]:
    """(lossless, alpha) of a WebP's first image: its VP8L or VP8 chunk, inside the first animation frame if
    animated. A VP8X file whose image chunk lies past `data` (a header read from a prefix) counts as lossless."""
    alpha = len(data) > 20 and data[12:16] == b"VP8X" and bool(data[20] & 0x10)
    offset = 12
    while offset + 8 <= len(data):
        fourcc = data[offset : offset + 4]
        size = int.from_bytes(data[offset + 4 : offset + 8], "little")
        if fourcc == b"VP8L":
            return True, alpha
        if fourcc == b"VP8 ":
            return False, alpha
        # An animation frame's chunks follow its 16-byte frame header.
        offset += 8 + 16 if fourcc == b"ANMF" else 8 + size + (size & 1)
    return True, alpha


# --- bounding the decode ----------------------------------------------------------------------------------


class _ControlledInput(io.BytesIO):
    """The encoded image as Pillow reads it: a read of a decoder's chunk checks the control first.

    Reads of a few bytes (header fields; Pillow's BMP run-length decoder reads one byte at a time) check it once
    every `_SMALL_READS_PER_CHECK` reads, which keeps the check's cost out of a byte-at-a-time decode.
    """

    def __init__(self, data: bytes, control: DecodeControl | None, hidden: image_metadata.Hidden | None = None) -> None:
        super().__init__(data)
        self.control = control
        """Set by the decode: the header is read before the decode's control exists."""
        self.hidden = hidden
        """The file's metadata hidden from Pillow (`image_metadata.Hidden`), while it applies."""
        self._small_reads = 0

    def read(self, size: int | None = -1, /) -> bytes:
        control = self.control
        if control is not None:
            if size is None or not 0 <= size < _SMALL_READ:
                control.check()
            else:
                self._small_reads += 1
                if self._small_reads >= _SMALL_READS_PER_CHECK:
                    self._small_reads = 0
                    control.check()
        hidden = self.hidden
        if hidden is None:
            return _bytesio_read(self, size)
        start = self.tell()
        return hidden.apply(start, _bytesio_read(self, size))


_SMALL_READ = 64
_SMALL_READS_PER_CHECK = 1024
_bytesio_read = io.BytesIO.read  # without super(), which costs as much as the read itself


def decode_rgb(
    data: bytes,
    *,
    formats: tuple[str, ...],
    locator: str,
    control: DecodeControl | None = None,
    max_jpeg_scans: int | None = None,
) -> Image.Image:
    """`open_image` (its header checks, with no pixel limit) then `decode_opened`."""
    opened = open_image(data, formats=formats, max_pixels=None, locator=locator)
    return decode_opened(opened, locator=locator, control=control, max_jpeg_scans=max_jpeg_scans)


def decode_opened(
    opened: OpenedImage, *, locator: str, control: DecodeControl | None = None, max_jpeg_scans: int | None = None
) -> Image.Image:
    """Decode fully (a truncated or corrupt file is a 400) and convert to RGB (`to_rgb`); `opened` is closed.

    A JPEG with more than `max_jpeg_scans` scans is refused before decoding. `control` stops the decode at its
    next read of input: past its timeout (413) or once cancelled (`DecodeCancelled`). WebP is decoded by one
    call into libwebp that reads nothing in between, so a WebP decode is stopped only before or after it; its
    time is bounded by its pixels.
    """
    with opened:
        refuse_scan_bombs(opened, locator=locator, max_jpeg_scans=max_jpeg_scans)
        with decode_errors(locator, "decoding"):
            # No local holds the opened image: it, and what its plugin holds, are freed before the conversion.
            image = _load(opened.take(), opened.source, control)
    return to_rgb(image)


def refuse_scan_bombs(
    opened: OpenedImage, *, locator: str, max_jpeg_scans: int | None, segments_of: bytes | None = None
) -> None:
    """A JPEG with more than `max_jpeg_scans` scans (counted from its markers) is a 413, before its pixels are
    read: libjpeg's work is its pixels times its scans, at any output scale. `segments_of`: bytes with the file's
    segments to count from instead of the file (its skeleton)."""
    if max_jpeg_scans is None or opened.header.format not in ("jpeg", "mpo"):
        return
    scans = count_scans(opened.data if segments_of is None else segments_of, stop_after=max_jpeg_scans + 1)
    if scans > max_jpeg_scans:
        raise RequestTooLarge(
            f"{locator}: JPEG has at least {scans} scans (counted from its markers), "
            f"over media.max_jpeg_scans={max_jpeg_scans}",
            reason="too_many_scans",
        )


@contextmanager
def decode_errors(locator: str, doing: str) -> Iterator[None]:
    """What a decoder raises on the client's bytes as the client's error: past the control's timeout a 413,
    anything Pillow raises on a truncated or corrupt file a 400 naming the item."""
    try:
        yield
    except DeadlinePassed as passed:
        raise RequestTooLarge(
            f"{locator}: {doing} the image took longer than media.decode_timeout_s={passed.timeout_s:g}",
            reason="decode_timeout",
        ) from None
    except (OSError, ValueError, SyntaxError, UnidentifiedImageError) as exc:
        raise BadRequest(f"{locator}: image cannot be decoded ({exc})", reason="bad_media") from None


def _load(image: ImageFile.ImageFile, source: _ControlledInput, control: DecodeControl | None) -> Image.Image:
    """The decoded image, detached from its file object: a plain image over the same pixels, so that whatever
    the format's plugin holds (WebP's decoder and canvases) is freed, with `image`, before the conversion to RGB."""
    source.control = control
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            image.decodermaxblock = JPEG_READ_BYTES if image.format in ("JPEG", "MPO") else DECODE_READ_BYTES
            image.load()
            # `_new` wraps the same pixel storage in a plain Image (Pillow's own way of deriving images).
            loaded = image._new(image.im)
        finally:
            image.close()
    if control is not None:
        control.check()
    return loaded
