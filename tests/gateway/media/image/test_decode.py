from __future__ import annotations

import io
import struct
import threading
import time
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.image import decode as image_decode
from gateway.media.image.decode import (
    decode_opened,
    decode_rgb,
    open_image,
    pil_formats,
    read_header,
    to_rgb,
)
from gateway.media.image.jpeg_markers import SOS, count_scans, segments
from gateway.media.threads import DecodeCancelled, DecodeControl
from processor_geometry import QWEN2_VL, resize_for_model, rgb
from tests.gateway.media.resident_peaks import resident_peaks
from tests.gateway.media_factory import image_bytes, jpeg_header_claiming, png_text_bomb, scan_bomb

FORMATS = pil_formats(("jpeg", "png", "webp", "gif", "bmp"))


@pytest.fixture
def pixel_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The format of every image whose pixels Pillow starts to decode (`ImageFile.load`), in order."""
    loads: list[str] = []
    original = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile) -> Any:
        loads.append(self.format or "")
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return loads


@dataclass
class Read:
    """One read a decode made of its input."""

    cancelled: bool
    """The decode's control was cancelled when the read began."""
    got: int | None = None
    """Bytes the read returned; None when it raised (the control stopped the decode)."""


class DecodeReads:
    """The reads decodes make of their input once their control is set (the header's reads come before it);
    `reading` is set once a decode has read its first chunk."""

    def __init__(self) -> None:
        self.reads: list[Read] = []
        self.reading = threading.Event()


@pytest.fixture
def decode_reads(monkeypatch: pytest.MonkeyPatch) -> DecodeReads:
    recorded = DecodeReads()

    class RecordingInput(image_decode._ControlledInput):
        def read(self, size: int | None = -1, /) -> bytes:
            control = self.control
            if control is None:
                return super().read(size)
            read = Read(cancelled=control.cancelled)
            recorded.reads.append(read)
            data = super().read(size)
            read.got = len(data)
            recorded.reading.set()
            return data

    monkeypatch.setattr(image_decode, "_ControlledInput", RecordingInput)
    return recorded


def test_header_gives_format_size_and_predicted_bytes() -> None:
    header = read_header(image_bytes(320, 200), formats=FORMATS, max_pixels=None, locator="x")
    assert (header.format, header.width, header.height) == ("jpeg", 320, 200)
    assert header.rgb_bytes == 320 * 200 * 3
    # Pillow holds RGB in 4 bytes a pixel; a baseline JPEG decodes straight into it.
    assert header.decode_bytes == 320 * 200 * 4


def test_header_over_pixel_limit_is_413_without_decoding(pixel_loads: list[str]) -> None:
    bomb = jpeg_header_claiming(40000, 40000)
    with pytest.raises(RequestTooLarge) as raised:
        read_header(bomb, formats=FORMATS, max_pixels=178_956_970, locator="messages[0].content[1]")
    assert pixel_loads == []  # refused from the header: no pixel was decoded
    assert raised.value.message == (
        "messages[0].content[1]: image is 40000x40000 = 1,600,000,000 pixels, over limits.max_image_pixels=178,956,970"
    )


def test_webp_canvas_is_checked_before_libwebp_allocates_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Opening a WebP creates libwebp's decoder, which allocates two canvases of the size the header claims.
    from PIL import _webp

    def refuse(*args: Any) -> None:
        raise AssertionError("libwebp's decoder was created before the pixel limit was checked")

    small = image_bytes(16, 16, fmt="WEBP", mode="RGBA")  # alpha: a VP8X file
    assert small[12:16] == b"VP8X"
    huge = bytearray(small)
    huge[24:27] = (16383 - 1).to_bytes(3, "little")
    huge[27:30] = (16383 - 1).to_bytes(3, "little")
    monkeypatch.setattr(_webp, "WebPAnimDecoder", refuse)
    with pytest.raises(RequestTooLarge, match=r"x: image is 16383x16383 = 268,402,689 pixels, over"):
        read_header(bytes(huge), formats=FORMATS, max_pixels=178_956_970, locator="x")
    lossless = image_bytes(4000, 1, fmt="WEBP", lossless=True)
    with pytest.raises(RequestTooLarge, match=r"image is 4000x1 = 4,000 pixels"):
        read_header(lossless, formats=FORMATS, max_pixels=3999, locator="x")


