"""What an image's metadata costs the loader that opens it, from a walk of its chunk or segment headers, and the
bytes that hide that metadata from the gateway's own open.

A model server loads an image with Pillow (`Image.open(BytesIO(data))`, then `convert("RGB")`), and Pillow reads
the file's metadata into Python objects as it goes: PNG text chunks (tEXt, zTXt, iTXt) as `str`s, inflated up to
1 MiB each and 64 MiB in all, iCCP inflated, eXIf and private chunks copied, at open (the chunks before the image
data) and at load (those after it); a JPEG's APPn and COM segments copied, EXIF concatenated and parsed, an ICC
profile reassembled, MPF and Photoshop blocks parsed; a GIF's comment kept one sub-block at a time and joined; a
WebP's ICCP, EXIF and XMP chunks copied. `measure` walks the headers, inflating compressed chunks a piece at a time
and dropping each piece, and returns the bytes that costs (`Metadata.nbytes`: what Pillow keeps, and the most it
holds at once while it reads one chunk), so that it is charged with the item's decode before anything is opened;
past `max_bytes` it refuses the item (413) as soon as the walk has counted that much, having inflated at most that
much plus a piece.

The gateway needs none of that metadata. `Metadata.hidden` rewrites, in what Pillow reads, the type of each such
PNG chunk (and its CRC) to one Pillow skips without keeping, a JPEG segment's marker to DNL (which Pillow skips)
and a GIF comment's label to one Pillow skips: the gateway's own open (and a PNG's load, which reads the chunks
after the image data) reads the raw bytes of a hidden chunk and drops them. A JPEG's segments are hidden only
while Pillow reads the header: libjpeg reads the file itself. Metadata that costs less than `_HIDE_ABOVE` is not
hidden: patching every read costs the open more time than the little memory saved. A WebP's chunks are copied by
libwebp's demuxer, which checks them: they are charged, not hidden (they cost at most their own size).

The rules come from Pillow 13.0.0 (`PIL/PngImagePlugin.py` `PngStream.chunk_*`, `PngImageFile._open` and
`load_end`; `PIL/JpegImagePlugin.py` `APP`, `COM`, `SOF`, `jpeg_factory`, `_getmp`, `_read_dpi_from_exif`;
`PIL/TiffImagePlugin.py` `ImageFileDirectory_v2.load`; `PIL/GifImagePlugin.py` `_seek`; `PIL/WebPImagePlugin.py`
`_open`); the per-object sizes are CPython 3.11's, measured (`tests/gateway/media/image/test_metadata.py` holds the
charge to what the loader allocates, measured with tracemalloc).
"""

from __future__ import annotations

import bisect
import re
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Literal, Protocol

from PIL import ImageFile, PngImagePlugin

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.image import jpeg_markers
from gateway.media.threads import DecodeControl

__all__ = ["METADATA_KNOB", "Hidden", "Metadata", "Seekable", "measure"]

METADATA_KNOB = "limits.max_image_metadata_bytes"

# Input read, and output inflated, at a time: what the walk holds of a chunk.
_PIECE = 64 << 10
# The walks check their control once every this many chunks, segments or blocks.
_CHUNKS_PER_CHECK = 1024
# Chunks, segments or blocks past which a file is refused: about 80 ms of the walk (0.8 us each), where a PNG of
# 64 MiB written in libpng's 8 KiB image data chunks has 8,192 and a file of empty chunks or a GIF of bytes to
# skip one at a time would take seconds, here and in the server's loader.
MAX_WALK_STEPS = 100_000
# Metadata that costs less than this is left for the gateway's open to read as it is (charged all the same):
# hiding it costs more time than the little memory it saves.
_HIDE_ABOVE = 256 << 10
# What every file has is not charged, as Pillow's image object and `info` are not: a PNG's chunks that are no
# metadata up to this size (IHDR, a palette...), a JPEG's first JFIF (APP0) and Adobe (APP14) segments of their
# standard size (14 and 12 bytes; a JFIF thumbnail makes it larger).
_SMALL_CHUNK = 64 << 10
_STANDARD_HEADER = 16

# What Pillow refuses: a text or ICC chunk inflating past MAX_TEXT_CHUNK, text past MAX_TEXT_MEMORY in all (both
# public attributes of PngImagePlugin, read here so that a deployment that changes them is followed). A chunk
# larger than ImageFile.SAFEBLOCK is read in blocks and joined: twice its size while it is read.
_SAFEBLOCK = ImageFile.SAFEBLOCK

