"""Where an image's header is read and its decode runs, through the real gateway: a tiny JPEG, its request's only
item, on the event loop's thread; a request's only JPEG whose header is short is opened and checked there too while
the check's bounds hold (`image_check.check_here`); anything larger, any other format, a JPEG whose header claims
more pixels, and every item of a request with two, on a media thread; in engine mode, a resize larger than the
limit too. The header read for the reservation of a request's only JPEG whose header is short stays on the event
loop's thread, and is the header of the whole file."""

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

import gateway.media.image.loader
from gateway.config import DecodeMode
from gateway.media.accounting import RequestAccount
from gateway.media.base import LoadedItem
from gateway.media.image.check import HERE_MAX_BYTES, HERE_MAX_SCAN_PIXELS, HERE_MAX_SEGMENTS
from gateway.media.image.decode import ImageHeader, pil_formats, read_header
from gateway.media.image.jpeg_markers import count_scans
from gateway.media.image.loader import HEADER_PREFIX_CHARS, INLINE_MAX_BYTES, INLINE_MAX_PIXELS, ImageLoader, ImagePlan
from gateway.media.parts import MediaRef, Modality, Source
from gateway.media.plan import Keep
from gateway.media.resize import ModelResize, ResizedPixels
from gateway.media.threads import DecodeCancelled, DecodeControl, Worker
from gateway.metrics import GatewayMetrics
from gateway.processors import Processors
from processor_geometry import QWEN2_VL, ProcessorGeometry
from tests.conftest import GatewayFactory
from tests.gateway.media.upstream_loads import upstream_load
from tests.gateway.media_factory import (
    chat_body,
    data_url,
    image_bytes,
    jpeg_header_claiming,
    png_text_bomb,
    png_with_chunks,
    ztxt,
)
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric

MIB = 1 << 20
MEDIA_THREAD = "mmgate-media"  # the media executor's thread name prefix (gateway/app.py)


def solid(width: int, height: int, fmt: str = "JPEG") -> bytes:
    """One colour: a few hundred bytes whatever the size."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, fmt)
    return out.getvalue()


# A step of an image's admission (the function that ran it) and whether it ran on a media thread.
Step = tuple[str, bool]
LOOP, MEDIA = False, True


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Each step in the order it ran: a header read (`open_image`; for the reservation through `read_header` where
    it is not a request's only JPEG with a short header), the load's open (`_open`, which reuses the reservation's
    opened image where there is one), each decode (`media.decode: full`) and each structure check (`check`, the
    default: `check_here`, which may leave it to `check_opened`)."""
    seen: list[Step] = []

    def recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, threading.current_thread().name.startswith(MEDIA_THREAD)))
            return original(*args, **kwargs)

        return wrapper

    for name in ("read_header", "open_image", "decode_opened", "check_here", "check_opened"):
        monkeypatch.setattr(
            gateway.media.image.loader, name, recording(name, getattr(gateway.media.image.loader, name))
        )
    monkeypatch.setattr(ImageLoader, "_open", recording("_open", ImageLoader._open))
    return seen


