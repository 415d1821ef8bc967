"""Images: header first (format and pixel checks), the decode's peak and the processed tensors charged before the
decode, then, by `media.decode`, the structure check (`check`, gateway/media/image_check.py), the decode to RGB
(`full`) or nothing (`header`) on a media thread (the header and decode functions: gateway/media/image_decode.py).
Engine mode always decodes: it sends the pixels.

The decoded image is dropped as soon as it is counted; in engine mode its pixels resized for the engine's model
are kept.

A tiny JPEG, its request's only item, is read and decoded on the event loop's thread (`threads.run_here`):
the hops to a media thread would cost more than the work. What that work can cost is bounded from both sides:
Pillow reads a JPEG's header by walking its markers in Python, linear in its bytes (at most `INLINE_MAX_BYTES`),
and libjpeg's decode costs pixels times scans (at most `INLINE_MAX_PIXELS`, from the header, and
`media.max_jpeg_scans`; in engine mode the resize's output too, which a model's minimum may make larger). A larger
JPEG, a JPEG whose header claims more pixels, and every other format (a PNG's header inflates compressed chunks when
it is opened, up to about a thousand times their size) go to a media thread.
"""

from __future__ import annotations

import functools
import time

from PIL import Image

from engine_adapter.client import ImageGeometry, ProcessorGeometry, image_geometry, resized_peak_bytes
from gateway.config import DecodeMode
from gateway.errors import BadRequest
from gateway.media.accounting import RequestAccount
from gateway.media.base import LoadedItem
from gateway.media.image_check import check_opened
from gateway.media.image_decode import ImageHeader, OpenedImage, decode_opened, open_image, pil_formats, read_header
from gateway.media.inline import decode_base64, inline_bytes, inline_payload
from gateway.media.parts import MediaRef, Modality
from gateway.media.processors import Processors
from gateway.media.resize import ModelResize, ResizedPixels
from gateway.media.threads import DecodeControl, Worker, is_sole_item, run_here
from gateway.metrics import Children, GatewayMetrics

# Base64 characters decoded to read a header without decoding the whole item (a multiple of 4).
HEADER_PREFIX_CHARS = 1 << 16

# A JPEG read on the event loop's thread (see above): at most this many encoded bytes, and this many pixels for its
# decode. Measured on adversarial files at the limits: a header of nothing but empty markers reads in about 1 ms, a
# 128x128 progressive JPEG of 100 scans decodes in about 0.5 ms.
INLINE_MAX_BYTES = 2048
INLINE_MAX_PIXELS = 128 * 128
_JPEG_MAGIC = b"\xff\xd8\xff"
# The bytes a resized pixel costs engine mode at the least (Pillow's resize: its RGB image and the uint8 array kept),
# so that the resized bytes charged bound the resized pixels from above.
_RESIZED_BYTES_PER_PIXEL = 4 + 3
_JPEG_MAGIC_BASE64 = b"/9j/"  # the base64 of `_JPEG_MAGIC`