# Bytes of a Python object beyond its payload (CPython 3.11, 64-bit), with the slot that refers to it: a `bytes`
# (33) or a compact `str` (49 for ASCII, 73 otherwise) in a list, a tuple or a dict.
_OBJECT_BYTES = 96
# A JPEG segment kept in `applist`: its payload's `bytes`, its name's `str`, the tuple and the list's slot.
_SEGMENT_BYTES = 192
# A PNG text chunk kept: its key's `str` and the entries in `info` and `text` (dicts that grow by doubling), and in
# the copy of `info` the conversion to RGB makes.
_TEXT_ENTRY_BYTES = 256
# An `iTXt` beyond its text: its instance dict with the language and translated keyword, and their `str`s.
_ITXT_BYTES = 384
# A private PNG chunk kept in `private_chunks`: its type's `bytes`, its payload's, a tuple and the list's slot.
_PRIVATE_CHUNK_BYTES = 160
# An entry Pillow's TIFF reader keeps for each tag of an IFD it loads (`ImageFileDirectory_v2.load`: the tag's
# bytes, its type, both dicts' slots).
_IFD_ENTRY_BYTES = 224
# The most an MPF segment's byte becomes (`_getmp`): an MP entry's two dicts and their values for each 16 bytes
# (640), an IFD entry for each 12 (224), a SHORT value unpacked into an int in a tuple for each 2 (36).
_MPF_BYTES_PER_BYTE = 40
# A Photoshop image resource kept (`APP`, APP13): a dict entry keyed by its 2-byte id, and its value.
_PHOTOSHOP_ENTRY_BYTES = 96
# `bytes.join` of a list holds a `Py_buffer` (80 bytes) for each item while it joins them.
_JOIN_BYTES_PER_ITEM = 80
# zlib's `decompress` assembles its output in blocks of these sizes (CPython 3.11
# `Include/internal/pycore_blocks_output_buffer.h`), all of them allocated whole, up to its `max_length`, then
# copied into the result.
_ZLIB_BLOCKS = (32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20)
# An inflater's own state: its 32 KiB window and its tables.
_ZLIB_STATE_BYTES = 48 << 10


class _Source(Protocol):
    """The file, read at any offset: bytes (a view, nothing copied) or a seekable file object."""

    size: int

    def read_at(self, offset: int, size: int) -> bytes | memoryview: ...

    def find_nul(self, start: int, end: int) -> int:
        """Where the first zero byte in `start:end` is; -1 where there is none."""


class _BytesSource:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._view = memoryview(data)
        self.size = len(data)

    def read_at(self, offset: int, size: int) -> memoryview:
        return self._view[offset : offset + size]

    def find_nul(self, start: int, end: int) -> int:
        return self._data.find(b"\0", start, end)


class _FileSource:
    def __init__(self, file: Seekable) -> None:
        self._file = file
        self.size = file.seek(0, 2)

    def read_at(self, offset: int, size: int) -> bytes:
        self._file.seek(offset)
        return self._file.read(size)

    def find_nul(self, start: int, end: int) -> int:
        for piece_start in range(start, end, _PIECE):
            found = self.read_at(piece_start, min(_PIECE, end - piece_start)).find(b"\0")
            if found >= 0:
                return piece_start + found
        return -1


class Seekable(Protocol):
    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def read(self, size: int = -1, /) -> bytes: ...


class Hidden:
    """Bytes that replace the file's own at given positions in what Pillow reads: `width` bytes at each of
    `positions` (ascending), from `replacements`, or `constant` at every one of them."""

    def __init__(self, width: int, constant: bytes | None = None) -> None:
        self.width = width
        self.constant = constant
        self.positions = array("q")
        self.replacements = bytearray()

    def add(self, position: int, replacement: bytes = b"") -> None:
        self.positions.append(position)
        self.replacements += replacement

    def __len__(self) -> int:
        return len(self.positions)

    def apply(self, start: int, chunk: bytes) -> bytes:
        """`chunk`, read from `start`, with the replacements that fall in it."""
        end = start + len(chunk)
        first = bisect.bisect_left(self.positions, start - self.width + 1)
        if first == len(self.positions) or self.positions[first] >= end:
            return chunk
        patched = bytearray(chunk)
        width = self.width
        for index in range(first, len(self.positions)):
            position = self.positions[index]
            if position >= end:
                break
            replacement = self.constant or self.replacements[index * width : (index + 1) * width]
            lo, hi = max(position, start), min(position + width, end)
            patched[lo - start : hi - start] = replacement[lo - position : hi - position]
        return bytes(patched)


