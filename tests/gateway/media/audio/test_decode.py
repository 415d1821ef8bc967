"""gateway.media.audio.decode on audio the tests encode with PyAV."""

from __future__ import annotations

import base64
import io
import threading

import av
import numpy as np
import pytest

from gateway.errors import BadRequest, RequestTooLarge
from gateway.media.audio.decode import AudioHeader, decode_audio, predicted_audio_bytes, probe_audio
from gateway.media.container import MemoryInput
from gateway.media.sources.inline import Base64Input
from gateway.media.threads import DecodeCancelled, DecodeControl
from gateway.media_defaults import DEFAULT_AUDIO_FORMATS

FORMATS = DEFAULT_AUDIO_FORMATS


def make_audio(
    codec: str = "pcm_s16le", fmt: str = "wav", *, seconds: float = 2.0, rate: int = 44100, layout: str = "stereo"
) -> bytes:
    """A 440 Hz tone."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        formats = stream.codec_context.codec.audio_formats
        assert formats
        sample_format = formats[0].name
        channels = stream.codec_context.channels
        total = int(seconds * rate)
        block = 1152
        for start in range(0, total, block):
            count = min(block, total - start)
            t = (np.arange(start, start + count) / rate).astype(np.float32)
            tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            planar = np.repeat(tone[None, :], channels, axis=0)
            frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
            frame.sample_rate = rate
            frame.pts = start
            resampled = av.AudioResampler(format=sample_format, layout=layout, rate=rate).resample(frame)
            for piece in resampled:
                for packet in stream.encode(piece):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def probe(data: bytes, max_seconds: float | None = None) -> AudioHeader:
    return probe_audio(data, formats=FORMATS, max_seconds=max_seconds, locator="messages[0].content[2]")


@pytest.mark.parametrize(
    ("codec", "fmt", "name"),
    [("pcm_s16le", "wav", "pcm_s16le"), ("flac", "flac", "flac"), ("libmp3lame", "mp3", "mp3")],
)
def test_probe_then_decode_to_mono_float32_at_the_model_rate(codec: str, fmt: str, name: str) -> None:
    data = make_audio(codec, fmt)
    header = probe(data)
    assert (header.codec, header.sample_rate, header.channels) == (name, 44100, 2)
    assert header.duration_s == pytest.approx(2.0, abs=0.06)
    charged: list[int] = []
    samples = decode_audio(data, header, sample_rate=16000, charge=charged.append)
    assert samples.dtype == np.float32
    assert samples.ndim == 1
    assert abs(samples.shape[0] - 32000) < 0.06 * 16000
    # Charged once, before decoding, and the audio fitted in it.
    assert charged == [predicted_audio_bytes(header, 16000)] == [np.ceil(header.duration_s * 16000) * 4]
    assert float(np.abs(samples[4000:8000]).max()) == pytest.approx(0.5, abs=0.05)


def test_unreadable_unaccepted_and_too_long_audio() -> None:
    random = np.random.default_rng(2).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    with pytest.raises(BadRequest, match=r"messages\[0\]\.content\[2\]: not a readable audio"):
        probe(random)
    wav = make_audio(seconds=3.0)
    with pytest.raises(BadRequest, match="audio container 'wav' is not accepted"):
        probe_audio(wav, formats=("mp3",), max_seconds=None, locator="x")
    with pytest.raises(BadRequest, match="audio codec 'pcm_s16le' is not accepted"):
        probe_audio(wav, formats=FORMATS, codecs=("flac",), max_seconds=None, locator="x")
    with pytest.raises(RequestTooLarge, match=r"lasts 3\.0 s, over limits.max_audio_seconds=2") as long:
        probe(wav, max_seconds=2)
    assert long.value.status_code == 413


def _flac_claiming(data: bytes, samples: int) -> bytes:
    """Rewrite STREAMINFO's 36-bit total-samples field (bytes 18..25 of the file hold rate, channels, bits and
    the total)."""
    assert data[:4] == b"fLaC"
    packed = int.from_bytes(data[18:26], "big")
    packed = (packed & ~((1 << 36) - 1)) | samples
    return data[:18] + packed.to_bytes(8, "big") + data[26:]


def test_a_header_that_understates_the_duration_is_caught_by_the_running_count() -> None:
    """A 10 s FLAC whose STREAMINFO claims 1 s: charged for 1 s up front, every sample past it is charged as it
    arrives, and decoding stops at the cap or at limits.max_audio_seconds."""
    data = _flac_claiming(make_audio("flac", "flac", seconds=10.0, rate=16000, layout="mono"), 16000)
    header = probe(data, max_seconds=5)
    assert header.duration_s == pytest.approx(1.0)
    with pytest.raises(RequestTooLarge, match=r"runs past limits\.max_audio_seconds=5"):
        decode_audio(data, header, charge=lambda n: None, max_seconds=5)
    budget = [predicted_audio_bytes(header) + 16000 * 4]

    def charge(nbytes: int) -> None:
        if nbytes > budget[0]:
            raise RequestTooLarge("over the cap")
        budget[0] -= nbytes

    with pytest.raises(RequestTooLarge, match="over the cap"):
        decode_audio(data, header, charge=charge)
    # Without limits the whole 10 s arrives, every byte charged.
    charged: list[int] = []
    samples = decode_audio(data, header, charge=charged.append)
    assert samples.shape[0] == 160000
    assert sum(charged) >= samples.nbytes + 16000 * 4


def test_cancel_and_deadline_stop_an_audio_decode() -> None:
    data = make_audio(seconds=5.0)
    header = probe(data)
    control = DecodeControl(timeout_s=None)
    threading.Thread(target=control.cancel).start()
    threading.Event().wait(0.05)
    with pytest.raises(DecodeCancelled):
        decode_audio(data, header, charge=lambda n: None, control=control)
    deadline = DecodeControl(timeout_s=0.0001)
    deadline.check()
    threading.Event().wait(0.01)
    with pytest.raises(RequestTooLarge, match=r"media\.audio\.decode_timeout_s") as late:
        decode_audio(data, header, charge=lambda n: None, control=deadline)
    assert late.value.reason == "decode_timeout"


@pytest.mark.parametrize(("codec", "fmt"), [("pcm_s16le", "wav"), ("flac", "flac"), ("libmp3lame", "mp3")])
def test_a_base64_input_decodes_the_samples_the_bytes_do(codec: str, fmt: str) -> None:
    data = make_audio(codec, fmt, seconds=3.0)
    text = memoryview(base64.b64encode(data))
    header = probe(data)
    assert probe_audio(Base64Input(text, "a"), formats=FORMATS, max_seconds=None, locator="a") == header
    plain = MemoryInput(data)
    from_bytes = decode_audio(plain, header, charge=lambda n: None)
    source = Base64Input(text, "a")
    from_text = decode_audio(source, header, charge=lambda n: None)
    assert np.array_equal(from_text, from_bytes)
    assert (source.reads, source.bytes_read) == (plain.reads, plain.bytes_read)