@pytest.mark.parametrize("decode", ["full", "check"])
@pytest.mark.parametrize("mode", ["bytes", "slots"])
def test_a_tiny_jpeg_alone_is_read_and_decoded_on_the_event_loop_thread(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, steps: list[Step], mode: str, decode: str
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
    work = ("decode_opened" if decode == "full" else "check_opened", LOOP)
    # bytes mode reads the header for the reservation, and the load reads the whole file through it.
    if mode == "bytes":
        assert steps == [("open_image", LOOP), ("_open", LOOP), work]
    else:
        assert steps == [("_open", LOOP), ("open_image", LOOP), work]
    # Counted as a decode on a media thread is.
    assert (items, decodes, in_use) == (1, 1, 0)
    assert predicted == 128 * 128 * 4
    assert counted >= predicted


def long_header(width: int, height: int) -> bytes:
    """A JPEG whose comment puts its first scan past INLINE_MAX_BYTES."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, "JPEG", comment=b"c" * 4000)
    return out.getvalue()


def many_segments(width: int, height: int) -> bytes:
    """A JPEG of more than HERE_MAX_SEGMENTS segments: a run of empty comments between its scan and its EOI."""
    data = image_bytes(width, height)
    return data[:-2] + b"\xff\xfe\x00\x02" * (HERE_MAX_SEGMENTS + 1) + data[-2:]


def truncated(data: bytes) -> bytes:
    """The file without its last third: it ends inside its scan, with no EOI."""
    return data[: len(data) * 2 // 3]


# A request's only JPEG with a short header, past a bound of `check_here`: opened for the reservation and loaded
# on the event loop's thread, then checked on a media thread.
CHECKED_ON_A_THREAD = [("open_image", LOOP), ("_open", LOOP), ("check_here", LOOP), ("check_opened", MEDIA)]
# Any other item: its header read for the reservation, then its load, on media threads.
ALL_ON_A_THREAD = [("read_header", MEDIA), ("_open", MEDIA), ("open_image", MEDIA), ("check_opened", MEDIA)]


@pytest.mark.parametrize(
    ("case", "images", "expected"),
    [
        ("a JPEG whose header is over INLINE_MAX_BYTES", [long_header(64, 64)], ALL_ON_A_THREAD),
        (
            "a JPEG over HERE_MAX_BYTES",
            [image_bytes(1024, 512, quality=100, subsampling=0)],
            [("open_image", LOOP), ("_open", MEDIA), ("check_opened", MEDIA)],
        ),
        ("a JPEG of more than HERE_MAX_SEGMENTS segments", [many_segments(64, 64)], CHECKED_ON_A_THREAD),
        ("a JPEG over HERE_MAX_SCAN_PIXELS", [solid(2000, 1100)], CHECKED_ON_A_THREAD),
        (
            "a progressive JPEG over HERE_MAX_SCAN_PIXELS",
            [image_bytes(600, 400, progressive=True)],
            CHECKED_ON_A_THREAD,
        ),
        ("a truncated JPEG", [truncated(image_bytes(64, 64))], CHECKED_ON_A_THREAD),
        ("a tiny PNG", [solid(64, 64, "PNG")], ALL_ON_A_THREAD),
        ("two tiny JPEGs", [solid(64, 64), solid(64, 64)], ALL_ON_A_THREAD * 2),
    ],
)
def test_anything_else_is_checked_on_a_media_thread(
    stub: tuple[StubUpstream, str],
    make_gateway: GatewayFactory,
    steps: list[Step],
    case: str,
    images: list[bytes],
    expected: list[Step],
) -> None:
    """The header read for the reservation stays on the event loop's thread for a request's only JPEG whose
    segments up to its first scan lie in its first INLINE_MAX_BYTES bytes, and its load reads the file through
    the image it opened: on that thread too where the JPEG is within HERE_MAX_BYTES. Its check goes to a media
    thread past the check's other bounds."""
    _, upstream = stub
    if case == "a JPEG over HERE_MAX_BYTES":
        assert len(images[0]) > HERE_MAX_BYTES
    if "over HERE_MAX_SCAN_PIXELS" in case:
        width, height = Image.open(io.BytesIO(images[0])).size
        assert count_scans(images[0]) * width * height > HERE_MAX_SCAN_PIXELS
    with make_gateway(upstream) as (_, url):
        response = httpx.post(
            url + "/v1/chat/completions",
            content=chat_body(*[data_url(image, "image/png" if "PNG" in case else "image/jpeg") for image in images]),
        )
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    if case == "a truncated JPEG":
        # Refused as a full decode refuses it, by libjpeg reading the file itself on a media thread.
        assert response.status_code == 400, response.text
        assert "image cannot be decoded" in response.json()["message"]
    else:
        assert response.status_code == 200, response.text
        assert decodes == len(images)
    # Two items load at once: their steps interleave.
    assert sorted(steps) == sorted(expected) if len(images) > 1 else steps == expected


@pytest.mark.parametrize(
    ("case", "image"),
    [
        ("baseline", image_bytes(640, 480)),
        ("progressive", image_bytes(320, 240, progressive=True)),
        ("with restarts", image_bytes(300, 200, restart_marker_blocks=4)),
        ("a 1080p frame", solid(1920, 1088)),
    ],
)
def test_a_requests_only_jpeg_within_the_checks_bounds_is_opened_and_checked_on_the_event_loop_thread(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, steps: list[Step], case: str, image: bytes
) -> None:
    """Its header short, its bytes, segments and scans times pixels within `check_here`'s bounds: no hop to a
    media thread, and one header read; counted as a check on a media thread is."""
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(image)))
        checks = metric(url, "mmgate_media_decode_seconds_count", modality="image")
        predicted = metric(url, "mmgate_media_predicted_bytes_sum", modality="image")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == 200, response.text
    assert INLINE_MAX_BYTES < len(image) <= HERE_MAX_BYTES
    assert steps == [("open_image", LOOP), ("_open", LOOP), ("check_here", LOOP)]
    assert (checks, in_use) == (1, 0)
    assert predicted > 0


@pytest.mark.parametrize("decode", ["full", "header"])
def test_a_jpeg_within_the_checks_bounds_is_decoded_on_a_media_thread_in_other_modes(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, steps: list[Step], decode: str
) -> None:
    _, upstream = stub
    with make_gateway(upstream, media={"decode": decode}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(image_bytes(640, 480))))
    assert response.status_code == 200, response.text
    decoded = [("decode_opened", MEDIA)] if decode == "full" else []
    assert steps == [("open_image", LOOP), ("_open", MEDIA), *decoded]


