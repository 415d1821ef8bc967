"""Audio: the container header first, the decoded samples predicted and charged before any decode, then the decode
to mono float32 PCM at `media.audio.sample_rate` (the PyAV functions: gateway/media/audio_decode.py).

Refused from the header, with nothing decoded: an unreadable container, a container or codec not accepted (400),
a duration over `limits.max_audio_seconds` or predicted bytes past the per-request cap (413). The prediction is
duration x rate x 4 bytes (mono float32, what the model server's loader holds). Samples past it (a header that
understates the duration) are charged as they arrive; decoded audio longer than `limits.max_audio_seconds`, the
cap, cancellation and `media.audio.decode_timeout_s` stop the decode.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection

from gateway.media.accounting import PrepaidCharge, RequestAccount
from gateway.media.audio_decode import AudioHeader, decode_audio, predicted_audio_bytes, probe_audio
from gateway.media.base import LoadedItem
from gateway.media.container import MemoryInput
from gateway.media.inline import checked_inline_size, inline_input
from gateway.media.parts import MediaRef, Modality
from gateway.media.resize import ModelResize
from gateway.media.threads import DecodeControl, Worker
from gateway.metrics import GatewayMetrics


class AudioLoader:
    modality = Modality.AUDIO

    def __init__(
        self,
        *,
        worker: Worker,
        metrics: GatewayMetrics,
        formats: Collection[str],
        codecs: Collection[str],
        max_seconds: float | None,
        sample_rate: int,
        decode: bool,
        decode_timeout_s: float | None,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.formats = tuple(formats)
        self.codecs = tuple(codecs)
        self.max_seconds = max_seconds
        self.sample_rate = sample_rate
        self.decode = decode
        self.decode_timeout_s = decode_timeout_s
        self._frames_decoded = metrics.media_frames_decoded.labels(self.modality.value)

    async def probe(self, ref: MediaRef, resize: ModelResize | None = None) -> int:
        # The header is read from the base64 itself, as `load_inline` reads the container.
        control = DecodeControl(self.decode_timeout_s)
        call = functools.partial(self._probe_header, ref, control)
        header = await self.worker.run(ref.locator, call, control=control)
        return predicted_audio_bytes(header, self.sample_rate)

    def _probe_header(self, ref: MediaRef, control: DecodeControl) -> AudioHeader:
        return self.header(inline_input(ref, control), ref.locator, control)

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, resize: ModelResize | None) -> None:
        await self._load(item, functools.partial(MemoryInput, data), account)

    async def load_inline(self, item: LoadedItem, account: RequestAccount, resize: ModelResize | None) -> None:
        # Every character is checked before the container reads any (a range it never reads would pass unchecked).
        item.encoded_bytes = await checked_inline_size(item.ref, self.worker)
        await self._load(item, functools.partial(inline_input, item.ref), account)

    async def _load(
        self, item: LoadedItem, open_input: Callable[[DecodeControl], MemoryInput], account: RequestAccount
    ) -> None:
        """`open_input`: a new file object over the item's encoded bytes, each open of the container reads one."""
        locator = item.ref.locator
        control = DecodeControl(self.decode_timeout_s)
        call = functools.partial(self.header, open_input(control), locator, control)
        header = await self.worker.run(locator, call, control=control)
        predicted = predicted_audio_bytes(header, self.sample_rate)
        item.header = header
        item.predicted_bytes = predicted
        self.metrics.media_predicted_bytes.labels(self.modality.value).observe(predicted)
        # Charged before anything is decoded: audio that would pass the cap is refused undecoded.
        account.charge(predicted, "decoded media")
        if not self.decode:
            return
        decode = functools.partial(
            decode_audio,
            open_input(control),
            header,
            sample_rate=self.sample_rate,
            charge=PrepaidCharge(account, predicted, "decoded media"),
            control=control,
            max_seconds=self.max_seconds,
            locator=locator,
            on_frame=self._frames_decoded.inc,
        )
        started = time.perf_counter()
        samples = await self.worker.run(locator, decode, control=control)
        self.metrics.media_decode_seconds.labels(self.modality.value).observe(time.perf_counter() - started)
        item.decoded = int(samples.shape[0])
        del samples

    def header(self, data: bytes | MemoryInput, locator: str, control: DecodeControl | None = None) -> AudioHeader:
        """On a media thread: the header, refusals included."""
        return probe_audio(
            data,
            formats=self.formats,
            codecs=self.codecs,
            max_seconds=self.max_seconds,
            locator=locator,
            control=control,
        )
