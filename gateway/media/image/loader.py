"""Images: header first (format and pixel checks), the decode's peak and the processed tensors charged before the
decode, then, by `media.decode`, the structure check (`check`, gateway/media/image/check.py), the decode to RGB
(`full`) or nothing (`header`) (the header and decode functions: gateway/media/image/decode.py). Engine mode always
decodes: it sends the pixels. All of it, an inline item's base64 decode included, is one call on a media thread:
a hop to a thread and back costs about 50 us of CPU, more than reading a typical image's header, and it waits
for a core that the model server may be using.

The decoded image is dropped as soon as it is counted; in engine mode (`Keep.resize`) its pixels resized for the
engine's model are kept.

An image's route is its plan (`ImagePlan`): where it is opened and checked, and what its prediction opened. Only a
request's only item may be opened on the event loop's thread (`ItemPlan.sole`), and only a JPEG:

- A tiny JPEG is read and decoded there (`threads.run_here`): the hops to a media thread would cost more than the
  work. What that work can cost is bounded from both sides: Pillow reads a JPEG's header by walking its markers in
  Python, linear in its bytes (at most `INLINE_MAX_BYTES`), and libjpeg's decode costs pixels times scans (at most
  `INLINE_MAX_PIXELS`, from the header, and `media.max_jpeg_scans`; in engine mode the resize's output too, which
  a model's minimum may make larger).
- The header of a JPEG whose segments up to the first scan lie in its first `INLINE_MAX_BYTES` bytes (its `head`)
  is read there for the reservation (`predict`): Pillow reads no further, so it costs what a tiny JPEG's does. The
  image so opened is the one its load reads the whole file through. Such a JPEG is also checked there
  (`media.decode: check`, proxy mode) while `image.check.check_here` bounds the check: the hops would add about a
  quarter of a millisecond to the request on two busy cores, more than the check of a photograph costs.
- A JPEG past those bounds, a JPEG whose header claims too many pixels, and every other format go to a media
  thread.

What the model server's loader allocates for an image's metadata (PNG text, ICC and EXIF chunks, JPEG APPn and
COM segments, WebP and GIF metadata: `image.metadata`) is part of the header's predicted peak, so the reservation
and the per-request cap count it; past `limits.max_image_metadata_bytes` the item is refused (413) from the walk,
before anything is inflated past that. The gateway's own open never reads that metadata into memory.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from PIL import Image

from gateway.config import DecodeMode
from gateway.errors import BadRequest
from gateway.media.accounting import RequestAccount
from gateway.media.base import LoadedItem
from gateway.media.image import jpeg_markers
from gateway.media.image.check import HERE_MAX_BYTES, check_here, check_opened
from gateway.media.image.decode import (
    ImageHeader,
    OpenedImage,
    decode_opened,
    open_image,
    pil_formats,
    read_header,
)
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.plan import ItemPlan, Keep
from gateway.media.resize import ResizedPixels
from gateway.media.sources.inline import (
    decode_base64,
    decode_item,
    inline_input,
    inline_payload,
    payload_chars,
    payload_head,
)
from gateway.media.threads import DecodeControl, Worker, run_here
from gateway.metrics import Children, GatewayMetrics
from gateway.processors import Processed, Processors, largest
from processor_geometry import ImageGeometry, ProcessorGeometry, image_geometry, resized_peak_bytes

# Base64 characters decoded to read a header without decoding the whole item (a multiple of 4).
HEADER_PREFIX_CHARS = 1 << 16

# A JPEG read on the event loop's thread (see above): at most this many encoded bytes, and this many pixels for its
# decode. Measured on adversarial files at the limits: a header of nothing but empty markers reads in about 1 ms, a
# 128x128 progressive JPEG of 100 scans decodes in about 0.5 ms.
INLINE_MAX_BYTES = 2048
INLINE_MAX_PIXELS = 128 * 128
_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The bytes a resized pixel costs engine mode at the least (Pillow's resize: its RGB image and the uint8 array kept),
# so that the resized bytes charged bound the resized pixels from above.
_RESIZED_BYTES_PER_PIXEL = 4 + 3
_JPEG_MAGIC_BASE64 = b"/9j/"  # the base64 of `_JPEG_MAGIC`
# The base64 characters of a JPEG's first `INLINE_MAX_BYTES` bytes (and a byte more).
_HEAD_CHARS = -(-INLINE_MAX_BYTES // 3) * 4
# The base64 characters of `HERE_MAX_BYTES` bytes.
_HERE_MAX_CHARS = HERE_MAX_BYTES // 3 * 4


@dataclass(frozen=True, slots=True)
class ImagePlan(ItemPlan):
    """An image's route: where it is opened and checked, and what its prediction opened."""

    head: bytes | None = None
    """An inline JPEG whose segments up to its first scan lie in its first `INLINE_MAX_BYTES` bytes (a request's
    only item): those bytes, from which Pillow reads the header as from the whole file (it stops at the first scan),
    on the event loop's thread."""
    opened: OpenedImage | None = None
    """The image the prediction opened from `head`: the load reads the whole file through it rather than parse the
    header again. Left unloaded (the reservation refused, the client gone), it goes with the plan: it holds a few
    KiB and no file. Loaded, it has read the whole file: the plans go when their load ends (gateway/admission.py)."""
    on_loop: bool = False
    """The load opens the image on the event loop's thread, and decodes or checks it there while the bounds hold;
    otherwise its load is one call on a media thread. A downloaded item's is decided from its bytes once they have
    arrived (`ImageLoader.load`)."""


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
        max_metadata_bytes: int | None = None,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.formats = pil_formats(formats)
        self.max_pixels = max_pixels
        self.max_metadata_bytes = max_metadata_bytes
        self.decode = decode
        self.decode_timeout_s = decode_timeout_s
        self.max_jpeg_scans = max_jpeg_scans
        self.processors = processors
        self.predicted_bytes_by = Children(metrics.media_predicted_bytes.labels)
        self.decode_seconds_by = Children(metrics.media_decode_seconds.labels)

    def plan(self, ref: MediaRef, keep: Keep, *, sole: bool) -> ImagePlan:
        """An inline item's route, from its first base64 characters: a tiny JPEG, or a short-headed one within the
        check's bounds, on the event loop's thread. Its text is not checked here: a value that is no data URL is
        refused by its prediction or its load, as any other."""
        if not sole or ref.source is Source.URL:
            return ImagePlan(ref, keep, sole)
        try:
            head = _jpeg_head(ref)
            on_loop = _tiny_jpeg_text(ref) or (
                self._checks_here(keep) and payload_chars(ref) <= _HERE_MAX_CHARS and head is not None
            )
        except BadRequest:
            return ImagePlan(ref, keep, sole)
        return ImagePlan(ref, keep, sole, head=head, on_loop=on_loop)

    async def predict(self, plan: ImagePlan) -> tuple[int, ImagePlan]:
        ref = plan.ref
        if plan.head is not None:
            opened = run_here(
                ref.locator,
                functools.partial(
                    open_image,
                    plan.head,
                    formats=self.formats,
                    max_pixels=self.max_pixels,
                    locator=ref.locator,
                    max_metadata_bytes=self.max_metadata_bytes,
                ),
            )
            plan = replace(plan, opened=opened)
            header = opened.header
        else:
            read = functools.partial(_header_from_prefix, ref, self.formats, self.max_pixels, self.max_metadata_bytes)
            header = run_here(ref.locator, read) if plan.on_loop else await self.worker.run(ref.locator, read)
        geometry = plan.keep.geometry
        if geometry is not None:
            return header.decode_bytes + self._resized_bytes(header, geometry, ref.locator), plan
        processed = self._processed(header, ref.locator) if self.processors.candidates else None
        return header.decode_bytes + (processed.peak if processed is not None else 0), plan

    async def load_inline(self, item: LoadedItem, plan: ImagePlan, account: RequestAccount) -> None:
        await self._load(item, plan, functools.partial(decode_item, plan.ref), account)

    async def load(self, item: LoadedItem, plan: ImagePlan, data: bytes, account: RequestAccount) -> None:
        on_loop = (
            plan.sole
            and data[:3] == _JPEG_MAGIC
            and (
                len(data) <= INLINE_MAX_BYTES
                or (self._checks_here(plan.keep) and len(data) <= HERE_MAX_BYTES and _header_end(data) is not None)
            )
        )
        await self._load(item, replace(plan, on_loop=on_loop), lambda: data, account)

    def _checks_here(self, keep: Keep) -> bool:
        """Whether a JPEG opened on this thread may be checked here (`_check_here`)."""
        return keep.resize is None and self.decode is DecodeMode.CHECK

    async def _load(
        self, item: LoadedItem, plan: ImagePlan, read: Callable[[], bytes], account: RequestAccount
    ) -> None:
        """The item's bytes read, opened and charged (`_open`), then checked or decoded (`_finish`), as `plan`
        says: in one call on a media thread, or, `on_loop`, opened on this thread, and for a tiny JPEG decoded
        there too while `_small_decode` holds, or checked there while `check_here` takes it. The image the
        prediction opened from the file's head (`plan.opened`) reads the whole file instead of a second open."""
        locator = item.ref.locator
        keep = plan.keep
        control = DecodeControl(self.decode_timeout_s)
        open_ = functools.partial(self._open, item, read, account, keep, plan.opened, control)
        try:
            if plan.on_loop:
                opened, kept_bytes = run_here(locator, open_)
                finish = functools.partial(self._finish, item, opened, kept_bytes, account, keep)
                with opened:  # closed here too where the calls below never start
                    if len(opened.data) <= INLINE_MAX_BYTES and _small_decode(opened.header, kept_bytes):
                        seconds = run_here(locator, functools.partial(finish, control=None))
                    else:
                        seconds = run_here(locator, functools.partial(self._check_here, opened, locator, keep))
                        if seconds is None:
                            seconds = await self.worker.run(
                                locator, functools.partial(finish, control=control), control=control
                            )
            else:
                seconds = await self.worker.run(
                    locator,
                    functools.partial(self._open_and_finish, open_, item, account, keep, control),
                    control=control,
                )
        finally:
            if item.predicted_bytes:
                self.predicted_bytes_by(self.modality.value).observe(item.predicted_bytes)
        if seconds is not None:
            self.decode_seconds_by(self.modality.value).observe(seconds)

    def _open_and_finish(
        self,
        open_: Callable[[], tuple[OpenedImage, int]],
        item: LoadedItem,
        account: RequestAccount,
        keep: Keep,
        control: DecodeControl,
    ) -> float | None:
        opened, kept_bytes = open_()
        return self._finish(item, opened, kept_bytes, account, keep, control=control)

    def _open(
        self,
        item: LoadedItem,
        read: Callable[[], bytes],
        account: RequestAccount,
        keep: Keep,
        opened: OpenedImage | None,
        control: DecodeControl,
    ) -> tuple[OpenedImage, int]:
        """The bytes read and the header opened and checked (or, `opened` from the file's head, extended to the
        whole file); what it predicts, the model server's loader's metadata included, is charged before any
        decode (an item that would pass the cap is refused undecoded). Returns the opened image and the bytes
        charged for the resized pixels engine mode keeps."""
        try:
            data = read()
            item.encoded_bytes = len(data)
            if opened is None:
                opened = open_image(
                    data,
                    formats=self.formats,
                    max_pixels=self.max_pixels,
                    locator=item.ref.locator,
                    max_metadata_bytes=self.max_metadata_bytes,
                    control=control,
                )
            else:
                opened.extend_to(data)
            item.header = opened.header
            return opened, self._charge(item, opened.header, account, keep)
        except BaseException:
            if opened is not None:
                opened.close()
            raise

    def _finish(
        self,
        item: LoadedItem,
        opened: OpenedImage,
        kept_bytes: int,
        account: RequestAccount,
        keep: Keep,
        *,
        control: DecodeControl | None,
    ) -> float | None:
        """By `media.decode`, the structure check, the decode (and engine mode's resize, whose pixels are kept in
        `item.resized`) or nothing; returns the seconds the check or decode took, None when neither ran."""
        locator = item.ref.locator
        started = time.perf_counter()
        with opened:
            header = opened.header
            if keep.resize is None and self.decode is not DecodeMode.FULL:
                if self.decode is not DecodeMode.CHECK:
                    return None
                # What the check allocates (`image.check.check_bytes`) is within the decode's peak charged before
                # it, and it keeps nothing.
                check_opened(opened, locator=locator, max_jpeg_scans=self.max_jpeg_scans, control=control)
                return time.perf_counter() - started
            image, kept = _decode_and_resize(opened, locator, keep, control=control, max_jpeg_scans=self.max_jpeg_scans)
        seconds = time.perf_counter() - started
        account.settle(header.decode_bytes, image)
        if kept is not None:
            account.settle(kept_bytes, kept)
            item.resized = kept
        return seconds

    def _check_here(self, opened: OpenedImage, locator: str, keep: Keep) -> float | None:
        """The seconds `check_here` took where it checked the image on this thread; None where it did not (it
        read nothing but markers)."""
        if not self._checks_here(keep):
            return None
        started = time.perf_counter()
        if not check_here(opened, locator=locator, max_jpeg_scans=self.max_jpeg_scans):
            return None
        return time.perf_counter() - started

    def _charge(self, item: LoadedItem, header: ImageHeader, account: RequestAccount, keep: Keep) -> int:
        """Charge what the header predicts and note it in `item.predicted_bytes` once all of it is charged;
        returns the bytes charged for the resized pixels engine mode keeps."""
        locator = item.ref.locator
        account.charge(header.decode_bytes, "decoded media")
        predicted = header.decode_bytes
        kept_bytes = 0
        geometry = keep.geometry
        if geometry is not None:
            # Engine mode: the engine makes the tensors; the gateway holds the resized uint8 pixels it sends.
            kept_bytes = self._resized_bytes(header, geometry, locator)
            predicted += kept_bytes
            account.charge(kept_bytes, f"resized pixels (the engine's {geometry.name} geometry)")
        elif self.processors.candidates:
            item.processed = self._processed(header, locator)
            if item.processed is not None:
                predicted += account.charge_processed(item.processed, f"processed tensors ({self.processors.label})")
        item.predicted_bytes = predicted
        return kept_bytes

    def _processed(self, header: ImageHeader, locator: str) -> Processed | None:
        """What the charged processors make of the image and hold: the largest of them (`processors.largest`)."""
        return largest(
            self.processors.candidates,
            lambda family: family.image(header.height, header.width),
            locator,
            self.processors.label,
        )

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
    """An inline item whose base64 is a JPEG's of at most `INLINE_MAX_BYTES` bytes."""
    head = _ascii(payload_head(ref, _HEAD_CHARS + 1))
    return len(head) <= _HEAD_CHARS and head[:4] == _JPEG_MAGIC_BASE64


