"""`media.decode: check`: what the structure check allocates against what is charged, and which truncated and
corrupt files it refuses compared with a full decode (the differences docs/admission.md lists)."""

from __future__ import annotations

import io
import itertools
import random
import struct
import time
import zlib
from functools import cache
from typing import Any

import pytest
from PIL import Image

from gateway.errors import BadRequest, GatewayError, RequestTooLarge
from gateway.media.image import decode as image_decode
from gateway.media.image import jpeg_markers
from gateway.media.image.check import (
    HERE_MAX_BYTES,
    HERE_MAX_SCAN_PIXELS,
    HERE_MAX_SEGMENTS,
    check_bytes,
    check_here,
    check_opened,
)
from gateway.media.image.decode import decode_opened, open_image, read_header
from gateway.media.image.jpeg_markers import EOI, SOS, segments, skeleton
from gateway.media.threads import DecodeControl
from tests.gateway.media.image.test_decode import (
    FORMATS,
    PEAK_OVER_CHARGE,
    PEAK_SIDE,
    _encoded,
    _noise,
    peak_cases,
)
from tests.gateway.media.resident_peaks import resident_peaks
from tests.gateway.media_factory import image_bytes, jpeg_header_claiming, scan_bomb

MAX_PIXELS = 178_956_970


def outcome(data: bytes, mode: str) -> int:
    """The status the gateway answers for an image in `mode` (200 when it passes), as `run_here` maps errors:
    "full", "check" (on a media thread), or "check here" (a request's only JPEG: `check_here`, and where it
    declines, `check_opened`)."""
    try:
        opened = open_image(data, formats=FORMATS, max_pixels=MAX_PIXELS, locator="x")
        if mode == "full":
            decode_opened(opened, locator="x", max_jpeg_scans=100)
        elif mode == "check" or not check_here(opened, locator="x", max_jpeg_scans=100):
            check_opened(opened, locator="x", max_jpeg_scans=100)
    except GatewayError as exc:
        return exc.status_code
    except MemoryError:
        return 413
    except Exception:
        return 400
    return 200


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (20, 10), (i * 40, 0, 0)) for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    return out.getvalue()


def _mpo() -> bytes:
    """Two pictures in one file: Pillow decodes the first, which ends at the first EOI."""
    pictures = [Image.fromarray(_noise(24, 3, seed)) for seed in (1, 2)]
    out = io.BytesIO()
    pictures[0].save(out, format="MPO", save_all=True, append_images=pictures[1:])
    return out.getvalue()


@cache
def samples() -> dict[str, bytes]:
    photo = Image.fromarray(_noise(96, 3, 4))
    return {
        "jpeg": image_bytes(40, 30),
        "jpeg progressive": image_bytes(40, 30, progressive=True),
        "jpeg grey": image_bytes(40, 30, mode="L"),
        "jpeg cmyk": image_bytes(24, 16, mode="CMYK"),
        "jpeg restart markers": _encoded(photo, "JPEG", restart_marker_rows=1),
        "jpeg mpo": _mpo(),
        "png": image_bytes(21, 10, "PNG"),
        "png palette": image_bytes(21, 10, "PNG", "P"),
        "png rgba": image_bytes(21, 10, "PNG", "RGBA"),
        "gif": image_bytes(21, 10, "GIF"),
        "gif animated": _animated_gif(),
        "webp": image_bytes(21, 10, "WEBP"),
        "webp lossless": image_bytes(21, 10, "WEBP", lossless=True),
        "webp alpha": image_bytes(21, 10, "WEBP", "RGBA"),
        "bmp": image_bytes(21, 10, "BMP"),
        "bmp palette": image_bytes(21, 10, "BMP", "P"),
        "bmp 1-bit": image_bytes(21, 10, "BMP", "1"),
        "bmp rgba": image_bytes(21, 10, "BMP", "RGBA"),
    }


def check_modes(name: str) -> tuple[str, ...]:
    """The check's modes for a sample: a JPEG's also on the calling thread."""
    return ("check", "check here") if name.startswith("jpeg") else ("check",)


def _truncations(name: str) -> list[tuple[int, int, int]]:
    data = samples()[name]
    return [
        (cut, outcome(data[:cut], "full"), outcome(data[:cut], mode))
        for cut in range(len(data))
        for mode in check_modes(name)
    ]


