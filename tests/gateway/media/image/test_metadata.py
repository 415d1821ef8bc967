"""What an image's metadata costs the model server's loader (`image_metadata.measure`), held to what that loader
allocates, measured (tracemalloc, in a fresh interpreter: `upstream_loads.traced_peaks`); the refusals; and the
metadata hidden from the gateway's own open without changing what it decodes."""

from __future__ import annotations

import io
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image, PngImagePlugin, UnidentifiedImageError

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.image.decode import decode_opened, decode_rgb, open_image, pil_formats, read_header
from gateway.media.image.metadata import METADATA_KNOB, measure
from tests.gateway.media.upstream_loads import traced_peaks
from tests.gateway.media_factory import (
    PNG_TEXT_CHUNK_LIMIT,
    exif_segment_payload,
    gif_with_comment,
    image_bytes,
    itxt,
    jpeg_segment,
    jpeg_with_segments,
    mpf_segment_payload,
    photoshop_segment_payload,
    png_chunk,
    png_text_bomb,
    png_with_chunks,
    ztxt,
)

FORMATS = pil_formats(("jpeg", "png", "webp", "gif", "bmp"))
MIB = 1 << 20
TEXT = "a" * (PNG_TEXT_CHUNK_LIMIT - 4096)  # within Pillow's 1 MiB a text chunk


def _saved(fmt: str, mode: str = "RGB", **save: Any) -> bytes:
    """A 16x16 image Pillow writes, with the metadata `save` gives it."""
    out = io.BytesIO()
    Image.new(mode, (16, 16), (10, 20, 30) if mode == "RGB" else 7).save(out, fmt, **save)
    return out.getvalue()


def _png_info(**entries: tuple[str, bool]) -> PngImagePlugin.PngInfo:
    """PNG text entries as Pillow writes them: (text, compressed) per key; iTXt for non-latin-1 text."""
    info = PngImagePlugin.PngInfo()
    for key, (text, compressed) in entries.items():
        if text.isascii():
            info.add_text(key, text, zip=compressed)
        else:
            info.add_itxt(key, text, zip=compressed)
    return info


def _gif_after_empty_extension(runs: int) -> bytes:
    """A GIF whose comments only Pillow's way of reading finds. After an empty graphic control extension, Pillow
    reads one sub-block more: the 0x21 that follows, as a size of 33. Read block by block, that 0x21 starts an
    application extension of `runs` 255-byte sub-blocks; Pillow's read of 33 bytes ends inside the first, at a
    zero it takes for the end of the extension, and from there it reads the sub-blocks' content as blocks: a
    comment extension of 84 sub-blocks in each (the size byte of the next, 0xFF, it passes over as a stray byte).
    """
    data = image_bytes(16, 16, "GIF")
    flags = data[10]
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)

    def comment(sub_blocks: int, size: int) -> bytes:
        return (b"\x21\xfe" + b"\x02ab" * sub_blocks + b"\x00").ljust(size, b"\x01")  # 0x01: a stray byte

    first = b"x" * 31 + b"\x00" + comment(73, 255 - 32)
    rest = b"".join(b"\xff" + comment(84, 255) for _ in range(runs - 1))
    extension = b"\x21\xff\xff" + first + rest + b"\x00"
    return data[:at] + b"\x21\xf9\x00" + extension + data[at:]


