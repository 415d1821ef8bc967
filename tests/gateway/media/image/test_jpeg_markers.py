"""The marker walk libjpeg's reader is mirrored by: scans counted, and the skeleton the structure check decodes."""

from __future__ import annotations

import itertools

import pytest
from PIL import Image

from gateway.media.image.jpeg_markers import DRI, EOI, SKELETON_MAX_BYTES, SOS, count_scans, segments, skeleton
from tests.gateway.media.image.test_decode import _encoded, _noise


def test_jpeg_scans_are_counted_from_markers() -> None:
    color = Image.fromarray(_noise(64, 3, 5))
    assert count_scans(_encoded(color, "JPEG")) == 1
    progressive = _encoded(color, "JPEG", progressive=True, quality=95)
    assert count_scans(progressive) == 10  # libjpeg's progression for three components
    assert count_scans(_encoded(color.convert("L"), "JPEG", progressive=True)) == 6
    # Restart markers in the entropy-coded data, and an EXIF block whose thumbnail is a JPEG with its own scans.
    thumbnail = _encoded(color, "JPEG", progressive=True)
    exif = b"Exif\x00\x00" + thumbnail
    with_extras = _encoded(color, "JPEG", progressive=True, quality=95, exif=exif, restart_marker_blocks=1)
    assert with_extras.count(b"\xff\xd0") > 10
    assert with_extras.count(b"\xff\xda") == 20
    assert count_scans(with_extras) == 10
    assert count_scans(progressive, stop_after=3) == 3
    assert count_scans(b"\xff\xd8\xff\xda") == 0  # a segment cut short ends the count
    assert count_scans(b"\xff" * 100_000) == 0


def test_a_length_under_two_skips_nothing_as_in_libjpeg() -> None:
    data = b"\xff\xd8" + b"\xff\xe1\x00\x01" + b"\xff\xfe\x00\x04ab" + b"\xff\xd9"
    assert [(s.marker, s.start, s.end) for s in segments(data)] == [(0xE1, 2, 6), (0xFE, 6, 12), (EOI, 12, 14)]


def _sample(**save: object) -> bytes:
    return _encoded(Image.fromarray(_noise(96, 3, 2)), "JPEG", **save)


@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"restart_marker_rows": 1}], ids=str)
def test_a_skeleton_is_every_segment_in_order_without_the_entropy_coded_data(save: dict[str, object]) -> None:
    data = _sample(**save)
    kept = skeleton(data)
    assert kept is not None
    assert kept[:2] == b"\xff\xd8"
    assert kept.endswith(b"\xff\xd9")
    assert [s.marker for s in segments(kept)] == [s.marker for s in segments(data)]
    # What is left out is the data after each scan's header, and nothing else (Pillow's JFIF APP0 is 14 bytes).
    found = list(segments(data))
    entropy = sum(after.start - scan.end for scan, after in itertools.pairwise(found) if scan.marker == SOS)
    assert len(kept) == len(data) - entropy
    assert count_scans(kept) == count_scans(data)


def test_app_and_com_payloads_are_cut_to_what_libjpeg_reads() -> None:
    exif = b"Exif\x00\x00" + bytes(range(256)) * 40
    data = _encoded(Image.fromarray(_noise(32, 3, 1)), "JPEG", exif=exif, comment=b"c" * 5000)
    kept = skeleton(data)
    assert kept is not None
    app1 = next(s for s in segments(kept) if s.marker == 0xE1)
    assert kept[app1.start : app1.end] == b"\xff\xe1\x00\x10" + exif[:14]
    com = next(s for s in segments(kept) if s.marker == 0xFE)
    assert kept[com.start : com.end] == b"\xff\xfe\x00\x10" + b"c" * 14
    assert len(kept) < len(data) - len(exif) - 4900


def test_no_skeleton_where_the_entropy_coded_data_decides() -> None:
    data = _sample(restart_marker_rows=1)
    assert skeleton(data[:-2]) is None  # no EOI: whether the last scan finishes is the decode's to say
    assert skeleton(data[: len(data) // 2]) is None
    scan = next(s for s in segments(data) if s.marker == SOS)
    injected = data[: scan.end + 40] + b"\xff\x37" + data[scan.end + 40 :]
    walked = list(segments(injected))
    assert [(s.marker, s.resync) for s in walked if s.resync] == [(0x37, True)]
    assert skeleton(injected) is None  # libjpeg skips it at a restart boundary, or refuses it after the last one
    # Without a restart interval the same marker ends the scan: a segment libjpeg refuses, in the skeleton too.
    plain = _sample()
    assert not any(s.marker == DRI for s in segments(plain))
    scan = next(s for s in segments(plain) if s.marker == SOS)
    kept = skeleton(plain[: scan.end + 40] + b"\xff\x37\x00\x02" + plain[scan.end + 40 :])
    assert kept is not None
    assert b"\xff\x37\x00\x02" in kept


def test_a_skeleton_over_its_bound_is_not_built() -> None:
    tables = b"".join(b"\xff\xdb\x00\x43\x00" + bytes(range(1, 65)) for _ in range(SKELETON_MAX_BYTES // 69 + 1))
    data = _sample()
    padded = data[:2] + tables + data[2:]
    assert skeleton(padded) is None
    assert skeleton(data[:2] + tables[: 69 * 10] + data[2:]) is not None