def _worth_hiding(count: _Count, hidden: Hidden) -> Hidden | None:
    return hidden if hidden and count.total > _HIDE_ABOVE else None


@dataclass(slots=True)
class Metadata:
    nbytes: int = 0
    """Bytes the model server's loader allocates for the metadata: what it keeps, and the most it holds at once
    while reading one chunk or segment."""
    hidden: Hidden | None = None
    """What hides the metadata from the gateway's own open (None where there is nothing to hide)."""
    hide_during_load: bool = False
    """Whether `hidden` applies to the load too (a PNG's chunks after its image data are read by the load)."""
    kinds: set[str] = field(default_factory=set)
    """The kinds of metadata found, for messages."""


class _Count:
    """The running charge: what is kept, the largest transient, checked against the cap as it grows."""

    def __init__(self, max_bytes: int | None, locator: str, what: str) -> None:
        self.max_bytes = max_bytes
        self.locator = locator
        self.what = what
        self.kept = 0
        self.transient = 0
        self.kinds: set[str] = set()

    @property
    def total(self) -> int:
        return self.kept + self.transient

    def add(self, kind: str | None, kept: int, transient: int = 0) -> None:
        """`kind`: what the bytes are for, named in a refusal; None for what is no metadata (a chunk's read)."""
        if kind is not None:
            self.kinds.add(kind)
        self.kept += kept
        self.transient = max(self.transient, transient)
        self.check()

    def check(self, inflating: int = 0) -> None:
        """Refuse once the charge (with `inflating` bytes of a chunk being inflated) passes the cap."""
        if self.max_bytes is None or self.total + inflating <= self.max_bytes:
            return
        kinds = ", ".join(sorted(self.kinds))
        raise RequestTooLarge(
            f"{self.locator}: the image's metadata ({self.what} {kinds}) costs its loader at least "
            f"{self.total + inflating:,} bytes, over {METADATA_KNOB}={self.max_bytes:,}",
            reason="image_metadata_too_large",
        )

    def room(self) -> int | None:
        """Bytes the charge may still grow by (None: no cap)."""
        return None if self.max_bytes is None else max(0, self.max_bytes - self.total)


def measure(
    data: bytes,
    *,
    formats: tuple[str, ...],
    max_bytes: int | None,
    locator: str,
    whole: Seekable | None = None,
    control: DecodeControl | None = None,
) -> Metadata:
    """The metadata of the image `data` holds (JPEG, PNG, GIF or WebP, where `formats` allows it: Pillow's
    names): what it costs the loader, and what hides it from the gateway's open of `data`. 413 past `max_bytes`;
    400 for a chunk Pillow refuses (a text or ICC chunk inflating past its limits). `whole`: the whole file, where
    `data` is its first bytes (the header a probe reads): a PNG's chunks are walked there, to its end."""
    if data[:8] == _PNG_SIGNATURE and "PNG" in formats:
        source: _Source = _FileSource(whole) if whole is not None else _BytesSource(data)
        return _measure_png(source, len(data), max_bytes, locator, control)
    if data[:3] == b"\xff\xd8\xff" and "JPEG" in formats:
        return _measure_jpeg(data, max_bytes, locator, control)
    if data[:6] in (b"GIF87a", b"GIF89a") and "GIF" in formats:
        return _measure_gif(data, max_bytes, locator, control)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and "WEBP" in formats:
        return _measure_webp(data, max_bytes, locator)
    return Metadata()


def _every(count: int, control: DecodeControl | None, locator: str, what: str) -> None:
    """Called for each chunk, segment or block walked: checks the control now and then, and refuses a file with
    more than MAX_WALK_STEPS of them (Pillow walks each in Python, as the walk does)."""
    if count % _CHUNKS_PER_CHECK == 0:
        if control is not None:
            control.check()
        if count > MAX_WALK_STEPS:
            raise BadRequest(
                f"{locator}: the image has more than {MAX_WALK_STEPS:,} {what} before its pixels end: no encoder "
                "writes that many, and an image loader walks each one in Python",
                reason="bad_media",
            )