# Each case: the file, and the file of the same format without the metadata that its cost is measured from.
CASES: dict[str, Callable[[], bytes]] = {
    "png zTXt before the image data": lambda: png_text_bomb(8, before_idat=True),
    "png zTXt after the image data": lambda: png_text_bomb(8, before_idat=False),
    "png zTXt, Pillow's own": lambda: _saved("PNG", pnginfo=_png_info(a=(TEXT, True), b=(TEXT, True))),
    "png tEXt, many small": lambda: png_with_chunks(
        [png_chunk(b"tEXt", f"key{index}".encode() + b"\0value") for index in range(2000)], before_idat=True
    ),
    "png tEXt, read in blocks": lambda: _saved("PNG", pnginfo=_png_info(a=("b" * (2 * MIB), False))),
    "png tEXt exif": lambda: png_with_chunks([png_chunk(b"tEXt", b"exif\0" + b"e" * MIB)], before_idat=False),
    "png iTXt ascii": lambda: png_with_chunks([itxt(f"k{index}", TEXT) for index in range(3)], before_idat=True),
    "png iTXt ascii and one emoji": lambda: png_with_chunks(
        [itxt(f"k{index}", TEXT[:-8] + "\U0001f600") for index in range(3)], before_idat=False
    ),
    "png iTXt CJK, Pillow's own": lambda: _saved("PNG", pnginfo=_png_info(a=("\u4e00" * 300_000, True))),
    "png iTXt uncompressed": lambda: png_with_chunks(
        [itxt("k", "a" * MIB + "\u0101", compressed=False)], before_idat=True
    ),
    "png tEXt, long keys": lambda: png_with_chunks(
        [png_chunk(b"tEXt", b"k" * 100_000 + str(index).encode() + b"\0v") for index in range(20)], before_idat=True
    ),
    "png iTXt, long language tags": lambda: png_with_chunks(
        [
            png_chunk(b"iTXt", f"k{index}".encode() + b"\0\0\0" + b"l" * 50_000 + b"\0" + b"t" * 50_000 + b"\0v")
            for index in range(20)
        ],
        before_idat=False,
    ),
    "png iTXt XMP": lambda: png_with_chunks([itxt("XML:com.adobe.xmp", TEXT)], before_idat=True),
    "png iCCP, Pillow's own": lambda: _saved("PNG", icc_profile=b"p" * (PNG_TEXT_CHUNK_LIMIT - 4096)),
    "png eXIf, Pillow's own": lambda: _saved("PNG", exif=b"Exif\0\0" + b"e" * (2 * MIB)),
    "png private chunk": lambda: png_with_chunks([png_chunk(b"prVt", b"p" * (2 * MIB))], before_idat=True),
    "png unknown chunk, read whole": lambda: png_with_chunks([png_chunk(b"uNKN", b"u" * (2 * MIB))], before_idat=True),
    "png private chunks, many": lambda: png_with_chunks([png_chunk(b"prVt", b"")] * 4000, before_idat=False),
    "jpeg COM": lambda: jpeg_with_segments([jpeg_segment(0xFE, b"c" * 60_000)] * 20),
    "jpeg APP5": lambda: jpeg_with_segments([jpeg_segment(0xE5, b"c" * 60_000)] * 20),
    "jpeg EXIF of many tags": lambda: jpeg_with_segments([jpeg_segment(0xE1, exif_segment_payload(5000))]),
    "jpeg EXIF in many segments": lambda: jpeg_with_segments(
        [jpeg_segment(0xE1, exif_segment_payload(5000))] + [jpeg_segment(0xE1, b"Exif\0\0" + b"x" * 65_000)] * 20
    ),
    "jpeg EXIF, Pillow's own": lambda: _saved("JPEG", exif=exif_segment_payload(200)),
    "jpeg ICC profile, Pillow's own": lambda: _saved("JPEG", icc_profile=b"i" * (2 * MIB)),
    "jpeg XMP": lambda: jpeg_with_segments(
        [jpeg_segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0" + b"x" * 60_000)] * 20
    ),
    "jpeg comment and XMP, Pillow's own": lambda: _saved("JPEG", comment=b"c" * 60_000, xmp=b"x" * 60_000),
    "jpeg Photoshop resources": lambda: jpeg_with_segments([jpeg_segment(0xED, photoshop_segment_payload(4000))]),
    "jpeg MPF": lambda: jpeg_with_segments([jpeg_segment(0xE2, mpf_segment_payload(3900))]),
    # Pillow reads on past an EOI before the frame: libjpeg's way of finding segments would stop there.
    "jpeg segments after an early EOI": lambda: (
        (plain := image_bytes(16, 16, "JPEG"))[:2] + b"\xff\xd9" + jpeg_segment(0xFE, b"c" * 60_000) * 20 + plain[2:]
    ),
    "gif comment of 2-byte sub-blocks": lambda: gif_with_comment([b"ab"] * 100_000),
    "gif comment of 1-byte sub-blocks": lambda: gif_with_comment([b"a"] * 100_000),
    "gif comment of 255-byte sub-blocks": lambda: gif_with_comment([b"c" * 255] * 4000),
    "gif comment, Pillow's own": lambda: _saved("GIF", "P", comment=b"c" * 500_000),
    "gif comment only Pillow's reading finds": lambda: _gif_after_empty_extension(700),
    "webp ICC, EXIF and XMP, Pillow's own": lambda: _saved(
        "WEBP", icc_profile=b"i" * MIB, exif=b"Exif\0\0" + b"e" * MIB, xmp=b"x" * MIB
    ),
}
PLAIN = {
    "png": lambda: png_with_chunks([], before_idat=True),
    "jpeg": lambda: image_bytes(16, 16, "JPEG"),
    "gif": lambda: image_bytes(16, 16, "GIF"),
    "webp": lambda: _saved("WEBP"),
}
# What the loader allocates that is no metadata and grows with the file: Pillow's `ImageFile.load` holds what a
# JPEG's decoder has not taken with its next 64 KiB read; a WebP's file is read into a copy that libwebp keeps
# (`ImageHeader.decoder_bytes` charges it).
NOT_METADATA: dict[str, Callable[[bytes], int]] = {
    "png": lambda data: 0,
    "jpeg": lambda data: 2 * 65536,
    "gif": lambda data: 0,
    "webp": len,
}
# The charge is exact where Pillow's allocations are known from the file; where it is a bound it may be above
# them: an MPF segment's entries (its tags' values counted as if every byte were unpacked), text outside latin-1
# (2 bytes a character counted for 3 bytes of UTF-8), Photoshop resources and the tiny entries' dict slots.
CHARGE_OVER_COST = 2.5


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return {case: make() for case, make in CASES.items()} | {f"{fmt} plain": make() for fmt, make in PLAIN.items()}


# Files the loader refuses after it opened them (libjpeg refuses a frame after an EOI): what it allocated first.
REFUSED_AT_LOAD = {"jpeg segments after an early EOI"}


@pytest.fixture(scope="module")
def costs(files: dict[str, bytes]) -> dict[str, int]:
    """Per case, what loading it allocated beyond loading the plain file of its format."""
    loads = traced_peaks(files)
    assert {case for case, load in loads.items() if load.failed} == REFUSED_AT_LOAD
    return {case: loads[case].traced_peak - loads[f"{case.split()[0]} plain"].traced_peak for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_the_charge_covers_what_the_loader_allocates_for_the_metadata(
    case: str, files: dict[str, bytes], costs: dict[str, int]
) -> None:
    data = files[case]
    charge = read_header(data, formats=FORMATS, max_pixels=None, locator=case).metadata_bytes
    cost = costs[case]
    said = f"charged {charge:,}, the loader allocated {cost:,} ({charge / cost:.2f}x)"
    assert charge + NOT_METADATA[case.split()[0]](data) >= cost, said
    assert charge <= CHARGE_OVER_COST * cost, said


def test_what_every_file_has_is_not_charged(files: dict[str, bytes]) -> None:
    """A PNG's IHDR, a JPEG's JFIF segment, as Pillow writes them: no metadata (the plain files' loads are what
    the cases are measured from)."""
    charges = {fmt: read_header(files[f"{fmt} plain"], formats=FORMATS, max_pixels=None, locator="x") for fmt in PLAIN}
    assert {fmt: header.metadata_bytes for fmt, header in charges.items()} == dict.fromkeys(PLAIN, 0)


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("before_idat", [True, False])
def test_past_its_limit_an_images_metadata_is_refused_having_inflated_a_piece_at_a_time(before_idat: bool) -> None:
    """64 chunks of about 1 MiB of text each (64 MiB in all, about 68 KB of file): refused as soon as the walk
    has counted the limit, holding a piece of the inflated text at a time."""
    bomb = png_text_bomb(64, before_idat=before_idat)
    tracemalloc.start()
    try:
        with pytest.raises(RequestTooLarge) as raised:
            measure(bomb, formats=FORMATS, max_bytes=16 * MIB, locator="messages[0].content[1]")
        with_limit = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        unlimited = measure(bomb, formats=FORMATS, max_bytes=None, locator="x")
        without_limit = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert raised.value.reason == "image_metadata_too_large"
    message = raised.value.message
    assert message.startswith(
        "messages[0].content[1]: the image's metadata (PNG zTXt chunks) costs its loader at least"
    )
    assert message.endswith(f"over {METADATA_KNOB}=16,777,216")
    assert unlimited.nbytes > 64 * MIB
    assert (with_limit, without_limit) < (512 << 10, 512 << 10)


@pytest.mark.parametrize("before_idat", [True, False])
def test_a_text_chunk_pillow_refuses_is_400_before_it_is_inflated_past_pillows_limit(before_idat: bool) -> None:
    """A zTXt chunk inflating past Pillow's MAX_TEXT_CHUNK, or compressed by an unknown method: Pillow refuses the
    file, at open or at load; so does the walk, having inflated at most that limit."""
    too_long = png_with_chunks([ztxt("k", b"a" * (2 * PNG_TEXT_CHUNK_LIMIT))], before_idat=before_idat)
    unknown_method = png_with_chunks([png_chunk(b"zTXt", b"k\0\1" + zlib.compress(b"a"))], before_idat=before_idat)
    for data in (too_long, unknown_method):
        with pytest.raises((ValueError, SyntaxError, UnidentifiedImageError)):
            Image.open(io.BytesIO(data)).load()
    with pytest.raises(
        BadRequest, match=r"x: PNG zTXt chunk inflates past 1,048,576 bytes, more than the image loader"
    ):
        measure(too_long, formats=FORMATS, max_bytes=None, locator="x")
    with pytest.raises(BadRequest, match="x: PNG zTXt chunk with compression method 1, which the image loader refuses"):
        measure(unknown_method, formats=FORMATS, max_bytes=None, locator="x")


# --- hidden from the gateway's open ------------------------------------------------------------------------------


def _photo(fmt: str, **save: Any) -> bytes:
    """A 64x48 image of noise with the metadata `save` gives it."""
    pixels = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    image = Image.fromarray(pixels)
    (image.convert("P") if fmt == "GIF" else image).save(out, fmt, **save)
    return out.getvalue()


# Images whose metadata costs the loader more than `image_metadata` leaves for the gateway's open to read.
HIDDEN_CASES = {
    "png text, ICC, EXIF": lambda: _photo(
        "PNG",
        pnginfo=_png_info(a=("x" * 300_000, True), b=("\u4e00" * 100, True)),
        icc_profile=b"p" * 5000,
        exif=b"e" * 99,
    ),
    "png text after the image data": lambda: png_with_chunks([ztxt("k", b"t" * 300_000)], before_idat=False, side=64),
    "jpeg EXIF, ICC, comment, XMP": lambda: _photo(
        "JPEG", exif=exif_segment_payload(20), icc_profile=b"i" * 200_000, comment=b"c" * 500, xmp=b"x" * 500
    ),
    "jpeg progressive with EXIF": lambda: _photo("JPEG", exif=exif_segment_payload(5000), progressive=True),
    "mpo": lambda: jpeg_with_segments(
        [jpeg_segment(0xE2, mpf_segment_payload(2))] + [jpeg_segment(0xFE, b"c" * 60_000)] * 5, side=64
    ),
    "gif comment": lambda: _photo("GIF", comment=b"c" * 300_000),
    "gif comment only Pillow's reading finds": lambda: _gif_after_empty_extension(40),
}


@pytest.mark.parametrize("case", list(HIDDEN_CASES))
def test_the_gateways_open_sees_no_metadata_and_decodes_the_same_pixels(case: str) -> None:
    data = HIDDEN_CASES[case]()
    with Image.open(io.BytesIO(data)) as loaded:
        loaded.load()
        keys = set(loaded.info)
        plain = loaded.convert("RGB")
    opened = open_image(data, formats=FORMATS, max_pixels=None, locator="x")
    header = opened.header
    decoded = decode_opened(opened, locator="x")
    assert (header.width, header.height) == plain.size
    assert decoded.tobytes() == plain.tobytes()
    metadata = {"comment", "exif", "icc_profile", "xmp", "mp", "a", "b", "k"}
    assert keys & metadata  # Pillow's own open reads it
    assert not set(decoded.info) & metadata  # the gateway's never did
    assert header.metadata_bytes > 0


def test_a_header_read_from_a_files_first_bytes_counts_a_pngs_chunks_to_its_end() -> None:
    """The probe reads a header from an item's first bytes (`whole`: the item): a PNG's chunks after its image
    data count too."""
    data = png_with_chunks([ztxt(f"k{index}", TEXT.encode()) for index in range(4)], before_idat=False, side=256)
    head = data[: data.index(b"IDAT") + 64]
    alone = read_header(head, formats=FORMATS, max_pixels=None, locator="x")
    with_whole = read_header(head, formats=FORMATS, max_pixels=None, locator="x", whole=io.BytesIO(data))
    assert alone.metadata_bytes < 1024  # the few chunks before the image data
    assert with_whole.metadata_bytes == read_header(data, formats=FORMATS, max_pixels=None, locator="x").metadata_bytes
    assert with_whole.metadata_bytes > 4 * len(TEXT)
    assert decode_rgb(data, formats=FORMATS, locator="x").size == (256, 256)


def test_a_little_metadata_is_left_for_the_gateways_open_and_charged_all_the_same() -> None:
    """Hiding metadata costs the open time on every read; what costs less than 256 KiB is read as it is."""
    data = _photo("JPEG", exif=exif_segment_payload(20), comment=b"c" * 500)
    opened = open_image(data, formats=FORMATS, max_pixels=None, locator="x")
    assert opened.source.hidden is None
    assert 500 < opened.header.metadata_bytes < 256 << 10
    assert decode_opened(opened, locator="x").info["comment"] == b"c" * 500


def _gif_with_junk(count: int) -> bytes:
    """A GIF with `count` bytes before its first image that Pillow's open skips one at a time."""
    data = _saved("GIF")
    image = data.index(b",", 13)  # the image descriptor
    return data[:image] + b"\x00" * count + data[image:]


@pytest.mark.parametrize(
    ("case", "make", "what"),
    [
        ("PNG", lambda count: png_with_chunks([png_chunk(b"abCd", b"")] * count, before_idat=True), "PNG chunks"),
        (
            "PNG, after the image data",
            lambda count: png_with_chunks([png_chunk(b"abCd", b"")] * count, before_idat=False),
            "PNG chunks",
        ),
        ("JPEG", lambda count: jpeg_with_segments([jpeg_segment(0xFE, b"")] * count), "JPEG segments"),
        ("GIF", _gif_with_junk, "GIF blocks"),
    ],
)
def test_a_file_of_more_chunks_than_any_encoder_writes_is_400_before_a_loader_walks_them(
    case: str, make: Callable[[int], bytes], what: str
) -> None:
    """Millions of empty chunks (or bytes a GIF loader skips one at a time) cost the walk, and the server's loader,
    seconds of Python for a few MiB; past MAX_WALK_STEPS the file is refused, having walked no more than that."""
    from gateway.media.image.metadata import MAX_WALK_STEPS

    within = make(MAX_WALK_STEPS // 2)
    assert read_header(within, formats=FORMATS, max_pixels=None, locator="x").metadata_bytes >= 0
    with pytest.raises(BadRequest, match=f"more than {MAX_WALK_STEPS:,} {what}"):
        read_header(make(2 * MAX_WALK_STEPS), formats=FORMATS, max_pixels=None, locator="x")