def test_disallowed_format_is_400() -> None:
    tiff = image_bytes(8, 8, fmt="TIFF")
    with pytest.raises(BadRequest, match=r"not an image in an accepted format \(media.formats: jpeg, png"):
        read_header(tiff, formats=FORMATS, max_pixels=None, locator="x")
    assert read_header(tiff, formats=pil_formats(("tiff",)), max_pixels=None, locator="x").format == "tiff"


def test_not_an_image_is_400() -> None:
    with pytest.raises(BadRequest, match="not an image"):
        read_header(b"hello, world", formats=FORMATS, max_pixels=None, locator="x")


def test_truncated_jpeg_is_400_on_decode() -> None:
    data = image_bytes(256, 256)
    truncated = data[: len(data) // 2]
    read_header(truncated, formats=FORMATS, max_pixels=None, locator="x")  # the header itself is intact
    with pytest.raises(BadRequest, match="x: image cannot be decoded"):
        decode_rgb(truncated, formats=FORMATS, locator="x")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
def test_an_opened_image_decodes_from_its_header_read_once(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = image_bytes(40, 30, fmt=fmt)
    opens: list[object] = []
    original_open = Image.open

    def counting_open(*args: Any, **kwargs: Any) -> Image.Image:
        opens.append(args[0])
        return original_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    opened = open_image(data, formats=FORMATS, max_pixels=None, locator="x")
    assert opened.header == read_header(data, formats=FORMATS, max_pixels=None, locator="x")
    del opens[1:]  # read_header's own
    image = decode_opened(opened, locator="x", control=DecodeControl(None))
    assert (image.mode, image.size) == ("RGB", (40, 30))
    assert len(opens) == 1
    with pytest.raises(RuntimeError, match="already decoded or closed"):
        opened.take()  # the opened image is let go of once decoded
    opened.close()


@pytest.mark.parametrize(
    "data",
    [image_bytes(64, 48), image_bytes(64, 48, progressive=True), image_bytes(64, 48, mode="CMYK")],
    ids=["baseline", "progressive", "cmyk"],
)
def test_an_image_opened_from_its_head_decodes_the_whole_file_once_extended_to_it(data: bytes) -> None:
    scan = next(segment for segment in segments(data) if segment.marker == SOS)
    opened = open_image(data[: scan.end], formats=FORMATS, max_pixels=None, locator="x")
    assert opened.header == read_header(data, formats=FORMATS, max_pixels=None, locator="x")
    with pytest.raises(ValueError, match="do not start the file"):
        opened.extend_to(bytes(len(data)))
    opened.extend_to(data)
    assert opened.data is data
    image = decode_opened(opened, locator="x")
    assert image.tobytes() == decode_rgb(data, formats=FORMATS, locator="x").tobytes()


def test_an_opened_image_over_max_pixels_is_refused_and_a_closed_one_never_decodes() -> None:
    with pytest.raises(RequestTooLarge, match=r"over limits\.max_image_pixels=1,199"):
        open_image(image_bytes(40, 30), formats=FORMATS, max_pixels=1199, locator="x")
    with open_image(image_bytes(40, 30), formats=FORMATS, max_pixels=1200, locator="x") as opened:
        pass
    with pytest.raises(RuntimeError, match="already decoded or closed"):
        decode_opened(opened, locator="x")


@pytest.mark.parametrize(
    ("mode", "fmt"), [("RGBA", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("CMYK", "JPEG"), ("L", "JPEG"), ("RGB", "WEBP")]
)
def test_decode_converts_to_rgb(mode: str, fmt: str) -> None:
    image = decode_rgb(image_bytes(16, 12, fmt=fmt, mode=mode), formats=FORMATS, locator="x")
    assert image.mode == "RGB"
    assert image.size == (16, 12)


def test_transparent_pixels_become_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    assert decode_rgb(out.getvalue(), formats=FORMATS, locator="x").getpixel((0, 0)) == (255, 255, 255)


def test_unknown_format_in_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported formats"):
        pil_formats(("jpeg", "heic"))


# --- one RGB conversion rule ------------------------------------------------------------------------------


def _encoded(image: Image.Image, fmt: str, **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _conversion_cases() -> dict[str, tuple[Image.Image, bytes | None]]:
    """Images of every kind of mode a decoder gives, 56 x 56 (a size the Qwen2-VL resize keeps), with every
    alpha value present; the encoded form where a format carries the mode."""
    rng = np.random.default_rng(7)
    value = rng.integers(0, 256, (56, 56), dtype=np.uint8)
    alpha = np.arange(56 * 56, dtype=np.uint32).reshape(56, 56).astype(np.uint8)
    palette = rng.integers(0, 256, 768, dtype=np.uint8).tobytes()
    la = Image.frombytes("LA", (56, 56), np.stack([value, alpha], -1).tobytes())
    rgba = Image.fromarray(np.stack([value, 255 - value, value // 2, alpha], -1))
    paletted = Image.frombytes("P", (56, 56), value.tobytes())
    paletted.putpalette(palette)
    pa = paletted.convert("PA")
    pa.putalpha(Image.fromarray(alpha))
    cmyk = Image.frombytes("CMYK", (56, 56), np.stack([value, alpha, 255 - value, alpha // 2], -1).tobytes())
    wide = Image.fromarray(value.astype(np.uint16) * 257 + 3)
    assert wide.mode == "I;16"
    gray = Image.fromarray(value)
    transparent = paletted.copy()
    transparent.info["transparency"] = int(value[0, 0])
    return {
        "LA": (la, _encoded(la, "PNG")),
        "RGBA": (rgba, _encoded(rgba, "PNG")),
        "P+transparency": (transparent, _encoded(transparent, "PNG", transparency=int(value[0, 0]))),
        "P+transparency gif": (transparent, _encoded(transparent, "GIF", transparency=int(value[0, 0]))),
        "PA": (pa, None),  # no accepted format stores palette + alpha; Pillow makes it in memory
        "I;16": (wide, _encoded(wide, "PNG")),
        "L": (gray, _encoded(gray, "PNG")),
        "CMYK": (cmyk, _encoded(cmyk, "JPEG", quality=95)),
    }


@pytest.mark.parametrize("case", list(_conversion_cases()))
def test_gateway_and_engine_mode_convert_alike(case: str) -> None:
    image, encoded = _conversion_cases()[case]
    assert to_rgb is rgb.to_rgb  # the gateway's conversion is the engine-mode one
    if encoded is not None:
        decoded = decode_rgb(encoded, formats=FORMATS, locator="x")
        opened = Image.open(io.BytesIO(encoded))
        np.testing.assert_array_equal(np.asarray(decoded), resize_for_model(opened, QWEN2_VL), err_msg=case)
    np.testing.assert_array_equal(np.asarray(to_rgb(image)), resize_for_model(image, QWEN2_VL), err_msg=case)


def test_fully_transparent_grey_and_palette_pixels_become_white() -> None:
    # A grey+alpha PNG whose pixels are black and fully transparent used to decode black in the gateway.
    la = Image.new("LA", (8, 8), (0, 0))
    assert (np.asarray(decode_rgb(_encoded(la, "PNG"), formats=FORMATS, locator="x")) == 255).all()
    paletted = Image.new("P", (8, 8), 1)
    paletted.putpalette([10, 20, 30, 40, 50, 60])
    gif = _encoded(paletted, "GIF", transparency=1)
    assert (np.asarray(decode_rgb(gif, formats=FORMATS, locator="x")) == 255).all()


# --- what a decode allocates --------------------------------------------------------------------------------

PEAK_SIDE = 2000
# The measured peak may exceed the charge by 10% (the allocator's reuse of freed pages varies from run to run),
# and the charge may exceed the peak by 45%: a lossless WebP's charge counts its bitstream decoder's buffer, freed
# before the peak, in full (charged about 1.2 times the measured peak), and a progressive grey JPEG's counts its
# coefficients on top of the conversion, which the C heap keeps in the process in some runs (peak 7 bytes a pixel)
# and returns in others (down to 5: the grey image and its RGB conversion alone, measured when the decode follows a
# header read, as the gateway's does).
PEAK_OVER_CHARGE = 1.1
CHARGE_OVER_PEAK = 1.45


def _noise(side: int, bands: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A gradient with noise: encodes to realistic photo sizes, built fast from a tiled noise block."""
    rng = np.random.default_rng(seed)
    block = rng.integers(-48, 48, (256, 256, bands), dtype=np.int16)
    reps = -(-side // 256)
    noise = np.tile(block, (reps, reps, 1))[:side, :side]
    ramp = (np.arange(side, dtype=np.int16) * 200 // side)[None, :, None]
    pixels: np.ndarray[Any, np.dtype[np.uint8]] = np.clip(noise + ramp + 28, 0, 255).astype(np.uint8)
    return pixels


def _png(pixels: np.ndarray[Any, Any], color_type: int) -> bytes:
    """A PNG of 8- or 16-bit samples (Pillow writes no 16-bit RGB, RGBA or LA), filter 0, fast compression."""
    height, width = pixels.shape[:2]
    depth = 16 if pixels.dtype == np.uint16 else 8
    rows = pixels.astype(">u2" if depth == 16 else np.uint8).reshape(height, -1).view(np.uint8)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1).tobytes()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


def peak_cases(side: int) -> dict[str, tuple[bytes, str]]:
    """Every supported format and the modes its decoder gives: name -> (file, the mode Pillow decodes)."""
    color = _noise(side, 3, 1)
    alpha = _noise(side, 1, 2)[..., 0]
    alpha[: side // 2] = 255  # half opaque, half translucent
    rgb_image = Image.fromarray(color)
    rgba_image = Image.fromarray(np.dstack([color, alpha]))
    gray = Image.fromarray(color[..., 1])
    la_image = Image.frombytes("LA", gray.size, np.dstack([color[..., 1], alpha]).tobytes())
    paletted = Image.frombytes("P", gray.size, (color[..., 0] // 2 + color[..., 2] // 2).tobytes())
    paletted.putpalette(np.random.default_rng(3).integers(0, 256, 768, dtype=np.uint8).tobytes())
    wide = color.astype(np.uint16) * 257
    return {
        "jpeg baseline": (_encoded(rgb_image, "JPEG", quality=90), "RGB"),
        "jpeg progressive 4:4:4": (_encoded(rgb_image, "JPEG", quality=95, progressive=True, subsampling=0), "RGB"),
        "jpeg grey progressive": (_encoded(gray, "JPEG", quality=90, progressive=True), "L"),
        "jpeg cmyk progressive": (_encoded(rgb_image.convert("CMYK"), "JPEG", progressive=True), "CMYK"),
        "png rgb": (_encoded(rgb_image, "PNG", compress_level=1), "RGB"),
        "png rgba": (_encoded(rgba_image, "PNG", compress_level=1), "RGBA"),
        "png grey+alpha": (_encoded(la_image, "PNG", compress_level=1), "LA"),
        "png palette+transparency": (_encoded(paletted, "PNG", compress_level=1, transparency=7), "P"),
        "png 16-bit grey": (_png(wide[..., 0], 0), "I;16"),
        "png 16-bit rgba": (_png(np.dstack([wide, alpha.astype(np.uint16) * 257]), 6), "RGBA"),
        "webp lossy": (_encoded(rgb_image, "WEBP", quality=80, method=0), "RGB"),
        "webp lossy alpha": (_encoded(rgba_image, "WEBP", quality=80, method=0), "RGBA"),
        "webp lossless": (_encoded(rgb_image, "WEBP", lossless=True, quality=0, method=0), "RGB"),
        "webp lossless alpha": (_encoded(rgba_image, "WEBP", lossless=True, quality=0, method=0), "RGBA"),
        "gif": (_encoded(paletted, "GIF"), "P"),
        "gif transparency": (_encoded(paletted, "GIF", transparency=7), "P"),
        "bmp rgb": (_encoded(rgb_image, "BMP"), "RGB"),
        "bmp palette": (_encoded(paletted, "BMP"), "P"),
    }


def decode_for_peak(data: bytes, locator: str) -> str:
    """What the peak of a decode is measured on (`resident_peaks`): the mode it returns."""
    return decode_rgb(data, formats=FORMATS, locator=locator).mode


@pytest.fixture(scope="module")
def peaks() -> dict[str, dict[str, Any]]:
    measured = resident_peaks("tests.gateway.media.image.test_decode:decode_for_peak", PEAK_SIDE)
    results: dict[str, dict[str, Any]] = {}
    for case, (data, mode) in peak_cases(PEAK_SIDE).items():
        header = read_header(data, formats=FORMATS, max_pixels=None, locator=case)
        grown, rgb = measured[case]
        results[case] = {"peak": grown, "charge": header.decode_bytes, "mode": mode, "rgb": rgb}
    return results


@pytest.mark.parametrize("case", list(peak_cases(8)))
def test_decode_bytes_covers_the_measured_peak(case: str, peaks: dict[str, dict[str, Any]]) -> None:
    result = peaks[case]
    pixels = PEAK_SIDE * PEAK_SIDE
    per_pixel = f"peak {result['peak'] / pixels:.2f} B/px, charged {result['charge'] / pixels:.2f} B/px"
    assert (result["mode"], result["rgb"]) == (peak_cases(8)[case][1], "RGB")
    assert result["peak"] <= PEAK_OVER_CHARGE * result["charge"], per_pixel
    assert result["charge"] <= CHARGE_OVER_PEAK * result["peak"], per_pixel


def test_header_charges_a_progressive_jpegs_coefficients() -> None:
    rgb_image = Image.fromarray(_noise(100, 3, 0))
    baseline = read_header(_encoded(rgb_image, "JPEG"), formats=FORMATS, max_pixels=None, locator="x")
    assert baseline.decoder_bytes == 0
    progressive = _encoded(rgb_image, "JPEG", progressive=True)  # 4:2:0: 16x16 luma MCUs
    header = read_header(progressive, formats=FORMATS, max_pixels=None, locator="x")
    luma_blocks, chroma_blocks = 14 * 14, 7 * 7  # 100 px -> 13 blocks, rounded up to 14 (2 per MCU)
    assert header.decoder_bytes == (luma_blocks + 2 * chroma_blocks) * 64 * 2
    assert header.decode_bytes == 100 * 100 * 4 + header.decoder_bytes


def test_header_charges_coefficients_as_libjpeg_decides_from_the_first_scan() -> None:
    """A sequential JPEG is decoded through a whole-image coefficient buffer when its first scan holds fewer
    components than its frame; a first scan holding them all is decoded in one pass, whatever follows it."""
    rgb_image = Image.fromarray(_noise(100, 3, 0))
    baseline = _encoded(rgb_image, "JPEG")
    sos = baseline.find(b"\xff\xda")
    assert baseline[sos + 2 : sos + 5] == b"\x00\x0c\x03"  # length 12, three components
    # The first scan with the luma component alone: length 8, one (component, tables) pair, Ss Se AhAl.
    luma_first = baseline[:sos] + b"\xff\xda\x00\x08\x01" + baseline[sos + 5 : sos + 7] + baseline[sos + 11 :]
    header = read_header(luma_first, formats=FORMATS, max_pixels=None, locator="x")
    assert header.decoder_bytes == (14 * 14 + 2 * 7 * 7) * 64 * 2
    stray_scan = baseline[:-2] + baseline[sos : sos + 14] + baseline[-2:]
    assert count_scans(stray_scan) == 2
    assert read_header(stray_scan, formats=FORMATS, max_pixels=None, locator="x").decoder_bytes == 0


# --- decode time ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return scan_bomb(2048, 5000)  # about 8 s of decoding on a 2024 laptop core


def test_scan_bomb_is_refused_before_decoding(bomb: bytes, pixel_loads: list[str]) -> None:
    with pytest.raises(RequestTooLarge) as raised:
        decode_rgb(bomb, formats=FORMATS, locator="messages[0].content[2]", max_jpeg_scans=100)
    assert pixel_loads == []  # refused from its markers: no pixel was decoded
    assert raised.value.reason == "too_many_scans"
    assert raised.value.message == (
        "messages[0].content[2]: JPEG has at least 101 scans (counted from its markers), over media.max_jpeg_scans=100"
    )
    ordinary = _encoded(Image.fromarray(_noise(64, 3, 5)), "JPEG", progressive=True)
    assert decode_rgb(ordinary, formats=FORMATS, locator="x", max_jpeg_scans=10).size == (64, 64)
    assert pixel_loads == ["JPEG"]  # the ordinary one is decoded (and counted)


def test_decode_deadline_stops_the_scan_bomb(bomb: bytes, decode_reads: DecodeReads) -> None:
    control = DecodeControl(0.3)
    started = time.perf_counter()
    with pytest.raises(RequestTooLarge) as raised:
        decode_rgb(bomb, formats=FORMATS, locator="x", control=control, max_jpeg_scans=None)
    elapsed = time.perf_counter() - started
    assert elapsed >= 0.3, elapsed  # not before the deadline (a busy machine only makes it later)
    assert raised.value.reason == "decode_timeout"
    assert raised.value.message == "x: decoding the image took longer than media.decode_timeout_s=0.3"
    # Stopped by the read that found the deadline passed, part-way through the file: not a decode that ran to
    # its end and was refused afterwards.
    *served, last = decode_reads.reads
    assert last.got is None
    assert sum(read.got or 0 for read in served) < len(bomb)


def test_cancel_from_another_thread_stops_a_running_decode(bomb: bytes, decode_reads: DecodeReads) -> None:
    control = DecodeControl(None)
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(decode_rgb, bomb, formats=FORMATS, locator="x", control=control)
        assert decode_reads.reading.wait(30), "the decode never read its input"
        control.cancel()  # from this thread, while the pool's thread decodes
        with pytest.raises(DecodeCancelled):
            decoding.result(timeout=60)
    assert decoding.done()  # the decode's thread let go of it
    # The first read after the cancel raised: every read that returned bytes began before the cancel, and the
    # decode stopped part-way through the file.
    *served, last = decode_reads.reads
    assert last.got is None
    assert served
    assert all(read.got and not read.cancelled for read in served), served
    assert sum(read.got or 0 for read in served) < len(bomb)
    decode_reads.reads.clear()
    with pytest.raises(DecodeCancelled):  # a cancelled control stops a later decode at once
        decode_rgb(image_bytes(16, 16), formats=FORMATS, locator="x", control=control)
    assert decode_reads.reads == [Read(cancelled=True, got=None)]  # at its first read, before any byte


def test_the_deadline_starts_with_the_decode() -> None:
    control = DecodeControl(0.05)
    time.sleep(0.1)  # waiting for a worker thread does not count
    image = decode_rgb(image_bytes(64, 48), formats=FORMATS, locator="x", control=control)
    assert (image.mode, image.size) == ("RGB", (64, 48))


class CountingControl(DecodeControl):
    def __init__(self) -> None:
        super().__init__(None)
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        super().check()


@pytest.mark.parametrize(
    ("fmt", "save"),
    [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {"compress_level": 1}), ("GIF", {}), ("BMP", {})],
)
def test_the_control_is_checked_while_the_pixels_are_decoded(fmt: str, save: dict[str, Any]) -> None:
    image = Image.fromarray(_noise(600, 3, 9))
    data = _encoded(image if fmt != "GIF" else image.convert("P"), fmt, **save)
    control = CountingControl()
    decode_rgb(data, formats=FORMATS, locator="x", control=control)
    # Header parsing reads a few dozen times at most; the pixels are read in chunks of 1 KiB (JPEG) or 16 KiB.
    chunk = 1024 if fmt == "JPEG" else 16384
    assert control.checks >= len(data) // chunk > 10, (control.checks, len(data))


# --- metadata -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("before_idat", [True, False])
def test_the_gateways_header_read_and_decode_never_inflate_an_images_text(before_idat: bool) -> None:
    """A 68 KB PNG with 64 MiB of zTXt text, before or after its image data: its header charges what the model
    server's loader allocates for it, while the gateway's own header read and decode hold a chunk's compressed
    bytes at a time, never its text (Pillow inflated all of it, at open or at load, before)."""
    bomb = png_text_bomb(64, before_idat=before_idat)
    tracemalloc.start()
    try:
        header = read_header(bomb, formats=FORMATS, max_pixels=None, locator="x")
        decoded = decode_opened(open_image(bomb, formats=FORMATS, max_pixels=None, locator="x"), locator="x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert header.metadata_bytes > 64 * (1 << 20)
    assert header.decode_bytes == 16 * 16 * 4 + header.metadata_bytes
    assert decoded.size == (16, 16)
    assert peak < 1 << 20
