"""Opening an audio or video container from bytes already in memory with PyAV, bounded. Runs on worker threads.

The container reads the caller's bytes through `MemoryInput`, a file object over a memoryview: nothing is copied
but the chunk FFmpeg asks for, and every read checks the decode's `DecodeControl`, so a demux or decode that never
ends is stopped at its next read of input. Opening reads the header and probes at most `PROBE_BYTES` of the
stream and `ANALYZE_US` of its timeline, and decodes nothing: FFmpeg's stream probe would otherwise decode the
first frame of every stream at the size its bitstream says, before anything is charged for it. A container with
more than `MAX_STREAMS` streams is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import av
import av.container
import av.stream

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.threads import DeadlinePassed, DecodeControl
from gateway.media_defaults import AUDIO_CONTAINERS, VIDEO_CONTAINERS

__all__ = [
    "ANALYZE_US",
    "PROBE_BYTES",
    "MemoryInput",
    "check_codec",
    "check_container",
    "container_media_type",
    "deadline_error",
    "declared_durations",
    "first_stream",
    "open_container",
]

# FFmpeg's probe of stream parameters reads at most this many bytes and this much of the timeline (its own
# defaults are 5 MB and 5 s). A header whose streams are not described within them is refused as unreadable.
PROBE_BYTES = 1 << 20
ANALYZE_US = 2_000_000
# Bytes FFmpeg asks the file object for at a time (PyAV's default); each read checks the control.
READ_BYTES = 32768
# FFmpeg's stream probe opens a decoder for each stream and decodes frames until it knows the stream's parameters;
# with every frame skipped, it reads the parameters the container and the codec headers declare and allocates no
# picture. (In PyAV, options for the container reach every stream's probe too.)
PROBE_OPTIONS = {"probesize": str(PROBE_BYTES), "analyzeduration": str(ANALYZE_US), "skip_frame": "all"}
# A file with a video and an audio track, or several audio languages and subtitles, has a handful of streams.
MAX_STREAMS = 16


class MemoryInput:
    """A read-only, seekable file object over `data` for PyAV; `read` checks `control` first.

    `reads` and `bytes_read` count what the container asked for (tests observe how much a probe reads).
    """

    def __init__(self, data: bytes | bytearray | memoryview, control: DecodeControl | None = None) -> None:
        self._view = memoryview(data).cast("B")
        self._position = 0
        self._control = control
        self.reads = 0
        self.bytes_read = 0

    def read(self, size: int = -1, /) -> bytes:
        if self._control is not None:
            self._control.check()
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._position + size)
        chunk = bytes(self._view[self._position : end])
        self._position = max(self._position, end)
        self.reads += 1
        self.bytes_read += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = 0, /) -> int:
        base = {0: 0, 1: self._position, 2: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def open_container(
    source: MemoryInput, *, kind: str, locator: str, setting: str, control: DecodeControl | None
) -> av.container.InputContainer:
    """Open and probe the container; anything FFmpeg refuses is a 400 naming the item. A probe stopped by the
    control raises DecodeCancelled, or RequestTooLarge past its timeout (`setting` names the timeout's key)."""
    try:
        container = av.open(source, mode="r", options=PROBE_OPTIONS, buffer_size=READ_BYTES)
    except DeadlinePassed as passed:
        raise deadline_error(locator, kind, setting, passed.timeout_s) from None
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise BadRequest(f"{locator}: not a readable {kind} container ({exc})", reason="bad_media") from None
    if len(container.streams) > MAX_STREAMS:
        count = len(container.streams)
        container.close()
        raise BadRequest(
            f"{locator}: the {kind} container holds {count} streams; the gateway reads containers of at most "
            f"{MAX_STREAMS}",
            reason="bad_media",
        )
    return container


def deadline_error(locator: str, kind: str, setting: str, timeout_s: float) -> RequestTooLarge:
    return RequestTooLarge(
        f"{locator}: decoding the {kind} took longer than {setting}={timeout_s:g}", reason="decode_timeout"
    )


def check_container(
    container: av.container.InputContainer,
    formats: Collection[str],
    *,
    kind: str,
    known: dict[str, str],
    setting: str,
    locator: str,
) -> str:
    """The container's demuxer name, refused with 400 unless one of `formats` (names in `known`) maps to it."""
    demuxer = container.format.name
    if demuxer not in {known[name] for name in formats if name in known}:
        raise BadRequest(
            f"{locator}: {kind} container {demuxer!r} is not accepted ({setting}: {', '.join(formats)})",
            reason="unsupported_media",
        )
    return demuxer


def check_codec(codec: str, codecs: Collection[str], *, kind: str, setting: str, locator: str) -> None:
    if not any(fnmatch.fnmatchcase(codec, pattern) for pattern in codecs):
        raise BadRequest(
            f"{locator}: {kind} codec {codec!r} is not accepted ({setting}: {', '.join(codecs)})",
            reason="unsupported_media",
        )


Kind = Literal["video", "audio"]
_CONTAINERS: dict[Kind, dict[str, str]] = {"video": VIDEO_CONTAINERS, "audio": AUDIO_CONTAINERS}
# FFmpeg's demuxer names -> the subtype of the media type a data URL of such a file carries, and each kind's subtype
# for any other demuxer.
_SUBTYPES = {
    "mov,mp4,m4a,3gp,3g2,mj2": "mp4",
    "matroska,webm": "webm",
    "avi": "x-msvideo",
    "wav": "wav",
    "mp3": "mpeg",
    "flac": "flac",
    "ogg": "ogg",
}
_OTHER_SUBTYPE: dict[Kind, str] = {"video": "mp4", "audio": "wav"}


def container_media_type(kind: Kind, demuxer: str) -> str:
    """The media type of a `kind` container that FFmpeg's `demuxer` reads."""
    return f"{kind}/{_SUBTYPES.get(demuxer, _OTHER_SUBTYPE[kind])}"


@contextmanager
def first_stream(
    source: MemoryInput,
    *,
    kind: Kind,
    formats: Collection[str],
    codecs: Collection[str],
    locator: str,
    control: DecodeControl | None,
) -> Iterator[tuple[av.container.InputContainer, Any, str, str]]:
    """The opened container, its first `kind` stream, the demuxer's name and the stream's codec name, after the
    checks every container gets: readable (`open_container`), a container and codec that `media.<kind>_formats`
    and `media.<kind>_codecs` accept, a `kind` stream present (400 naming the item otherwise). Closed on exit."""
    container = open_container(
        source, kind=kind, locator=locator, setting=f"media.{kind}.decode_timeout_s", control=control
    )
    try:
        demuxer = check_container(
            container, formats, kind=kind, known=_CONTAINERS[kind], setting=f"media.{kind}_formats", locator=locator
        )
        streams = container.streams.video if kind == "video" else container.streams.audio
        if not streams:
            raise BadRequest(f"{locator}: the container holds no {kind} stream", reason="bad_media")
        stream = streams[0]
        codec = stream.codec_context.codec.canonical_name
        check_codec(codec, codecs, kind=kind, setting=f"media.{kind}_codecs", locator=locator)
        yield container, stream, demuxer, codec
    finally:
        container.close()


def declared_durations(container: av.container.InputContainer, stream: av.stream.Stream) -> list[float]:
    """The durations in seconds the stream and the container declare (none, one or both)."""
    durations = []
    if stream.duration is not None and stream.duration > 0 and stream.time_base is not None:
        durations.append(float(stream.duration * stream.time_base))
    if container.duration is not None and container.duration > 0:
        durations.append(container.duration / av.time_base)
    return durations