# --- PNG ----------------------------------------------------------------------------------------------------------

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Pillow's chunk type check (PngImagePlugin `is_cid`): a chunk whose type fails it ends what Pillow reads.
_PNG_CID = re.compile(rb"\w\w\w\w")
_PNG_TEXT = (b"tEXt", b"zTXt", b"iTXt")
_PNG_METADATA = (*_PNG_TEXT, b"iCCP", b"eXIf")
_PNG_XMP_KEY = b"XML:com.adobe.xmp"
# Chunks whose data Pillow's decoder reads a piece at a time (the image data), and the end.
_PNG_STREAMED = (b"IDAT", b"fdAT", b"IEND")
# What a hidden chunk's type becomes: ancillary, public (Pillow keeps a private chunk it has no handler for: its
# second letter is lower case) and unknown to Pillow, which reads and drops it.
_HIDDEN_TYPE = b"mMGh"
# Bytes of an iTXt value's UTF-8 that make Python keep its `str` in 2 bytes a character (U+0100 to U+FFFF: the lead
# bytes 0xC4 to 0xEF) or 4 (U+10000 and above: 0xF0 to 0xF4).
_UCS2_LEADS = re.compile(rb"[\xc4-\xef]")
_UCS4_LEADS = re.compile(rb"[\xf0-\xff]")


def _measure_png(
    source: _Source, hide_within: int, max_bytes: int | None, locator: str, control: DecodeControl | None
) -> Metadata:
    """Every chunk from the signature to IEND (Pillow reads those before the image data at open, the rest at
    load), as Pillow reads them: a chunk that runs past the data or whose type fails Pillow's check ends it. At
    open, the bytes of the chunk read before are still held (`_open`'s `s`) while a chunk is read."""
    count = _Count(max_bytes, locator, "PNG")
    hidden = Hidden(4)
    text_chars = 0
    position, chunks = 8, 0
    at_open, previous = True, 0  # Pillow's open reads up to the image data; `previous`: the chunk read before
    while position + 8 <= source.size:
        chunks += 1
        _every(chunks, control, locator, "PNG chunks")
        head = bytes(source.read_at(position, 8))
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        end = position + 12 + length
        if end > source.size or not _PNG_CID.fullmatch(kind) or kind == b"IEND":
            break
        held = previous if at_open else 0
        if kind not in _PNG_STREAMED:
            read = length * 2 if length > _SAFEBLOCK else length  # `_safe_read`: blocks, then joined
            previous = length
            private = kind[1:2].islower() and kind not in _PNG_METADATA
            if kind in _PNG_METADATA or private:
                name = kind.decode("latin-1")
                kept, peak, chars = _png_metadata(source, kind, position + 8, length, count, locator)
                text_chars += chars
                if text_chars > PngImagePlugin.MAX_TEXT_MEMORY:
                    raise BadRequest(
                        f"{locator}: PNG text chunks hold more than {PngImagePlugin.MAX_TEXT_MEMORY:,} characters, "
                        "more than the image loader accepts (Pillow's PngImagePlugin.MAX_TEXT_MEMORY)",
                        reason="bad_media",
                    )
                what = f"{name} chunks" if not private else "private chunks"
                count.add(what, kept, max(read, peak) - kept + held)
                if end <= hide_within:
                    hidden.add(position + 4, _HIDDEN_TYPE)
                    crc = zlib.crc32(_HIDDEN_TYPE)
                    for start in range(position + 8, end - 4, _PIECE):
                        crc = zlib.crc32(source.read_at(start, min(_PIECE, end - 4 - start)), crc)
                    hidden.add(end - 4, crc.to_bytes(4, "big"))
            elif length > _SMALL_CHUNK:  # the other chunks Pillow reads whole: PLTE and tRNS are kept
                kept = length + _OBJECT_BYTES if kind in (b"PLTE", b"tRNS") else 0
                count.add(None, kept, read - kept + held)
        else:
            at_open = False  # the image data: what follows is read at load
        position = end
    return Metadata(count.total, _worth_hiding(count, hidden), True, count.kinds)


