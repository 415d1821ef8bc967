"""A JPEG's marker segments, found as libjpeg's marker reader finds them, and the file without its entropy-coded
data (`skeleton`). The scan count, the coefficient estimate and the structure check all walk the same segments."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["SKELETON_MAX_BYTES", "SOS", "Segment", "TooManySegments", "count_scans", "segments", "skeleton"]

# A marker as libjpeg finds one in entropy-coded data or between segments: 0xFF, any fill 0xFFs, then a byte
# that is neither a stuffed zero nor a restart marker (RSTn carry no length and do not end a scan). The match is
# the run's last 0xFF and the byte after it: a pattern that starts with a plain literal, which the regex engine
# searches for at about memchr's speed (tens of times faster than one with a lookbehind).
_MARKER = re.compile(rb"\xff([^\x00\xd0-\xd7\xff])")
SOI, EOI, SOS, DRI, TEM, COM = 0xD8, 0xD9, 0xDA, 0xDD, 0x01, 0xFE
_APP0, _APP15, _SOF0 = 0xE0, 0xEF, 0xC0
_PARAMETERLESS = (SOI, EOI, TEM)
# What libjpeg reads of an APPn's payload when it does not save markers (jdmarker.c APPN_DATA_LEN: enough for
# the JFIF and Adobe headers it examines); the rest, and all of a COM, it skips.
_APP_READ_BYTES = 14
# A skeleton is small (a few KiB of tables for a progressive file); a file whose segments alone are larger is
# checked as it is.
SKELETON_MAX_BYTES = 64 << 10


class TooManySegments(Exception):
    """The file has more marker segments than the caller's walk allows."""


class Segment(NamedTuple):
    marker: int
    start: int
    """Where its 0xFF is."""
    end: int
    """The byte after it: after its length field and payload; after the marker for SOI, EOI, TEM and a resync."""
    resync: bool = False
    """A marker found in a scan's entropy-coded data while restarts are on, below SOF0: libjpeg skips it when it
    resynchronises at the next restart boundary, or refuses it after the scan's last interval; the walk reads on."""


def segments(data: bytes) -> Iterator[Segment]:
    """The marker segments in file order, up to and including EOI. A segment's payload is skipped by its length
    (an EXIF thumbnail inside APP1 is not walked; a length under 2 skips nothing, as in libjpeg); entropy-coded
    data and bytes between segments are searched for the next marker. The walk stops after EOI, or where the data
    ends inside a segment or before EOI."""
    position = 2 if data[:2] == b"\xff\xd8" else 0
    restart_interval, in_scan = 0, False
    while True:
        found = _MARKER.search(data, position)
        if found is None:
            return
        marker, start, position = found.group(1)[0], found.start(), found.end()
        if in_scan and restart_interval and marker < _SOF0:
            yield Segment(marker, start, position, resync=True)
            continue
        in_scan = False
        if marker in _PARAMETERLESS:
            yield Segment(marker, start, position)
            if marker == EOI:
                return
            continue
        if position + 2 > len(data):
            return
        length = int.from_bytes(data[position : position + 2], "big")
        end = position + max(length, 2)
        if end > len(data):
            return
        if marker == DRI and length == 4:
            restart_interval = int.from_bytes(data[position + 2 : end], "big")
        yield Segment(marker, start, end)
        position = end
        in_scan = marker == SOS


def count_scans(data: bytes, *, stop_after: int | None = None) -> int:
    """Start-of-scan segments in a JPEG, counted up to `stop_after`."""
    return sum(1 for _ in itertools.islice((s for s in segments(data) if s.marker == SOS), stop_after))


def skeleton(data: bytes, *, max_segments: int | None = None) -> bytes | None:
    """The file without its entropy-coded data, APPn and COM payloads cut to what libjpeg reads of them: libjpeg
    checks every segment of it as it checks the file's (tables, frame, scans, restart interval) and refuses what
    it would refuse in the file, while each scan ends at once at the next marker, which it only warns about.

    None where the entropy-coded data can change what libjpeg decides, so that only the file itself answers: the
    data ends before EOI (a decode may or may not finish the last scan), or a scan holds a resync marker; also a
    skeleton over SKELETON_MAX_BYTES. `max_segments`: TooManySegments once the walk passes that many segments."""
    parts = [data[:2]]
    size = 2
    for count, segment in enumerate(segments(data), 1):
        if max_segments is not None and count > max_segments:
            raise TooManySegments(max_segments)
        if segment.resync:
            return None
        marker, start, end = segment.marker, segment.start, segment.end
        if _APP0 <= marker <= _APP15 or marker == COM:
            length = min(int.from_bytes(data[start + 2 : start + 4], "big"), _APP_READ_BYTES + 2)
            piece = data[start : start + 2] + length.to_bytes(2, "big") + data[start + 4 : start + 2 + length]
        else:
            piece = data[start:end]
        parts.append(piece)
        size += len(piece)
        if size > SKELETON_MAX_BYTES:
            return None
        if marker == EOI:
            return b"".join(parts)
    return None
