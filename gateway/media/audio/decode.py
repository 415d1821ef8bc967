"""An audio item's header, what its decode costs, and decoding it to float32 PCM at the model's rate. Runs on
worker threads; every function works on the encoded bytes already in memory (or a file object over them: an
inline item's base64, gateway/media/sources/inline.py).

The model servers load audio as mono float32 (vLLM's audio loader averages the channels) and resample it to the
model's rate. `predicted_audio_bytes` prices that from the header; `decode_audio` charges it before
decoding, fills one preallocated array, and charges every sample past the prediction as it arrives, so a file
whose header understates its duration is stopped by the cap or by the duration limit, never by memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import av
import av.container
import numpy as np
import numpy.typing as npt

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.container import (
    MemoryInput,
    container_media_type,
    deadline_error,
    declared_durations,
    first_stream,
    open_container,
)
from gateway.media.threads import DeadlinePassed, DecodeControl
from gateway.media_defaults import DEFAULT_AUDIO_CODECS, DEFAULT_SAMPLE_RATE

__all__ = ["AudioHeader", "decode_audio", "predicted_audio_bytes", "probe_audio"]

TIMEOUT_SETTING = "media.audio.decode_timeout_s"
FLOAT32_BYTES = 4
OUTPUT_CHANNELS = 1


@dataclass(frozen=True, slots=True)
class AudioHeader:
    """What the container declares about its first audio stream, read without decoding."""

    format: str
    codec: str
    sample_rate: int
    channels: int
    duration_s: float

    @property
    def media_type(self) -> str:
        return container_media_type("audio", self.format)


def probe_audio(
    data: bytes | bytearray | memoryview | MemoryInput,
    *,
    formats: Collection[str],
    codecs: Collection[str] = DEFAULT_AUDIO_CODECS,
    max_seconds: float | None,
    locator: str,
    control: DecodeControl | None = None,
) -> AudioHeader:
    """Read the first audio stream's header; 400 for an unreadable container, a container or codec not
    accepted, or no declared duration; 413 for a duration over `max_seconds`."""
    source = data if isinstance(data, MemoryInput) else MemoryInput(data, control)
    with first_stream(source, kind="audio", formats=formats, codecs=codecs, locator=locator, control=control) as (
        container,
        stream,
        demuxer,
        codec,
    ):
        rate = stream.codec_context.sample_rate
        channels = stream.codec_context.channels
        durations = declared_durations(container, stream)
    if rate <= 0 or channels <= 0:
        raise BadRequest(f"{locator}: the audio stream declares no sample rate or channels", reason="bad_media")
    if not durations:
        raise BadRequest(f"{locator}: the audio declares no duration", reason="bad_media")
    header = AudioHeader(format=demuxer, codec=codec, sample_rate=rate, channels=channels, duration_s=max(durations))
    if max_seconds is not None and header.duration_s > max_seconds:
        raise RequestTooLarge(
            f"{locator}: audio lasts {header.duration_s:.1f} s, over limits.max_audio_seconds={max_seconds:g}",
            reason="audio_too_long",
        )
    return header


def predicted_samples(header: AudioHeader, sample_rate: int = DEFAULT_SAMPLE_RATE) -> int:
    """Samples of the mono output at `sample_rate` for the declared duration."""
    return math.ceil(header.duration_s * sample_rate)


def predicted_audio_bytes(header: AudioHeader, sample_rate: int = DEFAULT_SAMPLE_RATE) -> int:
    """Bytes of the decoded audio: duration x rate x 1 channel (downmixed) x 4 (float32)."""
    return predicted_samples(header, sample_rate) * OUTPUT_CHANNELS * FLOAT32_BYTES


def decode_audio(
    data: bytes | bytearray | memoryview | MemoryInput,
    header: AudioHeader,
    *,
    sample_rate: int = DEFAULT_SAMPLE_RATE,
    charge: Callable[[int], None],
    control: DecodeControl | None = None,
    max_seconds: float | None = None,
    locator: str = "audio",
    on_frame: Callable[[], object] | None = None,
) -> npt.NDArray[np.float32]:
    """Decode the first audio stream to mono float32 at `sample_rate` (PyAV's resampler, FFmpeg's swresample).

    `predicted_audio_bytes` is charged before the container is opened and filled into one array. Samples past
    the prediction are charged as they arrive and kept in chunks (joined at the end, the join charged too);
    decoded audio longer than `max_seconds` is a 413. `control` is checked at every read and every frame;
    `on_frame` is called for every frame the decoder produces. `data` may be a file object already (an inline
    item's `Base64Input`), read from its start.
    Returns the samples (a view of the array when the prediction held, shorter when the audio was shorter).
    """
    expected = predicted_samples(header, sample_rate)
    charge(expected * FLOAT32_BYTES)
    out = np.empty(expected, dtype=np.float32)
    filled = 0
    extra: list[npt.NDArray[np.float32]] = []
    extra_samples = 0
    limit = None if max_seconds is None else math.ceil(max_seconds * sample_rate)
    source = data if isinstance(data, MemoryInput) else MemoryInput(data, control)
    container = open_container(source, kind="audio", locator=locator, setting=TIMEOUT_SETTING, control=control)
    # Channels are kept through the resampler and averaged here: vLLM's loader (librosa, mono) averages them,
    # where FFmpeg's own downmix to mono scales each channel by -3 dB instead.
    resampler = av.AudioResampler(format="fltp", rate=sample_rate)

    def take(frames: list[av.AudioFrame]) -> None:
        nonlocal filled, extra_samples
        for frame in frames:
            planes = frame.to_ndarray()
            samples = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
            count = samples.shape[0]
            if limit is not None and filled + extra_samples + count > limit:
                raise RequestTooLarge(
                    f"{locator}: decoded audio runs past limits.max_audio_seconds={max_seconds:g} "
                    f"(its header declares {header.duration_s:.1f} s)",
                    reason="audio_too_long",
                )
            room = min(count, expected - filled)
            out[filled : filled + room] = samples[:room]
            filled += room
            if room < count:
                rest = samples[room:]
                charge(rest.nbytes)
                extra.append(np.array(rest, dtype=np.float32))
                extra_samples += rest.shape[0]

    try:
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            if control is not None:
                control.check()
            if on_frame is not None:
                on_frame()
            take(resampler.resample(frame))
        take(resampler.resample(None))
    except DeadlinePassed as passed:
        raise deadline_error(locator, "audio", TIMEOUT_SETTING, passed.timeout_s) from None
    except (av.FFmpegError, ValueError) as exc:
        raise BadRequest(f"{locator}: audio cannot be decoded ({exc})", reason="bad_media") from None
    finally:
        container.close()
    if not extra:
        return out[:filled]
    charge((filled + extra_samples) * FLOAT32_BYTES)
    return np.concatenate([out[:filled], *extra])
