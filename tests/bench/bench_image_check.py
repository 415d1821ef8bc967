"""CPU per image in each `media.decode` mode, side by side against `full`: a markdown table of medians.

    .venv/bin/python tests/bench/bench_image_check.py [--repeats 30]

Each image is a gradient with noise (photo-like sizes when encoded). One measurement is what the gateway runs on
a media thread for the item, from its bytes: `open_image` (the header read, every mode), then the mode's work:
`decode_opened` (full: the decode and the RGB conversion), `check_opened` (check), nothing (header). Modes are
interleaved in one process, one round of every image and mode at a time; each cell is the median of the rounds'
CPU times (`time.thread_time`, the calling thread's).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("full", "check", "header")


def images() -> dict[str, bytes]:
    import numpy as np
    from PIL import Image

    def photo(width: int, height: int, seed: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        noise = rng.integers(-24, 24, (height, width, 3), dtype=np.int16)
        ramp = (np.arange(width, dtype=np.int16) * 200 // width)[None, :, None]
        return Image.fromarray(np.clip(noise + ramp + 28, 0, 255).astype(np.uint8))

    def encoded(image: Image.Image, fmt: str, **save: Any) -> bytes:
        out = io.BytesIO()
        image.save(out, format=fmt, **save)
        return out.getvalue()

    small, large = photo(640, 480, 1), photo(1024, 768, 2)
    return {
        "JPEG 640x480 q90": encoded(small, "JPEG", quality=90),
        "JPEG 1024x768 q90": encoded(large, "JPEG", quality=90),
        "JPEG 1024x768 progressive": encoded(large, "JPEG", quality=90, progressive=True),
        "PNG 640x480": encoded(small, "PNG"),
        "PNG 1024x768": encoded(large, "PNG"),
        "WebP 1024x768 q80": encoded(large, "WEBP", quality=80),
        "GIF 1024x768": encoded(large.convert("P"), "GIF"),
    }


def work(mode: str, data: bytes) -> Callable[[], None]:
    from gateway.media.image.check import check_opened
    from gateway.media.image.decode import decode_opened, open_image, pil_formats

    formats = pil_formats(("jpeg", "png", "webp", "gif", "bmp"))

    def run() -> None:
        opened = open_image(data, formats=formats, max_pixels=None, locator="bench")
        if mode == "full":
            decode_opened(opened, locator="bench", max_jpeg_scans=100)
        elif mode == "check":
            check_opened(opened, locator="bench", max_jpeg_scans=100)
        else:
            opened.close()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    cases = images()
    runs = {(name, mode): work(mode, data) for name, data in cases.items() for mode in MODES}
    for run in runs.values():  # warm-up: Pillow's plugins and codecs loaded
        run()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            started = time.thread_time()
            run()
            times[key].append(time.thread_time() - started)
    print(f"CPU per image, median of {args.repeats} rounds (ms); check and header also as a share of full\n")
    print("| image | bytes | full | check | header | check / full | header / full |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, data in cases.items():
        full, check, header = (statistics.median(times[name, mode]) * 1000 for mode in MODES)
        print(
            f"| {name} | {len(data):,} | {full:.2f} | {check:.3f} | {header:.3f} "
            f"| {check / full:.1%} | {header / full:.1%} |"
        )


if __name__ == "__main__":
    main()