def _png_metadata(
    source: _Source, kind: bytes, start: int, length: int, count: _Count, locator: str
) -> tuple[int, int, int]:
    """(kept, peak, text characters counted against MAX_TEXT_MEMORY) of one metadata chunk, as its
    `PngStream.chunk_*` handler allocates them: what stays in `info`, `text` or `private_chunks`, and the most it
    holds at once (the chunk read whole, the pieces its splits copy, the inflated output being assembled, the
    decoded `str`), what it keeps included."""
    if kind == b"eXIf":
        return length + 6 + _OBJECT_BYTES, 2 * length + 6, 0  # b"Exif\0\0" + the chunk, while the chunk lives
    if kind not in _PNG_TEXT and kind != b"iCCP":
        return length + _PRIVATE_CHUNK_BYTES, length, 0  # a private chunk: kept as read
    end = start + length
    nul = source.find_nul(start, end)  # the key ends there (Pillow's `split(b"\0", 1)`); none: all key
    key_size = (nul if nul >= 0 else end) - start
    entry = _TEXT_ENTRY_BYTES + key_size  # the key's latin-1 `str`, and the dicts' entries
    value = nul + 1 if nul >= 0 else end
    if kind == b"tEXt":
        size = end - value
        if not key_size:
            return 0, 2 * length, 0
        # The chunk, the split's pieces, the key's and the value's latin-1 `str`s kept; key "exif" keeps the
        # split's value too.
        exif = size if key_size == 4 and bytes(source.read_at(start, 4)) == b"exif" else 0
        return size + entry + exif, 2 * length + key_size + size, size
    if kind == b"zTXt" or kind == b"iCCP":
        # iCCP: Pillow takes the byte after the first zero (the first byte where there is none) as the method.
        method_at = value if nul >= 0 or kind == b"zTXt" else start
        method = source.read_at(method_at, 1)[0] if method_at < end else 0
        if method != 0:
            # Pillow refuses the file (SyntaxError), at open or at load.
            raise BadRequest(
                f"{locator}: PNG {kind.decode()} chunk with compression method {method}, which the image loader "
                "refuses",
                reason="bad_media",
            )
        inflated, _ = _inflate(source, min(end, method_at + 1), end, kind, count, locator, utf8=False)
        # The chunk, the split's pieces and the compressed slice, the output assembled; the `str` made of it.
        peak = 3 * length + key_size + max(_zlib_output_peak(inflated), 2 * inflated)
        if kind == b"iCCP":
            return inflated + _OBJECT_BYTES, peak, 0
        return (inflated + entry, peak, inflated) if key_size else (0, peak, 0)
    # iTXt: key NUL, compression flag, method, language NUL, translated keyword NUL, text.
    if nul < 0 or value + 2 > end:
        return 0, length, 0  # Pillow returns without keeping anything
    compressed, method = bytes(source.read_at(value, 2))
    language = source.find_nul(value + 2, end)
    translated = source.find_nul(language + 1, end) if language >= 0 else -1
    if translated < 0 or (compressed and method != 0):
        return 0, 4 * length, 0  # the tags missing, or an unknown method: nothing kept
    text = translated + 1
    if compressed:
        size, width = _inflate(source, text, end, kind, count, locator, utf8=True)
    else:
        size, width = end - text, _utf8_width(source, text, end)
    # The chunk and its splits' pieces; the UTF-8 (inflated, then kept as info["xmp"] for XMP); its decode, a
    # narrow `str` widened to `width` bytes a character; the `iTXt` (a `str` subclass: a copy) kept, with its
    # language and translated keyword (UTF-8 too).
    xmp = size if key_size == len(_PNG_XMP_KEY) and bytes(source.read_at(start, key_size)) == _PNG_XMP_KEY else 0
    tags = (translated - value - 3) * _utf8_width(source, value + 2, translated)
    kept = size * width + entry + _ITXT_BYTES + tags + xmp
    decoding = size + max(size + size * width if width > 1 else size, 2 * size * width)
    return kept, 4 * length + max(_zlib_output_peak(size) if compressed else 0, decoding), size


def _zlib_output_peak(size: int) -> int:
    """The most zlib's `decompress` (with Pillow's `max_length`) holds while it inflates `size` bytes: its state,
    its blocks, then its result."""
    allocated = 0
    for block in _ZLIB_BLOCKS:
        if allocated >= size:
            break
        allocated += block
    return _ZLIB_STATE_BYTES + min(allocated, max(size, PngImagePlugin.MAX_TEXT_CHUNK)) + size