def _flips(name: str, count: int = 150) -> list[tuple[int, int]]:
    rng = random.Random(name)
    results = []
    for _ in range(count):
        flipped = bytearray(samples()[name])
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
        full = outcome(bytes(flipped), "full")
        results += [(full, outcome(bytes(flipped), mode)) for mode in check_modes(name)]
    return results


def test_every_sample_passes_every_mode() -> None:
    assert {
        name: {outcome(data, mode) for mode in ("full", *check_modes(name))} for name, data in samples().items()
    } == {name: {200} for name in samples()}


@pytest.mark.parametrize("name", [name for name in samples() if name.split()[0] in ("jpeg", "bmp", "webp")])
def test_truncated_jpeg_bmp_and_webp_are_refused_exactly_as_a_full_decode_refuses_them(name: str) -> None:
    results = _truncations(name)
    assert [(cut, full) for cut, full, check in results if full != check] == []
    # A cut almost always fails; an MPO's cuts past its first picture (the one decoded) pass in both modes.
    decoded = next(s.end for s in segments(samples()[name]) if s.marker == EOI) if name == "jpeg mpo" else None
    within = [full for cut, full, _ in results if decoded is None or cut < decoded]
    assert sum(full == 400 for full in within) > len(within) * 0.9


@pytest.mark.parametrize("name", [name for name in samples() if name.split()[0] in ("jpeg", "bmp")])
def test_corrupt_jpeg_and_bmp_are_refused_exactly_as_a_full_decode_refuses_them(name: str) -> None:
    results = _flips(name)
    assert [result for result in results if result[0] != result[1]] == []


def _entropy_coded(data: bytes) -> list[tuple[int, int]]:
    """Where each scan's entropy-coded data lies: from the end of its header to the next marker."""
    found = list(segments(data))
    return [(scan.end, after.start) for scan, after in itertools.pairwise(found) if scan.marker == SOS]


@cache
def dense_jpegs() -> dict[str, bytes]:
    """Noise at 64x48, where entropy-coded data is most of the file."""
    photo = Image.fromarray(_noise(64, 3, 9)).resize((64, 48))
    return {
        "baseline": _encoded(photo, "JPEG"),
        "progressive": _encoded(photo, "JPEG", progressive=True),
        "restarts": _encoded(photo, "JPEG", restart_marker_rows=1),
        "progressive restarts": _encoded(photo, "JPEG", progressive=True, restart_marker_blocks=3),
    }


@pytest.mark.parametrize("name", list(dense_jpegs()))
def test_jpeg_entropy_coded_damage_and_markers_in_it_are_judged_exactly_as_a_full_decode(name: str) -> None:
    """The check decodes the file without its entropy-coded data: flipped bytes in that data, and markers of
    every kind put into it, must still be passed or refused as a full decode passes or refuses them."""
    data = dense_jpegs()[name]
    rng = random.Random(name)
    cases = []
    for _ in range(150):
        flipped = bytearray(data)
        start, end = rng.choice(_entropy_coded(data))
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(start, end)] ^= rng.randrange(1, 256)
        cases.append(bytes(flipped))
    for marker in range(1, 255):
        start, end = rng.choice(_entropy_coded(data))
        at = rng.randrange(start, end)
        cases.append(data[:at] + bytes([0xFF, marker]) + data[at:])
    results = [(outcome(case, "full"), outcome(case, mode)) for case in cases for mode in ("check", "check here")]
    assert [(index, full, check) for index, (full, check) in enumerate(results) if full != check] == []
    assert sum(full == 400 for full, _ in results) > 2 * 50  # markers in the data do get refused


def test_a_jpeg_check_reads_the_files_segments_and_none_of_its_entropy_coded_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _encoded(Image.fromarray(_noise(256, 3, 4)), "JPEG", quality=95)
    read: list[int] = []
    real_read = image_decode._ControlledInput.read

    def counted(self: Any, size: int | None = -1, /) -> bytes:
        chunk = real_read(self, size)
        read.append(len(chunk))
        return chunk

    opened = open_image(data, formats=FORMATS, max_pixels=MAX_PIXELS, locator="x")
    monkeypatch.setattr(image_decode._ControlledInput, "read", counted)
    check_opened(opened, locator="x", max_jpeg_scans=100)
    kept = skeleton(data)
    assert kept is not None
    assert sum(read) == len(kept) < len(data) // 50