def test_a_tiny_jpeg_claiming_many_pixels_is_never_decoded_on_the_event_loop_thread(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, steps: list[Step]
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
    assert steps == CHECKED_ON_A_THREAD
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
        plan = ImagePlan(ref, Keep(resize=resize), sole=True)  # type: ignore[arg-type]
        await loader.load(item, plan, data, RequestAccount(None))
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
    head = gateway.media.image.loader._jpeg_head(ref)
    assert head is not None
    assert len(head) <= INLINE_MAX_BYTES < len(data)
    formats = pil_formats(("jpeg",))
    assert read_header(head, formats=formats, max_pixels=None, locator="x") == read_header(
        data, formats=formats, max_pixels=None, locator="x"
    )


def test_a_jpeg_head_is_read_on_the_loop_only_for_a_requests_only_item() -> None:
    ref = MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(image_bytes(64, 64)))
    with ThreadPoolExecutor(1) as executor:
        loader = jpeg_loader(executor, DecodeMode.CHECK)
        assert loader.plan(ref, Keep(), sole=False).head is None
        assert loader.plan(ref, Keep(), sole=True).head is not None
        assert loader.plan(replace(ref, value=data_url(long_header(64, 64))), Keep(), sole=True).head is None


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
        data = image_bytes(1500, 1500)  # past HERE_MAX_SCAN_PIXELS: a request's only item is checked on a thread too
        item = LoadedItem(ref=MediaRef(Modality.IMAGE, Source.DATA_URL, "x", data_url(data)))
        account = RequestAccount(None)
        await loader.load_inline(item, loader.plan(item.ref, Keep(), sole=sole), account)
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


# --- metadata: charged as the model server's loader allocates it ----------------------------------------------


def test_the_charge_covers_what_the_upstreams_loader_allocates_for_png_text(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """4 PNGs of 68 KB, each with 64 MiB of zTXt text after its image data, with the metadata limit off: the
    request's charge covers what the model server's loader allocates for them, measured (it was charged 367 KB
    against the loader's 260 MiB before)."""
    _, upstream = stub
    files = [png_text_bomb(64, before_idat=False)] * 4
    loaded = upstream_load(*files)
    with make_gateway(upstream, limits={"max_image_metadata_bytes": None}) as (_, url):
        response = httpx.post(
            url + "/v1/chat/completions", content=chat_body(*(data_url(f, "image/png") for f in files))
        )
        counted = metric(url, "mmgate_media_counted_bytes_sum")
    assert response.status_code == 200, response.text
    assert loaded.failed is None
    assert loaded.rss_growth > 4 * 60 * MIB  # the text, kept as `str`s
    assert counted >= max(loaded.traced_peak, loaded.rss_growth), f"{counted:,} against {loaded}"
    assert counted <= 1.2 * loaded.traced_peak, f"{counted:,} against {loaded}"


def test_an_images_metadata_past_its_limit_is_refused_naming_the_limit(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    bomb = png_text_bomb(64, before_idat=False)
    with make_gateway(upstream, limits={"max_image_metadata_bytes": "8MiB"}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(bomb, "image/png")))
        rejections = metric(url, "mmgate_rejections_total", reason="image_metadata_too_large")
    assert response.status_code == 413
    message = response.json()["message"]
    assert message.startswith("messages[0].content[1].image_url: the image's metadata (PNG zTXt chunks) costs its")
    assert message.endswith("over limits.max_image_metadata_bytes=8,388,608")
    assert rejections == 1
    assert app.state.requests == []


def test_the_reservation_counts_a_pngs_text_after_its_image_data_past_the_header(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """Two 256x256 PNGs (each past the header read's prefix) with 8 MiB of text after their image data, under a
    16 MiB cap: the headers' prediction counts the text, read from the whole item, and refuses the request before
    it reserves anything (before, the text was never counted)."""
    _, upstream = stub
    png = png_with_chunks(
        [ztxt(f"k{index}", b"t" * ((1 << 20) - 4096)) for index in range(8)], before_idat=False, side=256
    )
    assert len(png) * 4 // 3 > HEADER_PREFIX_CHARS
    body = chat_body(data_url(png, "image/png"), data_url(png, "image/png"))
    with make_gateway(upstream, limits={"max_multimodal_cpu_bytes_per_request": "16MiB"}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
    assert response.status_code == 413, response.text
    message = response.json()["message"]
    assert message.startswith("media predicted from the headers reach ")
    assert message.endswith("over limits.max_multimodal_cpu_bytes_per_request=16,777,216")