def _inflate(
    source: _Source, start: int, end: int, kind: bytes, count: _Count, locator: str, *, utf8: bool
) -> tuple[int, int]:
    """(bytes, str width) the zlib stream at `start:end` inflates to, a piece at a time (each dropped): refused
    past Pillow's MAX_TEXT_CHUNK (400) or past what the charge has room for (413), having inflated at most a piece
    more. A stream zlib refuses counts what it gave before (Pillow then keeps nothing)."""
    limit = PngImagePlugin.MAX_TEXT_CHUNK
    inflater = zlib.decompressobj()
    produced, width = 0, 1
    try:
        for piece_start in range(start, end, _PIECE):
            piece: bytes | memoryview = source.read_at(piece_start, min(_PIECE, end - piece_start))
            while piece and not inflater.eof:
                out = inflater.decompress(piece, _PIECE)
                produced += len(out)
                if utf8 and width < 4:
                    width = 4 if _UCS4_LEADS.search(out) else 2 if width == 2 or _UCS2_LEADS.search(out) else 1
                if produced > limit:
                    raise BadRequest(
                        f"{locator}: PNG {kind.decode()} chunk inflates past {limit:,} bytes, more than the image "
                        "loader accepts (Pillow's PngImagePlugin.MAX_TEXT_CHUNK)",
                        reason="bad_media",
                    )
                count.check(produced * width)
                piece = inflater.unconsumed_tail
            if inflater.eof:
                break
    except zlib.error:
        pass
    return produced, width


def _utf8_width(source: _Source, start: int, end: int) -> int:
    width = 1
    for piece_start in range(start, end, _PIECE):
        piece = source.read_at(piece_start, min(_PIECE, end - piece_start))
        if _UCS4_LEADS.search(piece):
            return 4
        if _UCS2_LEADS.search(piece):
            width = 2
    return width


# --- JPEG ---------------------------------------------------------------------------------------------------------

_APP0, _APP1, _APP2, _APP13, _APP14, _APP15 = 0xE0, 0xE1, 0xE2, 0xED, 0xEE, 0xEF
_DNL = 0xDC  # a marker Pillow's header parser skips (`Skip`)
# Markers Pillow reads no payload for (`MARKER` entries without a handler): JPG, RSTn, SOI, EOI, JPGn.
_PAYLOADLESS = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})
# Frame headers (`SOF` handler): SOFn and DHP. Each 3 bytes past the first 6 become a 4-tuple in `layer`.
_SOF = frozenset({*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), *range(0xCD, 0xD0), 0xDE})
_LAYER_BYTES = 80
_EXIF = b"Exif\0\0"
_XMP = b"http://ns.adobe.com/xap/1.0/\0"
_ICC = b"ICC_PROFILE\0"
_MPF = b"MPF\0"
_PHOTOSHOP = b"Photoshop 3.0\0"