@pytest.mark.parametrize("name", ["png", "png palette", "png rgba"])
def test_a_png_check_refuses_every_cut_a_full_decode_refuses_and_cuts_past_the_pixel_data(name: str) -> None:
    """A full decode stops once it has the pixels: a cut in the zlib checksum, the last CRC or IEND still
    decodes. The check walks to IEND: it refuses those cuts as well."""
    results = _truncations(name)
    size = len(samples()[name])
    assert all(check == 400 for _, _, check in results)
    passed_full = [cut for cut, full, _ in results if full == 200]
    assert passed_full == list(range(size - 20, size))  # adler32 (4) + the IDAT's CRC (4) + IEND (12)
    # A flipped byte fails its chunk's CRC: whatever a full decode refuses, the check refuses.
    assert [result for result in _flips(name) if result[0] != 200 and result[1] == 200] == []


@pytest.mark.parametrize("name", ["gif", "gif animated"])
def test_a_gif_check_refuses_every_cut_a_full_decode_refuses(name: str) -> None:
    """The check walks the first image's data blocks to their terminator; a full decode stops at the LZW end
    code, one byte before it: that cut decodes and is refused by the check."""
    results = _truncations(name)
    assert [cut for cut, full, check in results if full != 200 and check == 200] == []
    differ = [cut for cut, full, check in results if full != check]
    assert len(differ) == 1
    assert samples()[name][differ[0]] == 0  # the terminator the cut leaves out


def test_corrupt_pixel_data_a_walk_cannot_see_is_refused_only_by_a_full_decode() -> None:
    """What docs/admission.md says check passes: LZW and WebP bitstream damage that only decoding finds."""
    differences = {name: _flips(name) for name in ("gif", "webp lossless")}
    for name, results in differences.items():
        assert any(full == 400 and check == 200 for full, check in results), name


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_png_chunk_past_the_end_or_with_a_bad_crc_is_400_naming_the_item() -> None:
    png = image_bytes(8, 8, "PNG")
    iend = png.rindex(b"IEND") - 4
    past_end = png[:iend] + struct.pack(">I", 1000) + b"tEXt" + b"k\x00v" + png[iend:]
    opened = open_image(past_end, formats=FORMATS, max_pixels=None, locator="messages[0].content[1]")
    with pytest.raises(BadRequest) as raised:
        check_opened(opened, locator="messages[0].content[1]")
    assert raised.value.message == (
        f"messages[0].content[1]: image structure cannot be trusted (PNG chunk 'tEXt' at byte {iend:,} runs past "
        f"the end of the data ({len(past_end):,} bytes))"
    )
    bad_crc = png[:iend] + _png_chunk(b"tEXt", b"k\x00v")[:-1] + b"\x00" + png[iend:]
    with pytest.raises(BadRequest, match=r"x: image structure cannot be trusted \(PNG chunk 'tEXt' at byte \d+ fails"):
        check_opened(open_image(bad_crc, formats=FORMATS, max_pixels=None, locator="x"), locator="x")
    # A full decode reads the chunk after the pixels too (a 400 for the one cut short) but checks no CRC there.
    assert (outcome(past_end, "full"), outcome(bad_crc, "full")) == (400, 200)


def test_png_with_a_valid_crc_over_a_corrupt_zlib_stream_passes_the_check_only() -> None:
    png = image_bytes(8, 8, "PNG")
    start = png.index(b"IDAT") - 4
    length = int.from_bytes(png[start : start + 4], "big")
    body = bytearray(png[start + 8 : start + 8 + length])
    body[2:] = bytes(byte ^ 0x5A for byte in body[2:])  # the zlib header kept, the deflate data garbled
    garbled = png[:start] + _png_chunk(b"IDAT", bytes(body)) + png[start + 12 + length :]
    assert (outcome(garbled, "full"), outcome(garbled, "check")) == (400, 200)


