from __future__ import annotations

import time

import pytest
from PIL import Image

from gateway.errors import BadRequest, RequestTooLarge
from gateway.image_loader import decode_rgb, pil_formats, read_header
from tests.gateway.media_factory import image_bytes, jpeg_header_claiming

FORMATS = pil_formats(("jpeg", "png", "webp", "gif", "bmp"))


def test_header_gives_format_size_and_predicted_bytes() -> None:
    header = read_header(image_bytes(320, 200), formats=FORMATS, max_pixels=None, locator="x")
    assert (header.format, header.width, header.height) == ("jpeg", 320, 200)
    assert header.rgb_bytes == 320 * 200 * 3


def test_header_over_pixel_limit_is_413_without_decoding() -> None:
    bomb = jpeg_header_claiming(40000, 40000)
    started = time.perf_counter()
    with pytest.raises(RequestTooLarge) as raised:
        read_header(bomb, formats=FORMATS, max_pixels=178_956_970, locator="messages[0].content[1]")
    assert time.perf_counter() - started < 0.5
    assert raised.value.message == (
        "messages[0].content[1]: image is 40000x40000 = 1,600,000,000 pixels, over limits.max_image_pixels=178,956,970"
    )


def test_disallowed_format_is_400() -> None:
    tiff = image_bytes(8, 8, fmt="TIFF")
    with pytest.raises(BadRequest, match=r"not an image in an accepted format \(media.formats: jpeg, png"):
        read_header(tiff, formats=FORMATS, max_pixels=None, locator="x")
    assert read_header(tiff, formats=pil_formats(("tiff",)), max_pixels=None, locator="x").format == "tiff"


def test_not_an_image_is_400() -> None:
    with pytest.raises(BadRequest, match="not an image"):
        read_header(b"hello, world", formats=FORMATS, max_pixels=None, locator="x")


def test_truncated_jpeg_is_400_on_decode() -> None:
    data = image_bytes(256, 256)
    truncated = data[: len(data) // 2]
    read_header(truncated, formats=FORMATS, max_pixels=None, locator="x")  # the header itself is intact
    with pytest.raises(BadRequest, match="x: image cannot be decoded"):
        decode_rgb(truncated, formats=FORMATS, locator="x")


@pytest.mark.parametrize(
    ("mode", "fmt"), [("RGBA", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("CMYK", "JPEG"), ("L", "JPEG"), ("RGB", "WEBP")]
)
def test_decode_converts_to_rgb(mode: str, fmt: str) -> None:
    image = decode_rgb(image_bytes(16, 12, fmt=fmt, mode=mode), formats=FORMATS, locator="x")
    assert image.mode == "RGB"
    assert image.size == (16, 12)


def test_transparent_pixels_become_white() -> None:
    import io

    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    assert decode_rgb(out.getvalue(), formats=FORMATS, locator="x").getpixel((0, 0)) == (255, 255, 255)


def test_unknown_format_in_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported formats"):
        pil_formats(("jpeg", "heic"))