def _measure_jpeg(data: bytes, max_bytes: int | None, locator: str, control: DecodeControl | None) -> Metadata:
    """The APPn and COM segments before the first scan, which Pillow's `JpegImageFile._open` reads: each payload
    copied into `applist`, and what its handler makes of it; and the frame headers, whose every 3 bytes Pillow
    keeps as a tuple. libjpeg, which decodes, skips APPn and COM.

    The segments are found as Pillow finds them: byte by byte between segments, 0xFF fill bytes and 0xFF00
    passed over, a marker without a payload (RSTn, SOI, EOI, JPGn) read on past; the walk ends at the first SOS,
    or where Pillow fails (a marker it does not know, a segment past the end of the data)."""
    count = _Count(max_bytes, locator, "JPEG")
    hidden = Hidden(1, bytes((_DNL,)))
    exif = icc = xmp = mpf = 0
    exif_segments = icc_segments = segments = 0
    first_exif = first_exif_end = -1
    seen: set[int] = set()
    standard = {_APP0, _APP14}
    size_of_data = len(data)
    position, current = 3, 0xFF  # after SOI and the 0xFF Pillow has already read
    while position < size_of_data:
        if current != 0xFF:
            current, position = data[position], position + 1
            continue
        marker, position = data[position], position + 1
        if marker == 0xFF:
            continue
        if marker == 0x00:
            if position >= size_of_data:
                break
            current, position = data[position], position + 1
            continue
        if marker < 0xC0:
            break  # "no marker found"
        if marker not in _PAYLOADLESS:
            if position + 2 > size_of_data:
                break
            at, start = position - 2, position + 2
            end = position + max(2, int.from_bytes(data[position:start], "big"))
            if end > size_of_data or marker == jpeg_markers.SOS:
                break
            position = end
            segments += 1
            _every(segments, control, locator, "JPEG segments")
            size = end - start
            if marker in standard and size <= _STANDARD_HEADER:
                standard.discard(marker)  # the JFIF or Adobe header every encoder writes: as the image object
            elif _APP0 <= marker <= _APP15 or marker == jpeg_markers.COM:
                kept = size + _SEGMENT_BYTES  # the payload's copy, in `applist` (and `app`, `info`: the same)
                if marker == _APP1 and data.startswith(_EXIF, start, end):
                    exif += size if not exif_segments else size - len(_EXIF)
                    exif_segments += 1
                    if first_exif < 0:
                        first_exif, first_exif_end = start + len(_EXIF), end
                elif marker == _APP1 and data.startswith(_XMP, start, end):
                    xmp = max(xmp, size)  # the split's piece after the namespace: the last stays in info["xmp"]
                elif marker == _APP2 and data.startswith(_ICC, start, end):
                    icc += size - len(_ICC) - 2
                    icc_segments += 1
                elif marker == _APP2 and data.startswith(_MPF, start, end):
                    mpf = max(mpf, size - len(_MPF))  # the last one is parsed
                elif marker == _APP13 and data.startswith(_PHOTOSHOP, start, end):
                    kept += size + data.count(b"8BIM", start, end) * _PHOTOSHOP_ENTRY_BYTES
                if marker not in seen:
                    seen.add(marker)
                    count.kinds.add("COM segments" if marker == jpeg_markers.COM else f"APP{marker - _APP0} segments")
                count.kept += kept
                count.check()
                hidden.add(at + 1)
            elif marker in _SOF:
                layers = -(-max(0, size - 6) // 3)
                if layers > 4:  # more than a frame's components: a frame header that lies about its length
                    count.add("SOF segments", layers * _LAYER_BYTES)
        if position >= size_of_data:
            break
        current, position = data[position], position + 1
    if exif:
        # Concatenated (each `+=` a new copy while the old one lives), then parsed at open for its resolution:
        # the EXIF without its prefix copied (`re.sub`: a slice, then joined), its first IFD's tags copied
        # (within its size) and entered.
        entries = _ifd_entries(data, first_exif, first_exif_end, exif)
        concatenated = exif if exif_segments > 1 else 0
        count.add("EXIF", concatenated + 2 * exif + entries * _IFD_ENTRY_BYTES, exif)
    if xmp:
        count.add("XMP", xmp + _OBJECT_BYTES)
    if icc:
        # The pieces without their headers, then joined.
        count.add("ICC profile", icc + _OBJECT_BYTES, icc + icc_segments * (_OBJECT_BYTES + _JOIN_BYTES_PER_ITEM))
    if mpf:
        count.add("MPF", _mpf_bytes(mpf))
    return Metadata(count.total, _worth_hiding(count, hidden), False, count.kinds)


def _mpf_bytes(size: int) -> int:
    """What `jpeg_factory` makes of an MPF segment's TIFF structure of `size` bytes (`_getmp`): the copy, its tags'
    bytes copied, and at most `_MPF_BYTES_PER_BYTE` of Python objects for each of its bytes, whatever it holds."""
    return 2 * size + size * _MPF_BYTES_PER_BYTE


def _ifd_entries(data: bytes, tiff: int, tiff_end: int, exif: int) -> int:
    """The entries of the first IFD of the EXIF whose TIFF structure lies at `tiff:tiff_end` (its first segment),
    which Pillow's parse enters (`ImageFileDirectory_v2.load`): its 16-bit count, bounded by the 12 bytes an entry
    takes in the EXIF. Where the count lies past the first segment, the bound alone."""
    bound = min(65_535, exif // 12)
    mark = data[tiff : tiff + 2]
    if mark not in (b"II", b"MM"):
        return bound
    order: Literal["little", "big"] = "little" if mark == b"II" else "big"
    offset = tiff + int.from_bytes(data[tiff + 4 : tiff + 8], order)
    if offset + 2 > tiff_end:
        return bound
    return min(bound, int.from_bytes(data[offset : offset + 2], order))


# --- GIF ----------------------------------------------------------------------------------------------------------

_GIF_EXTENSION, _GIF_IMAGE, _GIF_TRAILER = 0x21, 0x2C, 0x3B
_GIF_COMMENT, _GIF_APPLICATION = 0xFE, 0xFF
_GIF_HIDDEN_LABEL = 0x01  # the plain text extension's: Pillow reads its sub-blocks and drops them


def _measure_gif(data: bytes, max_bytes: int | None, locator: str, control: DecodeControl | None) -> Metadata:
    """The blocks before the first image, which Pillow's `GifImageFile._seek(0)` reads at open, read as it reads
    them: each comment sub-block kept as a `bytes` in a list (a one-byte one is CPython's shared object) until
    they are joined, the first sub-block of each application extension kept. An extension other than a comment
    whose first sub-block is empty has Pillow read one sub-block more (`while self.data()` after `self.data()`
    returned None at the terminator); a comment is hidden only where its first sub-block is not empty, so that
    the label Pillow then sees has it read the same bytes."""
    count = _Count(max_bytes, locator, "GIF")
    hidden = Hidden(1, bytes((_GIF_HIDDEN_LABEL,)))
    if len(data) < 13:
        return Metadata()
    flags = data[10]
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = pieces = joined = 0

    def sub_block(at: int) -> tuple[int, int]:
        """Pillow's `data()`: (the sub-block's size, 0 for the terminator or the end of the data; the position
        after it)."""
        if at >= len(data) or not data[at]:
            return 0, at + 1
        return min(data[at], len(data) - at - 1), at + 1 + data[at]

    while position < len(data):
        blocks += 1
        _every(blocks, control, locator, "GIF blocks")
        block, position = data[position], position + 1
        if block in (_GIF_IMAGE, _GIF_TRAILER):
            break
        if block != _GIF_EXTENSION:
            continue  # Pillow reads on, a byte at a time
        if position >= len(data):
            break
        label_at, label = position, data[position]
        size, position = sub_block(position + 1)
        if label == _GIF_COMMENT:
            if size:
                hidden.add(label_at)
                count.kinds.add("comment extensions")
                if pieces:
                    pieces += 10 + _JOIN_BYTES_PER_ITEM  # a shared b"\n" between two comments
                    joined += 1
            while size:
                blocks += 1
                _every(blocks, control, locator, "GIF blocks")
                joined += size
                # Its `bytes`, the list's slot (over-allocated by an eighth), the join's buffer.
                pieces += 10 + _JOIN_BYTES_PER_ITEM + (0 if size == 1 else 40 + size)
                count.check(joined + pieces)
                size, position = sub_block(position)
            continue
        if label == _GIF_APPLICATION and size:
            count.add("application extensions", size + _OBJECT_BYTES)
            if data.startswith(b"NETSCAPE2.0", position - size):
                _, position = sub_block(position)
        while True:
            blocks += 1
            _every(blocks, control, locator, "GIF blocks")
            size, position = sub_block(position)
            if not size:
                break
    if joined:
        count.add("comment extensions", joined + _OBJECT_BYTES, pieces)
    return Metadata(count.total, _worth_hiding(count, hidden), False, count.kinds)


# --- WebP ---------------------------------------------------------------------------------------------------------

_WEBP_METADATA = (b"ICCP", b"EXIF", b"XMP ")


def _measure_webp(data: bytes, max_bytes: int | None, locator: str) -> Metadata:
    """The first ICCP, EXIF and XMP chunk, which Pillow's `WebPImageFile._open` copies out of libwebp's demuxer
    (`get_chunk`)."""
    count = _Count(max_bytes, locator, "WebP")
    seen: set[bytes] = set()
    position, end = 12, min(len(data), 8 + int.from_bytes(data[4:8], "little"))
    while position + 8 <= end:
        fourcc = data[position : position + 4]
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        if fourcc in _WEBP_METADATA and fourcc not in seen:
            seen.add(fourcc)
            count.add(f"{fourcc.decode().strip()} chunks", min(size, end - position - 8) + _OBJECT_BYTES)
        position += 8 + size + (size & 1)
    return Metadata(count.total, None, False, count.kinds)