def test_webp_whose_bitstream_disagrees_with_its_container_is_400() -> None:
    from gateway.media.image.check import _walk_webp

    webp = image_bytes(16, 12, "WEBP")
    header = read_header(webp, formats=FORMATS, max_pixels=None, locator="x")
    claimed = type(header)(format="webp", width=20, height=12, mode="RGB")
    with pytest.raises(BadRequest, match=r"x: image structure cannot be trusted \(WebP container says 20x12, its "):
        _walk_webp(webp, claimed, "x")
    riff_past_end = webp[:4] + struct.pack("<I", len(webp)) + webp[8:]
    with pytest.raises(BadRequest, match=r"RIFF size [\d,]+ runs past the end of the data"):
        _walk_webp(riff_past_end, header, "x")


def test_the_scan_limit_and_the_deadline_hold_in_check_mode() -> None:
    bomb = scan_bomb(2048, 5000)
    assert skeleton(bomb) is not None  # both hold where the skeleton is decoded
    with pytest.raises(RequestTooLarge) as raised:
        check_opened(open_image(bomb, formats=FORMATS, max_pixels=None, locator="x"), locator="x", max_jpeg_scans=100)
    assert raised.value.reason == "too_many_scans"
    assert raised.value.message.endswith("over media.max_jpeg_scans=100")
    started = time.perf_counter()
    with pytest.raises(RequestTooLarge) as timed_out:
        check_opened(
            open_image(bomb, formats=FORMATS, max_pixels=None, locator="x"), locator="x", control=DecodeControl(0.3)
        )
    assert time.perf_counter() - started >= 0.3
    assert timed_out.value.reason == "decode_timeout"
    assert timed_out.value.message == "x: checking the image took longer than media.decode_timeout_s=0.3"


def _with_comments(data: bytes, count: int) -> bytes:
    """The JPEG with `count` empty comment segments between its last scan and its EOI."""
    return data[:-2] + b"\xff\xfe\x00\x02" * count + data[-2:]


@pytest.mark.parametrize(
    ("case", "data", "here"),
    [
        ("baseline", image_bytes(320, 240), True),
        ("at HERE_MAX_SEGMENTS", _with_comments(image_bytes(32, 32), HERE_MAX_SEGMENTS - 10), True),
        ("past HERE_MAX_SEGMENTS", _with_comments(image_bytes(32, 32), HERE_MAX_SEGMENTS - 9), False),
        ("at HERE_MAX_SCAN_PIXELS", jpeg_header_claiming(1920, 1088), True),
        ("past HERE_MAX_SCAN_PIXELS", jpeg_header_claiming(1920, 1089), False),
        ("progressive, its scans past HERE_MAX_SCAN_PIXELS", image_bytes(640, 480, progressive=True), False),
        ("past HERE_MAX_BYTES", image_bytes(1024, 576, quality=100, subsampling=0), False),
        ("truncated: no skeleton", image_bytes(64, 64)[:-100], False),
        ("a PNG", image_bytes(32, 32, "PNG"), False),
    ],
)
def test_check_here_checks_a_jpeg_only_within_its_bounds(case: str, data: bytes, here: bool) -> None:
    """Past a bound it declines, the image still open for `check_opened`, which then passes or refuses it."""
    segment_count = sum(1 for _ in segments(data))
    if "HERE_MAX_SEGMENTS" in case:
        assert segment_count == HERE_MAX_SEGMENTS + (0 if here else 1)
    if "HERE_MAX_BYTES" in case:
        assert len(data) > HERE_MAX_BYTES
    if "HERE_MAX_SCAN_PIXELS" in case:
        size = Image.open(io.BytesIO(data)).size
        scans = sum(1 for segment in segments(data) if segment.marker == SOS)
        assert (scans * size[0] * size[1] <= HERE_MAX_SCAN_PIXELS) == here
    opened = open_image(data, formats=FORMATS, max_pixels=MAX_PIXELS, locator="x")
    assert check_here(opened, locator="x", max_jpeg_scans=100) is here
    if not here:
        expected = outcome(data, "check")
        if expected == 200:
            check_opened(opened, locator="x", max_jpeg_scans=100)
        else:
            with pytest.raises(GatewayError) as raised:
                check_opened(opened, locator="x", max_jpeg_scans=100)
            assert raised.value.status_code == expected


