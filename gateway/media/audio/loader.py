"""Audio: the container header first, the decoded samples predicted and charged before any decode, then the decode
to mono float32 PCM at `media.audio.sample_rate` (the PyAV functions: gateway/media/audio/decode.py).

Refused from the header, with nothing decoded: an unreadable container, a container or codec not accepted (400),
a duration over `limits.max_audio_seconds` or predicted bytes past the per-request cap (413). The prediction is
duration x rate x 4 bytes (mono float32, what the model server's loader holds). Samples past it (a header that
understates the duration) are charged as they arrive; decoded audio longer than `limits.max_audio_seconds`, the
cap, cancellation and `media.audio.decode_timeout_s` stop the decode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gateway.media.accounting import PrepaidCharge, RequestAccount
from gateway.media.audio.decode import AudioHeader, decode_audio, predicted_audio_bytes, probe_audio
from gateway.media.base import ContainerLoader, ContainerRules, LoadedItem
from gateway.media.container import MemoryInput
from gateway.media.parts import Modality
from gateway.media.plan import Keep
from gateway.media.threads import DecodeControl, Worker
from gateway.metrics import GatewayMetrics


class AudioLoader(ContainerLoader[AudioHeader]):
    modality = Modality.AUDIO

    def __init__(self, worker: Worker, metrics: GatewayMetrics, rules: ContainerRules, *, sample_rate: int) -> None:
        super().__init__(worker, metrics, rules)
        self.sample_rate = sample_rate

    def probe(self, source: MemoryInput, locator: str, control: DecodeControl | None, keep: Keep) -> AudioHeader:
        return probe_audio(
            source,
            formats=self.rules.formats,
            codecs=self.rules.codecs,
            max_seconds=self.rules.max_seconds,
            locator=locator,
            control=control,
        )

    def predicted_bytes(self, probe: AudioHeader) -> int:
        return predicted_audio_bytes(probe, self.sample_rate)

    async def charge_and_decode(
        self,
        item: LoadedItem,
        probe: AudioHeader,
        open_input: Callable[[], MemoryInput],
        account: RequestAccount,
        control: DecodeControl,
        keep: Keep,
    ) -> None:
        item.header = probe
        # Charged before anything is decoded: audio that would pass the cap is refused undecoded.
        account.charge(item.predicted_bytes, "decoded media")
        if not self.rules.decode:
            return
        decode = functools.partial(
            decode_audio,
            open_input(),
            probe,
            sample_rate=self.sample_rate,
            charge=PrepaidCharge(account, item.predicted_bytes, "decoded media"),
            control=control,
            max_seconds=self.rules.max_seconds,
            locator=item.ref.locator,
            on_frame=self._frames_decoded.inc,
        )
        samples = await self.timed_decode(item.ref.locator, decode, control)
        item.decoded = int(samples.shape[0])
        del samples
