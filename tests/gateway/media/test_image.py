"""Where an image's header is read and its decode runs, through the real gateway: a tiny JPEG, its request's only
item, on the event loop's thread; anything larger, any other format, a JPEG whose header claims more pixels, and
every item of a request with two, on a media thread; in engine mode, a resize larger than the limit too. The header
read for the reservation of a request's only JPEG whose header is short stays on the event loop's thread, and is the
header of the whole file."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from PIL import Image

import gateway.media.image
from engine_adapter.client import QWEN2_VL, ProcessorGeometry
from gateway.config import DecodeMode
from gateway.media.accounting import RequestAccount
from gateway.media.base import LoadedItem
from gateway.media.image import INLINE_MAX_BYTES, INLINE_MAX_PIXELS, ImageLoader
from gateway.media.image_decode import ImageHeader, pil_formats, read_header
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.processors import Processors
from gateway.media.resize import ModelResize, ResizedPixels
from gateway.media.threads import DecodeCancelled, DecodeControl, Worker, sole_item
from gateway.metrics import GatewayMetrics
from tests.conftest import GatewayFactory
from tests.gateway.media_factory import chat_body, data_url, image_bytes, jpeg_header_claiming
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric

MEDIA_THREAD = "mmgate-media"  # the media executor's thread name prefix (gateway/app.py)


def solid(width: int, height: int, fmt: str = "JPEG") -> bytes:
    """One colour: a few hundred bytes whatever the size."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, fmt)
    return out.getvalue()


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The name of the thread each header read (the reservation's probe: `read_header`; the load: `open_image`),
    each decode (`media.decode: full`) and each structure check (`check`, the default) ran on, by function."""
    seen: dict[str, list[str]] = {"read_header": [], "open_image": [], "decode_opened": [], "check_opened": []}

    def recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen[name].append(threading.current_thread().name)
            return original(*args, **kwargs)

        return wrapper

    for name in seen:
        monkeypatch.setattr(gateway.media.image, name, recording(name, getattr(gateway.media.image, name)))
    return seen


def work(threads: dict[str, list[str]]) -> list[str]:
    """The threads the decodes and the checks ran on."""
    return threads["decode_opened"] + threads["check_opened"]


@pytest.mark.parametrize("decode", ["full", "check"])
@pytest.mark.parametrize("mode", ["bytes", "slots"])
def test_a_tiny_jpeg_alone_is_read_and_decoded_on_the_event_loop_thread(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, threads: dict[str, list[str]], mode: str, decode: str
) -> None:
    _, upstream = stub
    image = solid(128, 128)
    assert len(image) <= INLINE_MAX_BYTES
    assert INLINE_MAX_PIXELS == 128 * 128  # the image is at the limit
    with make_gateway(upstream, limits={"budget_mode": mode}, media={"decode": decode}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(image)))
        items = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="image")
        counted = metric(url, "mmgate_media_counted_bytes_sum")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == 200, response.text
    # bytes mode reads the header for the reservation too.
    assert len(threads["read_header"]) == (1 if mode == "bytes" else 0)
    ran = threads["decode_opened" if decode == "full" else "check_opened"]
    assert len(threads["open_image"]) == len(ran) == len(work(threads)) == 1
    loop_thread = threads["open_image"][0]
    assert not loop_thread.startswith(MEDIA_THREAD)
    assert threads["read_header"] + work(threads) == [loop_thread] * (2 if mode == "bytes" else 1)
    # Counted as a decode on a media thread is.
    assert (items, decodes, in_use) == (1, 1, 0)
    assert predicted == 128 * 128 * 4
    assert counted >= predicted


def long_header(width: int, height: int) -> bytes:
    """A JPEG whose comment puts its first scan past INLINE_MAX_BYTES."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, "JPEG", comment=b"c" * 4000)
    return out.getvalue()


@pytest.mark.parametrize(
    ("case", "images", "probe_on_loop", "open_on_loop"),
    [
        ("a JPEG over INLINE_MAX_BYTES", [image_bytes(64, 64)], True, False),
        ("a JPEG whose header is over INLINE_MAX_BYTES", [long_header(64, 64)], False, False),
        ("a JPEG over INLINE_MAX_PIXELS", [solid(129, 128)], True, True),
        ("a tiny PNG", [solid(64, 64, "PNG")], False, False),
        ("two tiny JPEGs", [solid(64, 64), solid(64, 64)], False, False),
    ],
)
def test_anything_else_is_decoded_on_a_media_thread(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    threads: dict[str, list[str]],
    case: str,
    images: list[bytes],
    probe_on_loop: bool,
    open_on_loop: bool,
) -> None:
    """The header read for the reservation (`read_header`) stays on the event loop's thread for a request's only
    JPEG whose segments up to its first scan lie in its first INLINE_MAX_BYTES bytes; the load's (`open_image`)
    only for a tiny JPEG."""
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.post(
            url + "/v1/chat/completions",
            content=chat_body(*[data_url(image, "image/png" if "PNG" in case else "image/jpeg") for image in images]),
        )
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    assert response.status_code == 200, response.text
    assert decodes == len(images)
    assert len(threads["check_opened"]) == len(work(threads)) == len(images)  # media.decode: check, the default
    assert all(name.startswith(MEDIA_THREAD) for name in work(threads))
    assert len(threads["read_header"]) == len(threads["open_image"]) == len(images)
    assert all(name.startswith(MEDIA_THREAD) != probe_on_loop for name in threads["read_header"])
    assert all(name.startswith(MEDIA_THREAD) != open_on_loop for name in threads["open_image"])


def test_a_tiny_jpeg_claiming_many_pixels_is_never_decoded_on_the_event_loop_thread(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, threads: dict[str, list[str]]
) -> None:
    """A decode bomb's bytes are few: the pixels its header claims send its decode to a media thread."""
    _, upstream = stub
    bomb = jpeg_header_claiming(4096, 4096)
    assert len(bomb) <= INLINE_MAX_BYTES
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(bomb)))
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="image")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == 200, response.text
    assert predicted == 4096 * 4096 * 4  # what its decode allocated, on a media thread
    assert [name.startswith(MEDIA_THREAD) for name in threads["read_header"] + threads["open_image"]] == [False, False]
    assert [name.startswith(MEDIA_THREAD) for name in work(threads)] == [True]
    assert in_use == 0


