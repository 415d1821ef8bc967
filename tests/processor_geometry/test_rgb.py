"""processor_geometry/rgb.py: transformers' `convert_to_rgb`, pixel for pixel, and the memory it takes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

# --- the RGB conversion rule --------------------------------------------------------------------------------


def _every_value_and_alpha() -> dict[str, Image.Image]:
    """Images of the modes a decoder gives, holding every (value, alpha) pair of 8-bit samples."""
    value, alpha = (grid.astype(np.uint8) for grid in np.meshgrid(np.arange(256), np.arange(256)))
    palette = np.random.default_rng(4).integers(0, 256, 768, dtype=np.uint8).tobytes()
    paletted = Image.frombytes("P", (256, 256), value.tobytes())
    paletted.putpalette(palette)
    pa = paletted.convert("PA")
    pa.putalpha(Image.fromarray(alpha))
    by_index = paletted.copy()
    by_index.info["transparency"] = 7
    by_alphas = paletted.copy()
    by_alphas.info["transparency"] = bytes(np.random.default_rng(5).integers(0, 256, 200, dtype=np.uint8))
    grey_keyed = Image.fromarray(value)
    grey_keyed.info["transparency"] = 9
    rgb_keyed = Image.fromarray(np.stack([value, alpha, value], -1))
    rgb_keyed.info["transparency"] = (5, 9, 5)
    return {
        "RGBA": Image.fromarray(np.stack([value, 255 - value, value // 2, alpha], -1)),
        "LA": Image.frombytes("LA", (256, 256), np.stack([value, alpha], -1).tobytes()),
        "PA": pa,
        "P": paletted,
        "P+transparent index": by_index,
        "P+alpha per entry": by_alphas,
        "L": Image.fromarray(value),
        "L+transparent value": grey_keyed,
        "RGB+transparent colour": rgb_keyed,
        "I;16": Image.fromarray(value.astype(np.uint16) * 257 + alpha),
        "CMYK": Image.frombytes("CMYK", (256, 256), np.stack([value, alpha, 255 - value, alpha // 2], -1).tobytes()),
        "1": Image.fromarray(value > 100),
    }


@pytest.mark.parametrize("case", list(_every_value_and_alpha()))
def test_to_rgb_is_transformers_convert_to_rgb(case: str) -> None:
    import warnings

    from transformers.image_transforms import convert_to_rgb

    from processor_geometry.rgb import to_rgb

    image = _every_value_and_alpha()[case]
    pixels, info, palette = image.tobytes(), dict(image.info), image.getpalette("RGBA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = convert_to_rgb(image.copy(), return_numpy=True)
    converted = to_rgb(image)
    assert converted.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(converted), expected, err_msg=case)
    assert (image.tobytes(), image.info, image.getpalette("RGBA")) == (pixels, info, palette)  # input untouched


def test_conversion_bytes_counts_the_images_to_rgb_makes() -> None:
    from processor_geometry.rgb import conversion_bytes

    pixels = 100 * 50
    assert conversion_bytes("RGB", 100, 50, transparency=False) == 0
    assert conversion_bytes("L", 100, 50, transparency=False) == 4 * pixels  # Pillow's RGB: 4 bytes a pixel
    assert conversion_bytes("RGBA", 100, 50, transparency=False) == 4 * pixels  # pasted straight onto white
    assert conversion_bytes("LA", 100, 50, transparency=False) == 4 * pixels
    assert conversion_bytes("P", 100, 50, transparency=True) == 5 * pixels  # the flattened copy, then RGB
    assert conversion_bytes("PA", 100, 50, transparency=False) == 8 * pixels  # RGBA first
    assert conversion_bytes("RGB", 100, 50, transparency=True) == 8 * pixels
