"""The gateway's processed-part charge against transformers' own processors, per family: 12 image sizes (1x1 to
8000x6000, portrait, panoramas) and 3 clips (vLLM's 32 frames; trtllm-serve's 10), each measured in a process of its
own (tests/gateway/processors/measure.py). Prints charge / measured peak (min / median / max) and the sizes
whose token count differs from the processor's.

    make .venv/.installed-torchvision && .venv/bin/python -m tests.bench.bench_processors [FAMILY...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from gateway.processors import FAMILIES, load
from tests.gateway.processors.measure import measure

IMAGES = [
    [1, 1],
    [64, 64],
    [640, 480],
    [480, 640],
    [1024, 768],
    [1280, 720],
    [1920, 1080],
    [1080, 1920],
    [4000, 3000],
    [8000, 6000],
    [4000, 500],
    [6000, 400],
]
CLIPS = [[32, 640, 360], [32, 1280, 720], [10, 1920, 1080]]


def main(names: list[str]) -> None:
    build = Path(tempfile.mkdtemp(prefix="bench_processors_"))
    print("| family | images: charge / peak (min / median / max) | clips: charge / peak | token mismatches |")
    print("| --- | --- | --- | --- |")
    for name in names or list(FAMILIES):
        family = load(name)
        measured = measure(build, name, {"images": IMAGES, "clips": CLIPS}, timeout=900)
        ratios, mismatches = [], []
        for item in measured["images"]:
            w, h = item["size"]
            made = family.image(h, w)
            ratios.append(made.peak / item["peak"])
            if [made.tokens] != item["tokens"]:
                mismatches.append(f"{w}x{h}")
        clips = []
        for item in measured["clips"]:
            t, w, h = item["clip"]
            clip = family.video(t, h, w)
            if clip is not None:
                clips.append(clip.peak / item["peak"])
                if [clip.tokens] != item["tokens"]:
                    mismatches.append(f"clip {t}x{w}x{h}")

        def spread(values: list[float]) -> str:
            if not values:
                return "no video processor"
            return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

        print(f"| {name} | {spread(ratios)} | {spread(clips)} | {', '.join(mismatches) or 'none'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
