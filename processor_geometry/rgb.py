"""The one rule that turns a decoded image into RGB, and the memory that takes.

The rule is transformers' `convert_to_rgb`: an image with an alpha band or a `transparency` entry is composited
onto opaque white; every other image converts with Pillow's `convert("RGB")`. The gateway (before counting and
forwarding) and engine mode (before resizing) both use `to_rgb`, so the two paths give the same pixels.

The results are pixel-identical to transformers' implementation, with less memory held at once: RGBA and LA are
pasted through their own alpha onto a white RGB image (no RGBA copy, no composite image), and a palette image's
transparency is composited into its 256 palette entries instead of into every pixel.
"""

from __future__ import annotations

from PIL import Image, ImageMode

__all__ = ["conversion_bytes", "has_transparency", "pixel_size", "to_rgb"]

WHITE = (255, 255, 255)

# Modes whose alpha byte `Image.paste` reads as the mask and whose colour bytes it copies into an RGB image.
_PASTE_MODES = frozenset({"RGBA", "LA"})


def pixel_size(mode: str) -> int:
    """Bytes Pillow stores per pixel of `mode`: 1 for "1", "L" and "P", 2 for the I;16 modes, 4 for every other
    mode, whatever its band count (RGB, LA, PA, YCbCr... are held in 4 bytes a pixel)."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


def has_transparency(image: Image.Image) -> bool:
    """Whether `to_rgb` composites this image onto white (transformers' test)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as RGB; the input itself when it is RGB without transparency. The input is not modified."""
    if not has_transparency(image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if image.mode == "P":
        return _flatten_palette(image).convert("RGB")
    if image.mode in _PASTE_MODES:
        return _onto_white(image)
    return _onto_white(image.convert("RGBA"))


def conversion_bytes(mode: str, width: int, height: int, *, transparency: bool) -> int:
    """Peak bytes `to_rgb` allocates for an image of this mode and size, the result included.

    `transparency`: the image has a `transparency` entry (modes with an alpha band always composite).
    """
    pixels = width * height
    rgb = pixels * pixel_size("RGB")
    if not ("A" in ImageMode.getmode(mode).bands or transparency):
        return 0 if mode == "RGB" else rgb
    if mode == "P":
        return pixels * pixel_size("P") + rgb  # the flattened palette copy, then the RGB result
    if mode in _PASTE_MODES:
        return rgb
    return pixels * pixel_size("RGBA") + rgb  # the RGBA conversion, then the RGB result


def _onto_white(image: Image.Image) -> Image.Image:
    """RGBA or LA pasted through its own alpha onto white. Pillow stores LA as L, L, L, A, so both paste as RGB;
    the arithmetic equals `Image.alpha_composite` onto opaque white followed by `convert("RGB")`."""
    background = Image.new("RGB", image.size, WHITE)
    background.paste(image, (0, 0), image)
    return background


def _flatten_palette(image: Image.Image) -> Image.Image:
    """A copy of a palette image whose palette entries are composited onto white, without its transparency.

    Each pixel's RGBA value depends on its palette index alone, so compositing the 256 entries (converted by the
    same `convert("RGBA")` that a whole-image conversion would use) gives the same pixels as compositing them all.
    """
    ramp = image.crop((0, 0, 256, 1))  # keeps the palette and the transparency entry
    ramp.putdata(range(256))
    entries = _onto_white(ramp.convert("RGBA"))
    flat = image.copy()
    del flat.info["transparency"]
    flat.putpalette(entries.tobytes("raw", "RGB"), "RGB")
    return flat
