"""Reading an image's header, and decoding it to RGB the way the model servers do. Runs on worker threads."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from gateway.errors import BadRequest, RequestTooLarge
from gateway.storage import mode_pixel_bytes

# limits.max_image_pixels is checked against the header before any decode; Pillow's own global check would
# otherwise apply a second, different threshold.
Image.MAX_IMAGE_PIXELS = None

# Pillow's plugin names for the formats media.formats may list.
PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF"}


@dataclass(frozen=True, slots=True)
class ImageHeader:
    format: str
    width: int
    height: int
    mode: str

    @property
    def rgb_bytes(self) -> int:
        """Bytes of the decoded RGB image the model server works from (3 per pixel)."""
        return mode_pixel_bytes("RGB", self.width, self.height)


def pil_formats(formats: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [name for name in formats if name not in PIL_FORMATS]
    if unknown:
        raise ValueError(f"media.formats has unsupported formats {unknown}; known: {sorted(PIL_FORMATS)}")
    return tuple(PIL_FORMATS[name] for name in formats)


def read_header(data: bytes, *, formats: tuple[str, ...], max_pixels: int | None, locator: str) -> ImageHeader:
    """Identify the image from its header alone; refuse a disallowed format or too many pixels before decoding."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError:
        allowed = ", ".join(name.lower() for name in formats)
        raise BadRequest(
            f"{locator}: not an image in an accepted format (media.formats: {allowed})", reason="bad_media"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadRequest(f"{locator}: unreadable image header ({exc})", reason="bad_media") from None
    header = ImageHeader(format=(image.format or "").lower(), width=image.width, height=image.height, mode=image.mode)
    image.close()
    if max_pixels is not None and header.width * header.height > max_pixels:
        raise RequestTooLarge(
            f"{locator}: image is {header.width}x{header.height} = {header.width * header.height:,} pixels, "
            f"over limits.max_image_pixels={max_pixels:,}",
            reason="image_too_large",
        )
    return header


def decode_rgb(data: bytes, *, formats: tuple[str, ...], locator: str) -> Image.Image:
    """Decode fully (a truncated or corrupt file is a 400) and convert to RGB.

    RGBA is composited onto white, as vLLM does; every other mode converts with Pillow's `convert("RGB")`.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data), formats=formats)
            image.load()
    except (OSError, ValueError, SyntaxError, UnidentifiedImageError) as exc:
        raise BadRequest(f"{locator}: image cannot be decoded ({exc})", reason="bad_media") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")