def _jpeg_head(ref: MediaRef) -> bytes | None:
    """For an inline JPEG whose segments up to its first scan lie within its first `INLINE_MAX_BYTES` bytes: those
    bytes, from which Pillow reads the header as from the whole file (it stops at the first scan) and as a tiny
    JPEG's. None for any other item."""
    head = _ascii(payload_head(ref, _HEAD_CHARS))
    if head[:4] != _JPEG_MAGIC_BASE64:
        return None
    try:
        data = decode_base64(head[: len(head) - len(head) % 4], ref.locator)
    except BadRequest:
        return None  # the read on a media thread refuses it
    end = _header_end(data)
    return data[:end] if end is not None else None


def _header_end(data: bytes) -> int | None:
    """Where a JPEG's first scan header ends, if it does within its first `INLINE_MAX_BYTES` bytes."""
    head = data[:INLINE_MAX_BYTES]
    scan = next((segment for segment in jpeg_markers.segments(head) if segment.marker == jpeg_markers.SOS), None)
    return scan.end if scan is not None else None


def _ascii(text: str | memoryview) -> bytes:
    return text.encode("latin-1", "replace") if isinstance(text, str) else bytes(text)


def _header_from_prefix(
    ref: MediaRef, formats: tuple[str, ...], max_pixels: int | None, max_metadata_bytes: int | None
) -> ImageHeader:
    """The header from the item's first bytes where it lies there, else from the whole item. A PNG's metadata
    is walked to its end (the chunks after the image data too) through `Base64Input`, which decodes only what
    the walk reads."""
    prefix = payload_head(ref, HEADER_PREFIX_CHARS + 1)
    if len(prefix) > HEADER_PREFIX_CHARS:
        try:
            data = decode_base64(prefix[:HEADER_PREFIX_CHARS], ref.locator)
            whole = inline_input(ref) if data[:8] == _PNG_MAGIC else None
            return read_header(
                data,
                formats=formats,
                max_pixels=max_pixels,
                locator=ref.locator,
                max_metadata_bytes=max_metadata_bytes,
                whole=whole,
            )
        except BadRequest:
            pass  # the header runs past the prefix (a large EXIF block, say): read the whole item
    data = decode_base64(inline_payload(ref), ref.locator)
    return read_header(
        data, formats=formats, max_pixels=max_pixels, locator=ref.locator, max_metadata_bytes=max_metadata_bytes
    )


def _decode_and_resize(
    opened: OpenedImage, locator: str, keep: Keep, *, control: DecodeControl | None, max_jpeg_scans: int | None
) -> tuple[Image.Image, ResizedPixels | None]:
    image = decode_opened(opened, locator=locator, control=control, max_jpeg_scans=max_jpeg_scans)
    return image, keep.resize.image(image, control=control) if keep.resize is not None else None