def jpeg_loader(executor: ThreadPoolExecutor, decode: DecodeMode) -> ImageLoader:
    """An image loader for JPEGs on `executor`'s threads, charging no processor's tensors."""
    return ImageLoader(
        worker=Worker(executor),
        metrics=GatewayMetrics(),
        formats=("jpeg",),
        max_pixels=None,
        decode=decode,
        decode_timeout_s=None,
        max_jpeg_scans=100,
        processors=Processors(None),
    )


@dataclass(frozen=True)
class RecordingResize:
    """Engine mode's `ModelResize`, recording the thread each resize runs on."""

    geometry: ProcessorGeometry
    threads: list[str]

    def image(self, image: Image.Image, *, control: DecodeControl | None = None) -> ResizedPixels:
        self.threads.append(threading.current_thread().name)
        return ModelResize(self.geometry).image(image, control=control)


@pytest.mark.parametrize(("min_pixels", "on_loop"), [(QWEN2_VL.min_pixels, True), (512 * 512, False)])
async def test_engine_modes_resize_of_a_tiny_jpeg_stays_on_the_loop_only_while_it_is_small(
    min_pixels: int, on_loop: bool
) -> None:
    """A model's minimum can make a tiny image's resize large: the decode then runs on a media thread."""
    geometry = replace(QWEN2_VL, min_pixels=min_pixels)
    threads: list[str] = []
    resize = RecordingResize(geometry, threads)
    with ThreadPoolExecutor(1, thread_name_prefix=MEDIA_THREAD) as executor:
        loader = jpeg_loader(executor, DecodeMode.FULL)
        data = solid(64, 64)
        ref = MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(data))
        item = LoadedItem(ref=ref, encoded_bytes=len(data))
        with sole_item():
            await loader.load(item, data, RequestAccount(None), resize)  # type: ignore[arg-type]
    assert item.resized is not None
    pixels, _ = item.resized
    assert pixels.shape[0] * pixels.shape[1] >= min_pixels
    assert [name.startswith(MEDIA_THREAD) for name in threads] == [not on_loop]


@pytest.mark.parametrize(
    ("case", "data"),
    [
        ("baseline 4:2:0", image_bytes(333, 221)),
        ("progressive", image_bytes(300, 200, progressive=True)),
        ("4:4:4 with restarts", image_bytes(300, 200, subsampling=0, restart_marker_blocks=4)),
        ("grey", image_bytes(200, 100, mode="L")),
        ("CMYK", image_bytes(120, 90, mode="CMYK")),
        ("with an EXIF block", image_bytes(200, 100, exif=b"Exif\x00\x00" + bytes(600))),
    ],
)
def test_a_jpegs_head_reads_as_the_whole_file(case: str, data: bytes) -> None:
    ref = MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(data))
    with sole_item():
        head = gateway.media.image._jpeg_head(ref)
    assert head is not None
    assert len(head) <= INLINE_MAX_BYTES < len(data)
    formats = pil_formats(("jpeg",))
    assert read_header(head, formats=formats, max_pixels=None, locator="x") == read_header(
        data, formats=formats, max_pixels=None, locator="x"
    )


def test_a_jpeg_head_is_read_on_the_loop_only_for_a_requests_only_item() -> None:
    ref = MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(image_bytes(64, 64)))
    assert gateway.media.image._jpeg_head(ref) is None
    with sole_item():
        assert gateway.media.image._jpeg_head(ref) is not None
        assert gateway.media.image._jpeg_head(replace(ref, value=data_url(long_header(64, 64)))) is None


class CountingExecutor(ThreadPoolExecutor):
    """Counts the calls handed to its threads."""

    submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("decode", list(DecodeMode))
@pytest.mark.parametrize("sole", [True, False])
async def test_an_images_load_is_one_call_on_a_media_thread(decode: DecodeMode, sole: bool) -> None:
    """Its base64 decoded, its header read, what it predicts charged, then its check or decode: each hop to a
    thread and back would cost more CPU than most of those steps."""
    with CountingExecutor(2, thread_name_prefix=MEDIA_THREAD) as executor:
        loader = jpeg_loader(executor, decode)
        data = image_bytes(256, 256)
        item = LoadedItem(ref=MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(data)))
        account = RequestAccount(None)
        if sole:
            with sole_item():
                await loader.load_inline(item, account, None)
        else:
            await loader.load_inline(item, account, None)
    assert executor.submitted == 1
    assert isinstance(item.header, ImageHeader)
    assert item.encoded_bytes == len(data)
    assert item.predicted_bytes == item.header.decode_bytes > 0
    assert account.total >= item.predicted_bytes


def test_a_cancelled_control_stops_engine_modes_torchvision_resize() -> None:
    control = DecodeControl(None)
    control.cancel()
    resize = ModelResize(replace(QWEN2_VL, resize="torchvision"))
    with pytest.raises(DecodeCancelled):
        resize.image(Image.new("RGB", (1000, 700)), control=control)