def test_check_here_declines_a_jpeg_over_the_pixel_bound_without_walking_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check_opened` walks the file itself on a media thread: a walk here would be done twice."""
    walked: list[int] = []
    original = jpeg_markers.skeleton

    def counting(data: bytes, **kwargs: Any) -> bytes | None:
        walked.append(len(data))
        return original(data, **kwargs)

    monkeypatch.setattr(jpeg_markers, "skeleton", counting)
    over = open_image(jpeg_header_claiming(1920, 1089), formats=FORMATS, max_pixels=None, locator="x")
    assert check_here(over, locator="x") is False
    assert walked == []
    within = open_image(jpeg_header_claiming(1920, 1088), formats=FORMATS, max_pixels=None, locator="x")
    assert check_here(within, locator="x") is True
    assert len(walked) == 1


def test_check_here_refuses_a_scan_bomb_within_its_bounds() -> None:
    bomb = scan_bomb(64, 30)
    assert sum(1 for segment in segments(bomb) if segment.marker == SOS) > 30
    opened = open_image(bomb, formats=FORMATS, max_pixels=None, locator="x")
    with pytest.raises(RequestTooLarge) as raised:
        check_here(opened, locator="x", max_jpeg_scans=20)
    assert raised.value.reason == "too_many_scans"


def test_a_jpeg_header_bomb_is_413_from_its_header_and_a_short_jpeg_passes_as_in_full() -> None:
    with pytest.raises(RequestTooLarge, match=r"over limits\.max_image_pixels"):
        open_image(jpeg_header_claiming(40000, 40000), formats=FORMATS, max_pixels=MAX_PIXELS, locator="x")
    # Entropy data for 16x16 under a header claiming 4096x4096, then EOI: libjpeg warns, both modes pass.
    short = jpeg_header_claiming(4096, 4096)
    assert (outcome(short, "full"), outcome(short, "check")) == (200, 200)


# --- what the check allocates ---------------------------------------------------------------------------------

# A walk allocates nothing that grows with the pixels: its peak is this small at PEAK_SIDE x PEAK_SIDE; it is also
# the noise floor of a resident-memory peak.
WALK_SLACK = 1 << 20


def check_for_peak(data: bytes, locator: str) -> None:
    """What the peak of a check is measured on (`resident_peaks`): the open included, since a WebP's decoder is
    made then."""
    check_opened(open_image(data, formats=FORMATS, max_pixels=None, locator=locator), locator=locator)


@pytest.fixture(scope="module")
def check_peaks() -> dict[str, dict[str, Any]]:
    measured = resident_peaks("tests.gateway.media.image.test_check:check_for_peak", PEAK_SIDE)
    results: dict[str, dict[str, Any]] = {}
    for case, (data, _) in peak_cases(PEAK_SIDE).items():
        header = read_header(data, formats=FORMATS, max_pixels=None, locator=case)
        results[case] = {"peak": measured[case][0], "check": check_bytes(header), "charge": header.decode_bytes}
    return results


@pytest.mark.parametrize("case", list(peak_cases(8)))
def test_the_charge_covers_what_the_check_allocates(case: str, check_peaks: dict[str, dict[str, Any]]) -> None:
    result = check_peaks[case]
    pixels = PEAK_SIDE * PEAK_SIDE
    per_pixel = f"peak {result['peak'] / pixels:.2f} B/px, check_bytes {result['check'] / pixels:.2f} B/px"
    # Resident memory moves in pages and allocator chunks: WALK_SLACK is that floor, for a walk and a decode alike
    # (a grey progressive JPEG, 2.0 B/px of coefficients, was seen peaking 1.1 MB over them).
    assert result["peak"] <= PEAK_OVER_CHARGE * result["check"] + WALK_SLACK, per_pixel
    assert result["check"] <= result["charge"]  # the decode's peak, charged before the check, covers it
    if case.startswith("jpeg"):  # the 1/8-scale output, a sixty-fourth of the pixels, over the coefficients
        header = read_header(peak_cases(8)[case][0], formats=FORMATS, max_pixels=None, locator=case)
        assert check_bytes(header) < header.decoder_bytes + pixels // 32 + (1 << 20)