class ImageLoader:
    modality = Modality.IMAGE

    def __init__(
        self,
        *,
        worker: Worker,
        metrics: GatewayMetrics,
        formats: tuple[str, ...],
        max_pixels: int | None,
        decode: DecodeMode,
        decode_timeout_s: float | None,
        max_jpeg_scans: int | None,
        processors: Processors,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.formats = pil_formats(formats)
        self.max_pixels = max_pixels
        self.decode = decode
        self.decode_timeout_s = decode_timeout_s
        self.max_jpeg_scans = max_jpeg_scans
        self.processors = processors
        self.predicted_bytes_by = Children(metrics.media_predicted_bytes.labels)
        self.decode_seconds_by = Children(metrics.media_decode_seconds.labels)

    async def probe(self, ref: MediaRef, resize: ModelResize | None = None) -> int:
        read = functools.partial(_header_from_prefix, ref, self.formats, self.max_pixels)
        header = run_here(ref.locator, read) if _tiny_jpeg_text(ref) else await self.worker.run(ref.locator, read)
        if resize is not None:
            return header.decode_bytes + self._resized_bytes(header, resize.geometry, ref.locator)
        processed = self._processed(header, ref.locator).processed_bytes if self.processors.candidates else 0
        return header.decode_bytes + processed

    async def load_inline(self, item: LoadedItem, account: RequestAccount, resize: ModelResize | None) -> None:
        data = await inline_bytes(item.ref, self.worker)
        item.encoded_bytes = len(data)
        await self.load(item, data, account, resize)

    async def load(self, item: LoadedItem, data: bytes, account: RequestAccount, resize: ModelResize | None) -> None:
        locator = item.ref.locator
        inline = is_sole_item() and len(data) <= INLINE_MAX_BYTES and data[:3] == _JPEG_MAGIC
        open_ = functools.partial(open_image, data, formats=self.formats, max_pixels=self.max_pixels, locator=locator)
        # Opened once: the decode reads on from the header, on whichever thread it runs.
        opened = run_here(locator, open_) if inline else await self.worker.run(locator, open_)
        with opened:
            header = item.header = opened.header
            kept_bytes = self._charge(item, header, account, resize)
            if resize is None and self.decode is not DecodeMode.FULL:
                if self.decode is DecodeMode.CHECK:
                    await self._check(opened, locator, inline=inline and _small_decode(header, 0))
                return
            decode = functools.partial(_decode_and_resize, opened, locator, resize, max_jpeg_scans=self.max_jpeg_scans)
            started = time.perf_counter()
            if inline and _small_decode(header, kept_bytes):
                image, kept = run_here(locator, functools.partial(decode, control=None))
            else:
                control = DecodeControl(self.decode_timeout_s)
                image, kept = await self.worker.run(
                    locator, functools.partial(decode, control=control), control=control
                )
        self.decode_seconds_by(self.modality.value).observe(time.perf_counter() - started)
        account.settle(header.decode_bytes, image)
        if kept is not None:
            account.settle(kept_bytes, kept)
            item.resized = kept

    async def _check(self, opened: OpenedImage, locator: str, *, inline: bool) -> None:
        """The structure check: what it allocates (`image_check.check_bytes`) is within the decode's peak charged
        before it, and it keeps nothing."""
        check = functools.partial(check_opened, opened, locator=locator, max_jpeg_scans=self.max_jpeg_scans)
        started = time.perf_counter()
        if inline:
            run_here(locator, check)
        else:
            control = DecodeControl(self.decode_timeout_s)
            await self.worker.run(locator, functools.partial(check, control=control), control=control)
        self.decode_seconds_by(self.modality.value).observe(time.perf_counter() - started)

    def _charge(
        self, item: LoadedItem, header: ImageHeader, account: RequestAccount, resize: ModelResize | None
    ) -> int:
        """Charge what the header predicts, before the decode starts (an item that would pass the cap is refused
        undecoded); returns the bytes charged for the resized pixels engine mode keeps."""
        locator = item.ref.locator
        item.predicted_bytes = header.decode_bytes
        account.charge(header.decode_bytes, "decoded media")
        kept_bytes = 0
        if resize is not None:
            # Engine mode: the engine makes the tensors; the gateway holds the resized uint8 pixels it sends.
            geometry = resize.geometry
            kept_bytes = self._resized_bytes(header, geometry, locator)
            item.predicted_bytes += kept_bytes
            account.charge(kept_bytes, f"resized pixels (the engine's {geometry.name} geometry)")
        elif self.processors.candidates:
            item.processed = self._processed(header, locator)
            item.predicted_bytes += item.processed.processed_bytes
            account.charge(item.processed.processed_bytes, f"processed tensors ({self.processors.label})")
        self.predicted_bytes_by(self.modality.value).observe(item.predicted_bytes)
        return kept_bytes

    def _processed(self, header: ImageHeader, locator: str) -> ImageGeometry:
        """What the charged processors make of the image: the largest of them."""
        label = self.processors.label
        made = [_geometry(header, locator, geometry, label) for geometry in self.processors.candidates]
        return max(made, key=lambda geometry: geometry.processed_bytes)

    def _resized_bytes(self, header: ImageHeader, geometry: ProcessorGeometry, locator: str) -> int:
        """The resize's peak, the uint8 array kept included (`resized_peak_bytes`)."""
        resized = _geometry(header, locator, geometry, f"media.processor={geometry.name}")
        return resized_peak_bytes((header.height, header.width), (resized.height, resized.width), geometry)


def _geometry(header: ImageHeader, locator: str, geometry: ProcessorGeometry, setting: str) -> ImageGeometry:
    try:
        return image_geometry(header.height, header.width, geometry)
    except ValueError as exc:  # AspectRatioError among them
        raise BadRequest(f"{locator}: {exc} ({setting})", reason="bad_media_geometry") from None


def _small_decode(header: ImageHeader, kept_bytes: int) -> bool:
    """The decode, and engine mode's resize of it, stay within `INLINE_MAX_PIXELS`: the resize makes the model's
    size, which a model's minimum may make larger than the image."""
    return max(header.width * header.height, kept_bytes // _RESIZED_BYTES_PER_PIXEL) <= INLINE_MAX_PIXELS


def _tiny_jpeg_text(ref: MediaRef) -> bool:
    """An inline item, its request's only one, whose base64 is a JPEG's of at most `INLINE_MAX_BYTES` bytes."""
    if not is_sole_item() or len(ref.value) > INLINE_MAX_BYTES * 4 // 3 + 300:  # a data URL's head is < 256
        return False
    payload = inline_payload(ref)
    text = payload.encode("latin-1", "replace") if isinstance(payload, str) else bytes(payload)
    return len(text) <= -(-INLINE_MAX_BYTES // 3) * 4 and text[:4] == _JPEG_MAGIC_BASE64


def _header_from_prefix(ref: MediaRef, formats: tuple[str, ...], max_pixels: int | None) -> ImageHeader:
    payload = inline_payload(ref)
    if len(payload) > HEADER_PREFIX_CHARS:
        try:
            prefix = decode_base64(payload[:HEADER_PREFIX_CHARS], ref.locator)
            return read_header(prefix, formats=formats, max_pixels=max_pixels, locator=ref.locator)
        except BadRequest:
            pass  # the header runs past the prefix (a large EXIF block, say): read the whole item
    data = decode_base64(payload, ref.locator)
    return read_header(data, formats=formats, max_pixels=max_pixels, locator=ref.locator)


def _decode_and_resize(
    opened: OpenedImage,
    locator: str,
    resize: ModelResize | None,
    *,
    control: DecodeControl | None,
    max_jpeg_scans: int | None,
) -> tuple[Image.Image, ResizedPixels | None]:
    image = decode_opened(opened, locator=locator, control=control, max_jpeg_scans=max_jpeg_scans)
    return image, resize.image(image, control=control) if resize is not None else None
